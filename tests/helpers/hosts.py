"""Processes started inside emulated hosts (``benchmarks.netns``), each with its output in a file."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from tests.helpers.launch import REPO, WARM
from tests.helpers.warm import WarmProcess


@dataclass
class Node:
    """A process started inside an emulated host, its output in the file ``log``."""

    process: subprocess.Popen | WarmProcess
    log: Path

    @property
    def returncode(self) -> int | None:
        return self.process.returncode

    def poll(self) -> int | None:
        return self.process.poll()


def start_in_host(host: str, argv: list[str], env: dict, log: Path) -> Node:
    """``argv`` inside ``host``'s network namespace, as ``ip netns exec`` runs it (warm where it can be)."""
    with log.open("w") as output:
        return Node(WARM.start(argv, env, REPO, output, netns=host), log)


def finish(nodes: list[Node], timeout: float) -> list[str]:
    """Wait for every node (``timeout`` seconds for all; raises ``TimeoutExpired`` past it, the nodes killed); the
    nodes' outputs."""
    deadline = time.monotonic() + timeout
    try:
        for node in nodes:
            node.process.wait(timeout=max(1, deadline - time.monotonic()))
    finally:
        stop(nodes)
    return [node.log.read_text() for node in nodes]


def stop(nodes: list[Node]) -> str:
    """Kill the nodes still running; the end of every node's output."""
    for node in nodes:
        if node.poll() is None:
            os.killpg(node.process.pid, signal.SIGKILL)
            node.process.wait()
    return "\n".join(node.log.read_text()[-3000:] for node in nodes)
