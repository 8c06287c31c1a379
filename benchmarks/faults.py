"""A rank lost mid-epoch: what the survivors going on (``on_rank_loss="continue"``) costs, against today's path
(torchrun restarts every process from the last checkpoint), in the same run.

    python -m benchmarks.faults              # the example app, 4 ranks, each strategy (about 30 minutes on 2 cores)
    python -m benchmarks.faults --strategies sharded_ps --paths launcher torchrun
    python -m benchmarks.faults --strategies sharded_ps+servers --paths launcher server server_silent torchrun \
        --name faults_dedicated
    python -m benchmarks.faults --strategies ring_allreduce parameter_server sharded_ps \
        --paths join per_host_join emulated_join --name faults_join
    python -m benchmarks.faults --strategies ring_allreduce parameter_server sharded_ps --paths grow \
        --fault-step 20 --app trainer.max_epochs=30 --name faults_grow
    python -m benchmarks.faults --strategies sharded_ps+servers --paths server_again --fault-step 20 \
        --app trainer.max_epochs=30 --name faults_server_again
    python -m benchmarks.faults --strategies ring_allreduce parameter_server sharded_ps --paths leave \
        --fault-step 30 --name faults_leave

Every row is one run of the example app (``examples/train.py``: the digits, the reference CNN, a global batch of
128, 10 epochs of 10 steps), 4 ranks, one of ``--strategies`` (``ring_allreduce``, ``parameter_server``,
``sharded_ps``: the servers among the trainers; ``sharded_ps+servers``: two dedicated servers that trainer 0
starts), a checkpoint every ``--checkpoint-every`` steps.
The fault: the named rank SIGKILLs itself as training step ``--fault-step`` starts (in the first attempt only). The
paths:

- **the strategy's launcher** (one machine; rank 0 started the others, so the rank lost is rank 2);
- **one process per host**: 4 processes started apart (Lightning's general cluster environment), so global rank 0
  is an ordinary rank and is the one lost;
- **emulated hosts**: 4 hosts (network namespaces joined by the delay switch, 1 Gbit/s links), one process each;
  the fault is not a kill but host 3's link cut silently (no reset reaches anyone), found by the heartbeat
  (``heartbeat_timeout`` below); the cut host stops, a minority of one (needs root);
- **a dedicated server lost** (``+servers`` only; the strategy's launcher): trainer 0 SIGKILLs dedicated server 0
  instead, whose share its replica on server 1 takes over; **a dedicated server silent** (``server_silent``):
  trainer 0 SIGSTOPs it instead (its connections stay open, as a host cut off leaves them), found by the leader's
  probe within ``heartbeat_timeout`` (below);
- **a dedicated server started again** (``server_again``, ``+servers`` only): server 0 lost as above, then the
  benchmark starts ``python -m lightning_dp.server`` for it again (the trainers' ``MASTER_ADDR`` and ``MASTER_PORT``):
  it claims its place, the trainers let it in at a step boundary and it takes its share back. Measured: from its
  start to serving, the trainers' step that let it in, the bytes it took back, and the median steps/s of rank 0
  over the 20 steps before the loss and the 20 after its return;
- **torchrun restart** (``--nproc-per-node 4 --max-restarts 1``, ``on_rank_loss="stop"``, ``ckpt_path=last``): every
  process restarts and resumes from the newest checkpoint;
- **a new process joins** (``join``: the strategy's launcher with ``restart_lost_ranks=1`` starts rank 2 again;
  ``per_host_join``: one process per host, the benchmark starts rank 2 again with the same command;
  ``emulated_join``: the same on the emulated hosts, rank 2 killed and started again on its host): 4 ranks, one
  killed, 3 go on, the new process joins, 4 again. Measured: the join (from the new process's start to the end of
  its first step), the members' pause (its admission and the handover, as the members report it), the bytes the
  new process was handed, and the median steps/s of rank 0 over the 20 steps before the fault and the 20 steps after
  the join (``join_window``);
- **the job grows** (``grow``: one process per host): 2 ranks started with ``max_ranks=4``; as step
  ``--fault-step`` starts, the benchmark starts ranks 2 and 3 (the same command for 4 nodes), which join in turn.
  No rank is lost; the global batch stays the app's 128 samples (64 per rank on 2 ranks, then 32). Measured
  as for a join, each new process's; steps/s over the 20 steps before the growth and after the last join's first
  step. Its baseline is the 2 ranks that do not grow.
- **a member leaves on purpose** (``leave``: one process per host): as step ``--fault-step`` starts, rank 3 sends
  itself ``SIGUSR2`` (a host drained); its share is dealt among the others from the first batch no loader has drawn,
  and it leaves at that batch's boundary (4 ranks, then 3). Measured: the step it left after, the members' pause
  (their change, as they report it), the trainers' step with the leave against a step before, and the median
  steps/s of rank 0 over the 20 steps before the ask and the 20 after the leave.

Each path runs once without the fault (its baseline) and once with it. Recovery: from the fault to the end of the
first step every survivor completed after it (that step's own computation included); of which the agreement: from
the change to the survivors going on (the strategy's ``rank_loss.metrics()``). Wall time lost: the run's seconds
less its baseline's. Steps redone: trained again after the fault (torchrun: from the checkpoint to the fault; the
survivors: the exchange in flight, run again over them).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

from benchmarks.netns import SUBNET, delayed_hosts
from benchmarks.report import save
from lightning_dp.strategies.launchers import RESTART_VARIABLE
from tests.helpers.launch import kill_process_tree

REPO = Path(__file__).resolve().parent.parent
RANKS = 4
#: the app's options every run shares
APP = ["callbacks.model_checkpoint.monitor=null", "callbacks.model_checkpoint.save_top_k=1",
       "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false", "logger=csv"]  # fmt: skip


class FaultClock(pl.Callback):
    """Records when each training step ends on each rank (``<folder>/steps-rank<r>.txt``: attempt, step, time), and
    makes rank ``rank`` SIGKILL itself as training step ``step`` starts in the first attempt (``<folder>/fault``:
    when), or (``cut``) only say it got there (``<folder>/at-fault``), for the benchmark to cut its link; or SIGKILL
    (``silent``: SIGSTOP) the dedicated server ``server`` it started instead; or (``leave``) send itself ``SIGUSR2``,
    asking to leave the job. Passed to the app as a Hydra callback
    (``+callbacks.fault=...``)."""

    def __init__(
        self, folder: str, rank: int = -1, step: int = -1, cut: bool = False, server: int = -1, silent: bool = False,
        leave: bool = False,
    ) -> None:  # fmt: skip
        self.folder, self.rank, self.step, self.cut, self.server = Path(folder), rank, step, cut, server
        self.silent, self.leave = silent, leave

    def setup(self, trainer: pl.Trainer, pl_module: Any, stage: str) -> None:
        if _attempt() > 0:  # a new process in the lost rank's place: when it started
            (self.folder / f"started-rank{trainer.strategy.global_rank}").write_text(f"{_process_start()!r}\n")

    def on_train_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
        rank_loss = getattr(trainer.strategy, "rank_loss", None)
        if rank_loss is not None:
            name = f"rank_loss-rank{trainer.strategy.global_rank}-attempt{_attempt()}.json"
            (self.folder / name).write_text(json.dumps(rank_loss.metrics()))

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self.step and trainer.strategy.global_rank == self.rank and _attempt() == 0:
            if self.cut:
                (self.folder / "at-fault").touch()
                return
            (self.folder / "fault").write_text(f"{time.time()!r} {trainer.global_step}\n")
            if self.leave:
                os.kill(os.getpid(), signal.SIGUSR2)
                return
            if self.server >= 0:  # the dedicated server this rank started, instead of itself
                process = trainer.strategy.engine.processes[self.server]  # type: ignore[attr-defined]
                os.kill(process.pid, signal.SIGSTOP if self.silent else signal.SIGKILL)
                return
            os.kill(os.getpid(), signal.SIGKILL)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        with open(self.folder / f"steps-rank{trainer.strategy.global_rank}.txt", "a") as log:
            log.write(f"{_attempt()} {trainer.global_step} {time.time()!r}\n")


def _attempt() -> int:
    """0 in the job's first processes; torchrun's restart count, or in a process started again in a lost rank's
    place its restart count (``LIGHTNING_DP_RESTART``)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or os.environ.get(RESTART_VARIABLE) or 0)


def _process_start() -> float:
    """When this process started, in ``time.time()``'s clock (Linux: its start in clock ticks after boot, in
    ``/proc/self/stat``, plus the boot time in ``/proc/stat``)."""
    ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
    boot = next(
        int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines() if line.startswith("btime")
    )
    return boot + ticks / os.sysconf("SC_CLK_TCK")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict[str, str]:
    drop = (
        "MASTER_ADDR",
        "MASTER_PORT",
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "NODE_RANK",
        "LOCAL_WORLD_SIZE",
        "GLOO_SOCKET_IFNAME",
    )  # (the strategies find the interface towards MASTER_ADDR themselves)
    return {**{k: v for k, v in os.environ.items() if k not in drop}, "PYTHONPATH": str(REPO),
            "PYTHONWARNINGS": "ignore"}  # fmt: skip


def _kill_all(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            kill_process_tree(p.pid)
            p.wait()


def _wait(procs: list[subprocess.Popen], timeout: float, poll: Any = None) -> list[int | None]:
    """Every process's exit code (``None``: killed, with its children, after ``timeout`` seconds); ``poll()`` runs
    every few milliseconds meanwhile."""
    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        if poll is not None:
            poll()
        time.sleep(0.005 if poll is not None else 0.05)
    codes: list[int | None] = []
    for p in procs:
        if p.poll() is None:
            kill_process_tree(p.pid)
            p.wait()
            codes.append(None)
        else:
            codes.append(p.returncode)
    return codes


def run_path(strategy: str, path: str, fault: bool, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """One run of the app with ``strategy`` on ``path`` (with the fault or not): its measurements."""
    with ExitStack() as stack:
        return _run_path(strategy, path, fault, args, tmp, stack)


def _run_path(
    strategy: str, path: str, fault: bool, args: argparse.Namespace, tmp: Path, stack: ExitStack
) -> dict[str, Any]:
    folder = tmp / f"{strategy}-{path}-{'fault' if fault else 'clean'}"
    folder.mkdir()
    server = path in SERVER_PATHS
    lost = {"per_host": 0, "emulated": RANKS - 1}.get(path, 0 if server else 2)
    join = path in JOIN_PATHS
    grow = path == "grow"
    if grow:  # (rank 0 only says it got to the step; nothing is lost)
        lost = 0
    leave = path == "leave"
    if leave:  # (the rank that asks to leave: nothing is lost)
        lost = RANKS - 1
    fault_options = [f"+callbacks.fault.rank={lost}", f"+callbacks.fault.step={args.fault_step}",
                     f"+callbacks.fault.cut={path in ('emulated', 'grow')}",
                     f"+callbacks.fault.server={0 if server else -1}",
                     f"+callbacks.fault.silent={path == 'server_silent'}",
                     f"+callbacks.fault.leave={leave}"] if fault else []  # fmt: skip
    name, *options = strategy.split("+")
    servers = [f"strategy.num_servers={SERVERS}"] if options == ["servers"] else []
    overrides = [f"strategy={name}", *servers, *APP, *args.app,
                 f"+callbacks.model_checkpoint.every_n_train_steps={args.checkpoint_every}",
                 f"hydra.run.dir={folder}/run", "+callbacks.fault._target_=benchmarks.faults.FaultClock",
                 f"+callbacks.fault.folder={folder}", *fault_options]  # fmt: skip
    app = str(REPO / "examples" / "train.py")
    apart = path in ("per_host", "emulated", "per_host_join", "emulated_join", "grow", "leave")
    started = GROWN_FROM if grow else RANKS
    logs = [open(folder / f"process{i}.log", "w") for i in range(started if apart else 1)]  # noqa: SIM115
    start = time.perf_counter()
    poll = None
    #: a server started again (``server_again``): when and the process; when it said it joined
    again: list[tuple[float, subprocess.Popen]] = []
    in_again: list[float] = []
    if path in ("emulated", "emulated_join"):
        hosts = stack.enter_context(delayed_hosts(RANKS, rate_mbit=1000, latency_ms=0.1))
        command = [sys.executable, app, *overrides, "trainer.devices=1", f"trainer.num_nodes={RANKS}",
                   "strategy.on_rank_loss=continue",
                   f"strategy.heartbeat_timeout={args.heartbeat_timeout}"]  # fmt: skip
        env = {**_env(), "MASTER_ADDR": f"{SUBNET}.1", "MASTER_PORT": str(_free_port()), "WORLD_SIZE": str(RANKS),
               "LOCAL_RANK": "0"}  # fmt: skip
        procs = [subprocess.Popen(["ip", "netns", "exec", host, *command], cwd=folder, stdout=logs[i],
                                  stderr=subprocess.STDOUT, start_new_session=True,
                                  env={**env, "NODE_RANK": str(i)})
                 for i, host in enumerate(hosts)]  # fmt: skip

        def poll() -> None:
            if path == "emulated_join":  # the lost rank died: start it again on its host with the same command
                if procs[lost].poll() not in (None, 0) and len(procs) == RANKS:
                    logs.append(open(folder / f"process{RANKS}.log", "w"))  # noqa: SIM115
                    again = {**env, "NODE_RANK": str(lost), RESTART_VARIABLE: "1"}
                    procs.append(subprocess.Popen(["ip", "netns", "exec", hosts[lost], *command], cwd=folder,
                                                  stdout=logs[-1], stderr=subprocess.STDOUT, start_new_session=True,
                                                  env=again))  # fmt: skip
            elif (folder / "at-fault").exists() and not (folder / "fault").exists():  # the lost rank's link cut
                hosts.cut(lost)
                (folder / "fault").write_text(f"{time.time()!r} {args.fault_step}\n")
    elif path in ("launcher", "join") or server:
        command = [sys.executable, app, *overrides, f"trainer.devices={RANKS}", "strategy.on_rank_loss=continue"]
        if path == "join":
            command += ["strategy.restart_lost_ranks=1"]
        if path == "server_silent":
            command += [f"strategy.heartbeat_timeout={args.heartbeat_timeout}"]
        port = str(_free_port())  # (known here: a server started again finds the job there)
        procs = [subprocess.Popen(command, cwd=folder, env={**_env(), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port},
                                  stdout=logs[0], stderr=subprocess.STDOUT, start_new_session=True)]  # fmt: skip
        if path == "server_again" and fault:
            # the threads the strategy's launcher gives the processes it starts, the servers among them
            threads = {**_env(), "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // RANKS))}

            def poll() -> None:  # the server was lost: start it again with python -m lightning_dp.server
                if (folder / "fault").exists() and not again:
                    log = open(folder / "server-again.log", "w")  # noqa: SIM115
                    logs.append(log)
                    again.append((time.time(), subprocess.Popen(
                        [sys.executable, "-m", "lightning_dp.server", "--master-addr", "127.0.0.1", "--master-port",
                         port, "--server-index", "0", "--num-servers", str(SERVERS), "--timeout", "120"],
                        cwd=folder, env=threads, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                    )))  # fmt: skip
                    stack.callback(_kill_all, [again[0][1]])
                elif again and not in_again and "joined the running job" in (folder / "server-again.log").read_text():
                    in_again.append(time.time())
    elif grow:
        port = str(_free_port())
        command = [sys.executable, app, *overrides, "trainer.devices=1", "strategy.on_rank_loss=continue",
                   f"strategy.max_ranks={RANKS}"]  # fmt: skip
        env = {**_env(), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "LOCAL_RANK": "0"}
        procs = [subprocess.Popen([*command, f"trainer.num_nodes={GROWN_FROM}"], cwd=folder, stdout=logs[i],
                                  stderr=subprocess.STDOUT, start_new_session=True,
                                  env={**env, "WORLD_SIZE": str(GROWN_FROM), "NODE_RANK": str(i)})
                 for i in range(GROWN_FROM)]  # fmt: skip

        def poll() -> None:  # rank 0 got to the step: start the two new processes, for a world of RANKS
            if (folder / "at-fault").exists() and len(procs) == GROWN_FROM:
                (folder / "fault").write_text(f"{time.time()!r} {args.fault_step}\n")
                for i in range(GROWN_FROM, RANKS):
                    logs.append(open(folder / f"process{i}.log", "w"))  # noqa: SIM115
                    procs.append(subprocess.Popen(
                        [*command, f"trainer.num_nodes={RANKS}"], cwd=folder, stdout=logs[-1],
                        stderr=subprocess.STDOUT, start_new_session=True,
                        env={**env, "WORLD_SIZE": str(RANKS), "NODE_RANK": str(i), RESTART_VARIABLE: "1"},
                    ))  # fmt: skip

    elif path in ("per_host", "per_host_join", "leave"):
        port = str(_free_port())
        command = [sys.executable, app, *overrides, "trainer.devices=1", f"trainer.num_nodes={RANKS}",
                   "strategy.on_rank_loss=continue"]  # fmt: skip
        envs = [{**_env(), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "WORLD_SIZE": str(RANKS),
                 "NODE_RANK": str(i), "LOCAL_RANK": "0"} for i in range(RANKS)]  # fmt: skip
        procs = [subprocess.Popen(command, cwd=folder, stdout=logs[i], stderr=subprocess.STDOUT,
                                  start_new_session=True, env=envs[i])
                 for i in range(RANKS)]  # fmt: skip
        if join:

            def poll() -> None:  # the lost rank died: start it again with the same command
                if procs[lost].poll() not in (None, 0) and len(procs) == RANKS:
                    logs.append(open(folder / f"process{RANKS}.log", "w"))  # noqa: SIM115
                    procs.append(
                        subprocess.Popen(
                            command,
                            cwd=folder,
                            stdout=logs[-1],
                            stderr=subprocess.STDOUT,
                            start_new_session=True,
                            env={**envs[lost], RESTART_VARIABLE: "1"},
                        )
                    )
    else:
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(RANKS), "--max-restarts",
                   "1", "--master-port", str(_free_port()), app, *overrides, f"trainer.devices={RANKS}",
                   "strategy.on_rank_loss=stop", "ckpt_path=last"]  # fmt: skip
        procs = [subprocess.Popen(command, cwd=folder, env=_env(), stdout=logs[0], stderr=subprocess.STDOUT,
                                  start_new_session=True)]  # fmt: skip
    stack.callback(_kill_all, procs)  # (a failure before they finish leaves none running)
    codes = _wait(procs, args.run_timeout, poll)
    seconds = time.perf_counter() - start
    if again:  # (stopped by trainer 0 at the fit's end)
        codes.append(again[0][1].wait(30))
        want_again = [0]
    stack.close()
    for log in logs:
        log.close()
    metrics_file = folder / "run" / "metrics.json"
    nothing_lost = server or grow or leave
    want = [-9 if fault and i == lost and not nothing_lost else 0 for i in range(len(procs))] if apart else [0]
    if again:
        want += want_again
    if grow and fault and len(procs) != RANKS:
        want = [0] * RANKS
    if path == "emulated" and fault:  # the cut host stops on its own, a minority of one
        want[lost] = 1
    if codes != want or not metrics_file.exists():
        tail = "".join((folder / f"process{i}.log").read_text()[-3000:] for i in range(len(procs)))
        raise RuntimeError(f"{path} ({'fault' if fault else 'no fault'}): exit codes {codes}, expected {want}\n{tail}")
    metrics = json.loads(metrics_file.read_text())
    row: dict[str, Any] = {
        "strategy": strategy, "path": path, "fault": fault,
        "lost_rank": lost if fault and not nothing_lost else None, "left_rank": lost if fault and leave else None,
        "lost_server": lost if fault and server else None, "seconds": seconds,
        "test_acc": metrics["metrics"].get("test_acc"), "global_step": metrics["global_step"],
    }  # fmt: skip
    if fault and grow:
        row.update(_growth(folder, args.fault_step, metrics.get("rank_loss") or {}))
    elif fault and leave:
        row.update(_leave(folder, args.fault_step, metrics.get("rank_loss") or {}))
    elif fault:
        row.update(_recovery(folder, lost, args.fault_step, first_processes_only=join))
        loss = metrics.get("rank_loss") or {}
        reported = loss.get("server_recovery_seconds" if server else "recovery_seconds")
        row["recovery_seconds_reported"] = (reported or [None])[0]
        row["dropped_samples"] = loss.get("dropped_samples")
        if path != "torchrun":
            row["steps_redone"] = loss.get("redone_steps", 0)
        if join:
            row.update(_join(folder, lost, args.fault_step, loss))
        if again:
            row.update(_server_again(folder, args.fault_step, loss, again[0][0], in_again))
    return row


def _steps(folder: Path, rank: int) -> list[tuple[int, int, float]]:
    """``(attempt, step, time)`` of every step rank ``rank`` ended."""
    log = folder / f"steps-rank{rank}.txt"
    return [(int(a), int(s), float(t)) for a, s, t in (line.split() for line in log.read_text().splitlines())]


def _join(folder: Path, lost: int, fault_step: int, loss: dict[str, Any]) -> dict[str, Any]:
    """The join's measurements (see the module docstring)."""
    (join_step,) = loss["join_steps"]
    joined = [(s, t) for a, s, t in _steps(folder, lost) if a > 0]
    started = float((folder / f"started-rank{lost}").read_text())
    new = json.loads((folder / f"rank_loss-rank{lost}-attempt1.json").read_text())
    ends = {s: t for a, s, t in _steps(folder, 0)}

    def median_rate(first: int, last: int) -> float:
        return _median_rate(ends, first, last)

    window = JOIN_WINDOW
    return {
        "join_step": join_step, "join_seconds": joined[0][1] - started, "join_asked_seconds": new["join_seconds"],
        "join_pause_seconds": loss["join_pause_seconds"][0], "handover_bytes": new["handover_bytes"][0],
        "first_step_with_it_seconds": ends[join_step + 1] - ends[join_step],
        "steps_per_second_before": median_rate(fault_step - window, fault_step - 1),
        "steps_per_second_after": median_rate(join_step + 2, join_step + 1 + window), "join_window": window,
    }  # fmt: skip


def _server_again(
    folder: Path, fault_step: int, loss: dict[str, Any], started: float, joined: list[float]
) -> dict[str, Any]:
    """A lost server started again (see the module docstring): when it served again, what it took back, steps/s."""
    (step,) = loss["server_return_steps"]
    done = re.search(r"shares taken back: (\d+) bytes", (folder / "server-again.log").read_text())
    if done is None or not joined:
        raise RuntimeError(f"the server started again did not say it joined and what it took back ({folder})")
    ends = {s: t for a, s, t in _steps(folder, 0)}
    return {
        "return_step": step, "return_seconds": joined[0] - started, "return_claim_seconds":
        loss["server_return_seconds"][0], "taken_back_bytes": int(done.group(1)),
        "step_with_return_seconds": ends[step + 1] - ends[step],
        "steps_per_second_before": _median_rate(ends, fault_step - JOIN_WINDOW, fault_step - 1),
        "steps_per_second_after": _median_rate(ends, step + 2, step + 1 + JOIN_WINDOW), "join_window": JOIN_WINDOW,
        "median_step_seconds": 1 / _median_rate(ends, fault_step - JOIN_WINDOW, fault_step - 1),
    }  # fmt: skip


def _growth(folder: Path, grow_step: int, loss: dict[str, Any]) -> dict[str, Any]:
    """The growth's measurements (see the module docstring): per new process, as :func:`_join` measures one."""
    ends = {s: t for a, s, t in _steps(folder, 0)}
    seconds, asked, moved = [], [], []
    for rank in loss["joined_ranks"]:  # (in the order they joined, as the members' lists are)
        first_end = _steps(folder, rank)[0][2]
        seconds.append(first_end - float((folder / f"started-rank{rank}").read_text()))
        new = json.loads((folder / f"rank_loss-rank{rank}-attempt1.json").read_text())
        asked.append(new["join_seconds"])
        moved.append(new["handover_bytes"][0])
    last = max(loss["join_steps"])
    return {
        "joined_ranks": loss["joined_ranks"], "join_steps": loss["join_steps"], "join_seconds_each": seconds,
        "join_asked_seconds_each": asked, "join_pause_seconds_each": loss["join_pause_seconds"],
        "handover_bytes_each": moved,
        "steps_per_second_before": _median_rate(ends, grow_step - JOIN_WINDOW, grow_step - 1),
        "steps_per_second_after": _median_rate(ends, last + 2, last + 1 + JOIN_WINDOW), "join_window": JOIN_WINDOW,
    }  # fmt: skip


def _leave(folder: Path, ask_step: int, loss: dict[str, Any]) -> dict[str, Any]:
    """The leave's measurements (see the module docstring)."""
    (step,) = loss["leave_steps"]
    ends = {s: t for a, s, t in _steps(folder, 0)}
    return {
        "left_ranks": loss["left_ranks"], "leave_step": step, "leave_pause_seconds": loss["leave_pause_seconds"][0],
        "dropped_samples": loss["dropped_samples"], "step_with_leave_seconds": ends[step + 1] - ends[step],
        "median_step_seconds": 1 / _median_rate(ends, ask_step - JOIN_WINDOW, ask_step - 1),
        "steps_per_second_before": _median_rate(ends, ask_step - JOIN_WINDOW, ask_step - 1),
        "steps_per_second_after": _median_rate(ends, step + 2, step + 1 + JOIN_WINDOW), "join_window": JOIN_WINDOW,
    }  # fmt: skip


def _median_rate(ends: dict[int, float], first: int, last: int) -> float:
    """Rank 0's median steps/s over steps ``first`` to ``last`` (``ends``: when each step ended)."""
    rates = [1 / (ends[s] - ends[s - 1]) for s in range(first, last + 1) if s in ends and s - 1 in ends]
    if not rates:
        raise RuntimeError(f"no step of rank 0 between {first} and {last}: too few steps around the fault and join")
    return statistics.median(rates)


def _recovery(folder: Path, lost: int, fault_step: int, first_processes_only: bool = False) -> dict[str, Any]:
    """From the step logs and the fault's time: the seconds from the fault to the end of the first step every
    survivor completed after it, and (a restart) the steps trained again; ``first_processes_only``: a new process's
    steps (a join) are not the survivors'."""
    fault_time = float((folder / "fault").read_text().split()[0])
    first_after: list[float] = []
    resumed_at: list[int] = []
    for log in sorted(folder.glob("steps-rank*.txt")):
        entries = [(int(a), int(s), float(t)) for a, s, t in (line.split() for line in log.read_text().splitlines())]
        if first_processes_only:
            entries = [e for e in entries if e[0] == 0]
        later = [e for e in entries if e[2] > fault_time]
        if not later:
            continue
        first_after.append(later[0][2])
        restarted = [s for a, s, _ in entries if a > 0]
        if restarted:
            resumed_at.append(min(restarted) - 1)
    row: dict[str, Any] = {"recovery_seconds": max(first_after) - fault_time}
    if resumed_at:
        row["steps_redone"] = fault_step - min(resumed_at)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fault-step", type=int, default=35)
    parser.add_argument("--checkpoint-every", type=int, default=20)
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=STRATEGIES)
    parser.add_argument("--paths", nargs="+", default=None,
                        help="launcher, per_host, emulated (needs root: network namespaces), server, server_silent "
                             "(+servers only), torchrun; default: launcher, per_host, emulated (as root only), "
                             "torchrun")  # fmt: skip
    parser.add_argument("--heartbeat-timeout", type=float, default=5.0,
                        help="heartbeat_timeout of the emulated hosts and of the silent server's run")  # fmt: skip
    parser.add_argument("--app", nargs="*", default=[], help="more overrides of the app (e.g. trainer.max_epochs=4)")
    parser.add_argument("--run-timeout", type=float, default=400.0)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    parser.add_argument("--name", default="faults", help="the result's name (<out>/<name>.json)")
    args = parser.parse_args()
    if args.paths is None:
        args.paths = ["launcher", "per_host", *(["emulated"] if os.geteuid() == 0 else []), "torchrun"]
        if "emulated" not in args.paths:
            print("not root: the emulated hosts' path is left out (it builds network namespaces)", file=sys.stderr)
    rows = []
    with tempfile.TemporaryDirectory(prefix="lddp-faults-") as tmp:
        for strategy in args.strategies:
            for path in args.paths:
                for fault in (False, True):
                    try:
                        rows.append(run_path(strategy, path, fault, args, Path(tmp)))
                    except Exception:
                        kept = shutil.copytree(tmp, tempfile.mkdtemp(prefix="lddp-faults-failed-"), dirs_exist_ok=True)
                        print(f"the runs' folders are kept in {kept}", file=sys.stderr)
                        raise
                    print(rows[-1], flush=True)
    for row in rows:
        row["fault_step"], row["checkpoint_every"] = args.fault_step, args.checkpoint_every
        if row["path"] in ("emulated", "server_silent"):
            row["heartbeat_timeout"] = args.heartbeat_timeout
    save(args.out, args.name, rows, report_lines)


#: the strategies a run may compare (the servers among the trainers; ``+servers``: ``SERVERS`` dedicated servers)
STRATEGIES = ("ring_allreduce", "parameter_server", "sharded_ps", "sharded_ps+servers")
SERVERS = 2
#: the paths that lose dedicated server 0 instead of a trainer
SERVER_PATHS = ("server", "server_silent", "server_again")
#: the paths where a new process joins in the lost rank's place, and the steps compared before the loss and after
JOIN_PATHS = ("join", "per_host_join", "emulated_join")
JOIN_WINDOW = 20
#: the ranks the growth path starts with (it grows to ``RANKS``)
GROWN_FROM = 2
PATHS = {
    "launcher": "survivors go on (strategy's launcher)",
    "server": "a dedicated server lost, its replica takes over (strategy's launcher)",
    "server_silent": "a dedicated server silent (SIGSTOP), found by the leader's probe (strategy's launcher)",
    "server_again": "a dedicated server lost and started again (strategy's launcher)",
    "per_host": "survivors go on (one process per host)",
    "emulated": "survivors go on (emulated hosts, link cut)",
    "torchrun": "torchrun restarts from the checkpoint",
    "join": "a new process joins (the strategy's launcher restarts it)",
    "per_host_join": "a new process joins (one process per host, started again by hand)",
    "emulated_join": "a new process joins (emulated hosts, 1 Gbit/s, started again on its host)",
    "grow": "the job grows from 2 to 4 ranks (one process per host)",
    "leave": "a member leaves on purpose (one process per host, SIGUSR2)",
}


def report_lines(rows: list[dict]) -> list[str]:
    """The table of ``rows`` (``Machine: ...`` first)."""
    first = rows[0]
    lines = [
        f"Machine: {os.cpu_count()} CPU cores, {platform.machine()}, torch {torch.__version__}; the example app "
        f"(digits, reference CNN, global batch 128), {RANKS} ranks, a checkpoint every "
        f"{first['checkpoint_every']} steps, one rank or dedicated server SIGKILLed (emulated hosts: its link cut, "
        "where no new process joins; a silent server: SIGSTOPped) as step "
        f"{first['fault_step']} starts.",
        "",
        "| strategy | path | rank lost | seconds (no fault) | seconds (fault) | wall time lost (s) | recovery (s) "
        "| of which the agreement (s) | steps redone | samples dropped | test accuracy (no fault / fault) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    baselines = {(r["strategy"], r["path"]): r for r in rows if not r["fault"]}
    if any(r["path"] == "grow" for r in rows):
        lines[0] = (f"Machine: {os.cpu_count()} CPU cores, {platform.machine()}, torch {torch.__version__}; the "
                    "example app (digits, reference CNN, global batch 128: 64 samples per rank on 2 ranks), started on "
                    f"{GROWN_FROM} ranks with max_ranks={RANKS}; as step {first['fault_step']} starts, the "
                    f"processes of ranks {GROWN_FROM} to {RANKS - 1} are started (at once) and join in "
                    "turn.")  # fmt: skip
        return lines[:2] + growth_lines(rows, baselines)
    if any(r["path"] == "leave" for r in rows):
        lines[0] = (f"Machine: {os.cpu_count()} CPU cores, {platform.machine()}, torch {torch.__version__}; the "
                    f"example app (digits, reference CNN, global batch 128), {RANKS} ranks, one process per host; as "
                    f"step {first['fault_step']} starts, rank {RANKS - 1} sends itself SIGUSR2 and leaves the job at "
                    "the boundary its share ends at.")  # fmt: skip
        return lines[:2] + leave_lines(rows, baselines)
    if any(r["path"] in JOIN_PATHS for r in rows):
        return lines[:2] + join_lines(rows, baselines)
    if any(r["path"] == "server_again" for r in rows):
        return lines[:2] + server_again_lines(rows, baselines)
    for r in rows:
        if not r["fault"]:
            continue
        base = baselines[r["strategy"], r["path"]]
        if r.get("lost_server") is not None:
            lost = f"server {r['lost_server']}"
        else:
            lost = "global 0" if r["lost_rank"] == 0 else str(r["lost_rank"])
        if r["path"] in ("emulated", "server_silent"):
            lost += f" (heartbeat_timeout={r['heartbeat_timeout']:g} s)"
        dropped = r.get("dropped_samples")
        reported = r.get("recovery_seconds_reported")
        # (a lost server's reported seconds are its whole regroup, not the trainers' agreement alone)
        agreement = f"{reported:.2f}" if reported is not None and r["path"] not in SERVER_PATHS else "-"
        lines.append(
            f"| {_strategy(r['strategy'])} | {PATHS[r['path']]} | {lost} | {base['seconds']:.1f} | {r['seconds']:.1f} "
            f"| {r['seconds'] - base['seconds']:.1f} | {r['recovery_seconds']:.2f} | {agreement} "
            f"| {r.get('steps_redone', 0)} "
            f"| {dropped if dropped is not None else '-'} | {_accuracy(base)} / {_accuracy(r)} |"
        )
    return lines


def join_lines(rows: list[dict], baselines: dict) -> list[str]:
    """The joins' table: 4 ranks, one lost, 3 go on, a new process joins, 4 again."""
    lines = [
        "| strategy | path | join (s) | of which asking to join (s) | members' pause (s) "
        "| their first step with it (s) | bytes handed over | steps/s before the loss | steps/s after the join "
        "| after / before "
        "| test accuracy (no fault / fault) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r, base, before, after in _faulted(rows, baselines):
        lines.append(
            f"| {_strategy(r['strategy'])} | {PATHS[r['path']]} | {r['join_seconds']:.2f} "
            f"| {r['join_asked_seconds']:.2f} | {r['join_pause_seconds']:.3f} | {r['first_step_with_it_seconds']:.2f} "
            f"| {r['handover_bytes'] / 1e3:.1f} kB "
            f"| {before:.1f} | {after:.1f} | {after / before:.2f}× | {_accuracy(base)} / {_accuracy(r)} |"
        )
    lines += ["", "Join: from the new process's start to the end of its first step; asking to join: from its request "
              "(its set-up done) to holding the state. Members' pause: their admission of it and the handover; their "
              "first step with it also waits for its restore and the start of its loop. Steps/s: rank 0's median over "
              f"the {rows[0].get('join_window', JOIN_WINDOW)} steps before the fault and as many after the join's "
              "first step."]  # fmt: skip
    return lines


def server_again_lines(rows: list[dict], baselines: dict) -> list[str]:
    """The table of a lost server started again: 2 servers, then 1, then 2 again."""
    lines = [
        "| strategy | served again (after step) | start to serving (s) | of which from its claim (s) "
        "| the trainers' step with it (s) | a step before (s) | bytes taken back | steps/s before the loss "
        "| steps/s after its return | after / before | test accuracy (no fault / fault) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r, base, before, after in _faulted(rows, baselines):
        lines.append(
            f"| {_strategy(r['strategy'])} | {r['return_step']} | {r['return_seconds']:.2f} "
            f"| {r['return_claim_seconds']:.2f} | {r['step_with_return_seconds']:.3f} "
            f"| {r['median_step_seconds']:.3f} | {r['taken_back_bytes'] / 1e3:.1f} kB "
            f"| {before:.1f} | {after:.1f} | {after / before:.2f}× | {_accuracy(base)} / {_accuracy(r)} |"
        )
    lines += ["", "Start to serving: from the benchmark starting `python -m lightning_dp.server` again to its saying "
              "it joined (its interpreter's start and imports included); from its claim: from its claim on the run's "
              "store to the trainers going on with it (the leader's clock; it waits for the next step boundary). The "
              "trainers' step with it: the step whose boundary let it in (the change, the regroup, the state handed "
              "back and the replicas made again), against rank 0's median step before the loss. Steps/s: rank 0's "
              f"median over the {rows[0].get('join_window', JOIN_WINDOW)} steps before the loss and as many after "
              "its return's step."]  # fmt: skip
    return lines


def growth_lines(rows: list[dict], baselines: dict) -> list[str]:
    """The growth's table: 2 ranks, then 3, then 4."""
    lines = [
        "| strategy | joined (after step) | join (s) | of which asking to join (s) | members' pause (s) "
        "| bytes handed over | steps/s on 2 ranks | steps/s on 4 | 4 / 2 | test accuracy (2 ranks / grown) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r, base, before, after in _faulted(rows, baselines):
        joined = ", ".join(f"rank {k} ({s})" for k, s in zip(r["joined_ranks"], r["join_steps"], strict=True))

        def each(values: list[float], unit: str = "") -> str:
            return " / ".join(f"{v:.2f}{unit}" for v in values)

        lines.append(
            f"| {_strategy(r['strategy'])} | {joined} | {each(r['join_seconds_each'])} "
            f"| {each(r['join_asked_seconds_each'])} | {' / '.join(f'{v:.3f}' for v in r['join_pause_seconds_each'])} "
            f"| {' / '.join(f'{b / 1e6:.1f} MB' for b in r['handover_bytes_each'])} "
            f"| {before:.1f} | {after:.1f} | {after / before:.2f}× | {_accuracy(base)} / {_accuracy(r)} |"
        )
    lines += ["", "Per new process, in the order they joined. Steps/s: rank 0's median over the "
              f"{rows[0].get('join_window', JOIN_WINDOW)} steps before the growth and as many after the last join's "
              "first step; four processes share the machine's cores, so a step on 4 ranks is no faster here (on "
              "machines of their own each rank's share of the step would halve)."]  # fmt: skip
    return lines


def leave_lines(rows: list[dict], baselines: dict) -> list[str]:
    """The leave's table: 4 ranks, then 3."""
    lines = [
        "| strategy | left (after step) | members' pause (s) | the step with the leave (s) | a step before (s) "
        "| samples dropped | steps/s on 4 ranks | steps/s on 3 | 3 / 4 | test accuracy (no leave / leave) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r, base, before, after in _faulted(rows, baselines):
        lines.append(
            f"| {_strategy(r['strategy'])} | rank {r['left_ranks'][0]} ({r['leave_step']}) "
            f"| {r['leave_pause_seconds']:.3f} | {r['step_with_leave_seconds']:.3f} | {r['median_step_seconds']:.3f} "
            f"| {r['dropped_samples']} | {before:.1f} | {after:.1f} | {after / before:.2f}× "
            f"| {_accuracy(base)} / {_accuracy(r)} |"
        )
    lines += ["", "Members' pause: from the change that lets the rank go to the members going on (as they report it); "
              "the step with the leave: the step whose boundary let it go, against rank 0's median step before. "
              f"Steps/s: rank 0's median over the {rows[0].get('join_window', JOIN_WINDOW)} steps before the ask and "
              "as many after the leave's step. The processes share the machine's cores and a step's work (its 128 "
              "samples) is the same on 4 ranks and on 3, so steps/s change little here; on machines of their own "
              "each rank's share of a step would grow by a third."]  # fmt: skip
    return lines


def _faulted(rows: list[dict], baselines: dict) -> Iterator[tuple[dict, dict, float, float]]:
    """Each row with the fault, its baseline, and its steps/s before the fault and after the change measured."""
    for r in rows:
        if r["fault"]:
            yield r, baselines[r["strategy"], r["path"]], r["steps_per_second_before"], r["steps_per_second_after"]


def _strategy(name: str) -> str:
    strategy, *options = name.split("+")
    return f"`{strategy}`" + (f" ({SERVERS} dedicated servers)" if options == ["servers"] else "")


def _accuracy(row: dict) -> str:
    return f"{row['test_acc']:.3f}" if row.get("test_acc") is not None else "-"


if __name__ == "__main__":
    main()
