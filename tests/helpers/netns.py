"""Whether this machine can build emulated hosts (``benchmarks.netns``): root, iproute2 and tc."""

from __future__ import annotations

import functools
import os
import shutil
import subprocess

import pytest


@functools.cache
def can_make_namespaces() -> bool:
    """Root, ``ip`` and ``tc`` present, and a probe namespace can be added (and is removed again); probed once."""
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None:
        return False
    probe = subprocess.run(["ip", "netns", "add", "lddp-probe"], capture_output=True)
    subprocess.run(["ip", "netns", "del", "lddp-probe"], capture_output=True)
    return probe.returncode == 0


#: skips a test (or, as ``pytestmark``, a module) that builds network namespaces where none can be made
skip_without_netns = pytest.mark.skipif(
    not can_make_namespaces(), reason="needs root, iproute2 and tc to create network namespaces"
)
