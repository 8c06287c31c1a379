"""Run a function in N fresh processes joined in a gloo group, with a hard deadline."""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

from tests.helpers.launch_report import COUNTER


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(
    rank: int, world_size: int, port: int, backend: str, fn: Callable, args: tuple, results: Any, env: dict
) -> None:
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # (its stacks, asked for by a deadline that passed)
    try:
        os.environ.clear()  # the test process's environment now, not the fork server's when it started
        os.environ.update(env)
        os.environ["OMP_NUM_THREADS"] = "1"
        if backend == "nccl":
            import torch

            torch.cuda.set_device(rank)
        if backend == "gloo-bound":  # lightning-dp's own rendezvous, sockets on loopback only
            from datetime import timedelta

            from lightning_dp.comm.cluster.rendezvous import init_bound_process_group

            timeout = timedelta(seconds=60)
            init_bound_process_group("gloo", "127.0.0.1", port, rank, world_size, timeout, single_host=True)
        else:
            dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
        results.put((rank, "ok", fn(rank, world_size, *args)))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


#: imported once by the fork server that starts the workers, instead of by every worker (seconds each on 2 cores)
PRELOAD = ["torch", "torch.distributed", "lightning_dp", "lightning_dp.comm", "pytest", "tests.helpers.distributed"]


def _context() -> Any:
    """Workers fork from a server that has imported :data:`PRELOAD` and nothing else: as fresh as ``spawn``'s (no
    state of the test process, no threads), without each importing torch again."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _start_workers(fn: Callable, world_size: int, args: tuple, backend: str) -> tuple[list, Any]:
    ctx = _context()
    results = ctx.SimpleQueue()
    port = free_port()
    env = dict(os.environ)
    procs = [
        ctx.Process(target=_worker, args=(rank, world_size, port, backend, fn, args, results, env), daemon=True)
        for rank in range(world_size)
    ]
    with COUNTER.one_launch():
        for p in procs:
            p.start()
    return procs, results


def run_distributed(
    fn: Callable, world_size: int, *args: Any, timeout: float = 120.0, backend: str = "gloo"
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes and return the results by rank.

    ``backend="nccl"`` puts rank ``r`` on GPU ``r``; ``"gloo-bound"`` joins through
    :func:`lightning_dp.comm.cluster.rendezvous.init_bound_process_group`. Raises ``AssertionError`` with the worker's
    traceback if any rank fails, and ``TimeoutError`` (after killing every worker) if the deadline passes, so a
    deadlock fails the test instead of hanging it.
    """
    procs, results = _start_workers(fn, world_size, args, backend)
    deadline = time.monotonic() + timeout
    collected: dict[int, Any] = {}
    try:
        while len(collected) < world_size:
            if time.monotonic() > deadline:
                _dump_stacks(procs)
                raise TimeoutError(f"distributed test did not finish in {timeout}s (ranks done: {sorted(collected)})")
            if results.empty():
                if any(p.exitcode not in (None, 0) for p in procs) and results.empty():
                    time.sleep(0.2)
                    if results.empty():
                        codes = [p.exitcode for p in procs]
                        raise AssertionError(f"a worker died without reporting, exit codes {codes}")
                time.sleep(0.01)
                continue
            rank, status, value = results.get()
            if status == "error":
                raise AssertionError(f"rank {rank} failed:\n{value}")
            collected[rank] = value
    finally:
        for p in procs:
            p.join(timeout=max(0.1, deadline - time.monotonic()) if len(collected) == world_size else 0.1)
            if p.is_alive():
                p.kill()
                p.join()
    return [collected[r] for r in range(world_size)]


def ask_for_stacks(pids: list[int]) -> None:
    """Have each of these test processes (still running, with ``faulthandler`` on ``SIGUSR1``) print its threads'
    stacks to stderr: what a hang waits for."""
    for pid in pids:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGUSR1)
    time.sleep(1.0)


def _dump_stacks(procs: list) -> None:
    ask_for_stacks([p.pid for p in procs if p.is_alive() and p.pid is not None])


def run_distributed_allow_deaths(fn: Callable, world_size: int, *args: Any, timeout: float = 120.0) -> list[Any]:
    """Like :func:`run_distributed`, for tests that kill ranks: a rank that dies without reporting gives ``None``.

    Still fails on a worker's exception and on the deadline (after killing every worker).
    """
    procs, results = _start_workers(fn, world_size, args, "gloo")
    deadline = time.monotonic() + timeout
    collected: dict[int, Any] = {}
    try:
        while any(p.is_alive() for p in procs) or not results.empty():
            if time.monotonic() > deadline:
                _dump_stacks(procs)
                raise TimeoutError(f"distributed test did not finish in {timeout}s (ranks done: {sorted(collected)})")
            while not results.empty():
                rank, status, value = results.get()
                if status == "error":
                    raise AssertionError(f"rank {rank} failed:\n{value}")
                collected[rank] = value
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()
    return [collected.get(r) for r in range(world_size)]
