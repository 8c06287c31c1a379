"""The README a newcomer reads: short, the install, run and test commands on its first screen, the commands CI
runs, and a ``Use`` snippet that runs as pasted."""

import re
import subprocess
import sys

import pytest

from tests.helpers.launch import PYTHONWARNINGS, REPO

README = (REPO / "README.md").read_text()
FIRST_SCREEN = "\n".join(README.splitlines()[:60])


@pytest.mark.unit
def test_the_readme_is_short_with_the_three_commands_on_its_first_screen():
    assert len(README.splitlines()) <= 250
    for command in ('pip install ".[test]"', "python examples/train.py\n", "python -m pytest -q "):
        assert command in FIRST_SCREEN, command


@pytest.mark.unit
def test_ci_runs_the_readmes_install_and_test_commands():
    ci = (REPO / ".ci" / "run").read_text()
    assert 'python -m pip install ".[test]"' in ci and "\npython -m pytest -q\n" in ci


@pytest.mark.multiprocess
def test_the_use_snippet_runs_as_pasted(tmp_path):
    snippet = re.search(r"## Use\n.*?```python\n(.*?)```", README, re.S)
    assert snippet is not None
    (tmp_path / "demo.py").write_text(snippet[1])
    env = {"PYTHONWARNINGS": PYTHONWARNINGS, "PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)}  # this tree's package
    run = subprocess.run([sys.executable, "demo.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=180)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    # two ranks print the (sent, received) bytes of their last step: the sharded servers move bytes both ways
    printed = [tuple(map(int, m)) for m in re.findall(r"\((\d+), (\d+)\)", run.stdout)]
    assert len(printed) == 2 and all(sent > 0 and received > 0 for sent, received in printed), run.stdout[-2000:]
