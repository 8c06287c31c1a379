"""What ``pip install .`` (not editable) puts in the wheel: every package of the source tree."""

from __future__ import annotations

import re

import pytest

from tests.helpers.launch import REPO


@pytest.mark.unit
def test_every_package_of_the_tree_is_installed():
    pyproject = (REPO / "pyproject.toml").read_text()
    block = re.search(r"^\[tool\.setuptools\]\npackages = \[(.*?)\]", pyproject, re.M | re.S)
    assert block is not None, "pyproject.toml lists no [tool.setuptools] packages"
    listed = set(re.findall(r'"([\w.]+)"', block.group(1)))
    packages = {".".join(init.parent.relative_to(REPO).parts) for init in (REPO / "lightning_dp").rglob("__init__.py")}
    assert packages, "no package found under lightning_dp/"
    assert packages <= listed, f"pyproject.toml [tool.setuptools] packages lacks {sorted(packages - listed)}"
