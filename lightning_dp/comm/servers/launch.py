"""Dedicated servers started on this machine as child processes running ``python -m lightning_dp.server``."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence


def start_local_servers(
    master_addr: str, master_port: int, num_servers: int, run_key: str, timeout: float, scope: str
) -> list[subprocess.Popen]:
    """Start ``num_servers`` server processes on this machine, children of this process (they die with it)."""
    return [start_local_server(index, master_addr, master_port, num_servers, run_key, timeout, scope)
            for index in range(num_servers)]  # fmt: skip


def start_local_server(
    index: int, master_addr: str, master_port: int, num_servers: int, run_key: str, timeout: float, scope: str
) -> subprocess.Popen:
    """Start server ``index`` on this machine, a child of this process (it dies with it); the same command starts a
    lost server again, which then joins the running job."""
    command = [sys.executable, "-m", "lightning_dp.server", "--master-addr", master_addr, "--master-port",
               str(master_port), "--server-index", str(index), "--num-servers", str(num_servers), "--run-key",
               run_key, "--timeout", str(timeout), "--parent-pid", str(os.getpid()), "--scope", scope]  # fmt: skip
    # the trainer's import path (its script's folder included), so the servers find the user's optimizer class
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    return subprocess.Popen(command, env=env)  # noqa: S603 - our own module, our own interpreter


def stop_local_servers(processes: Sequence[subprocess.Popen], timeout: float) -> list[int]:
    """Wait up to ``timeout`` seconds for the servers to exit, kill those still running; their exit codes."""
    codes = []
    for process in processes:
        try:
            codes.append(process.wait(timeout))
        except subprocess.TimeoutExpired:
            process.kill()
            codes.append(process.wait())
    return codes
