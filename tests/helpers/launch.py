"""Run a training script in a subprocess (Lightning's popen launcher starts the other ranks) with a hard timeout:
``tests.scripts.<name>`` (:func:`run_script`) or the Hydra app ``examples/train.py`` (:func:`run_app`)."""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from tests.helpers.distributed import ask_for_stacks, free_port
from tests.helpers.launch_report import COUNTER
from tests.helpers.warm import WarmProcess, WarmStarter

REPO = Path(__file__).resolve().parents[2]
#: set by cluster schedulers; a test run must not pick them up from the machine's environment
CLUSTER_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "WORLD_SIZE", "RANK", "LOCAL_RANK", "GROUP_RANK",
                     "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "SLURM_JOB_ID", "SLURM_NTASKS")  # fmt: skip


def _package_modules(package: str = "lightning_dp") -> list[str]:
    """Dotted names of every module of ``package`` in this checkout: ``lightning_dp``, ``lightning_dp.comm.cost``..."""
    names = []
    for path in sorted((REPO / package).rglob("*.py")):
        parts = path.relative_to(REPO).with_suffix("").parts
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


#: PYTHONWARNINGS for the subprocesses: third-party warnings (Lightning's, torch's) are noise in test output, but a
#: warning that lightning_dp raises is shown. Later entries take precedence; the module field of PYTHONWARNINGS / -W
#: matches a module name exactly (not as a regex), so every module is listed. It is an environment variable, not a
#: -W flag, because Lightning's launcher starts the other ranks with this environment but without our flags. A
#: warning is matched by the module it is attributed to: one raised with a stacklevel that points out of the package
#: counts as the caller's.
PYTHONWARNINGS = ",".join(["ignore", *(f"default::Warning:{module}" for module in _package_modules())])


def subprocess_env(extra: dict | None = None) -> dict:
    """This process's environment for a test's subprocess: the checkout importable, one thread per rank, and
    :data:`PYTHONWARNINGS`; ``extra`` on top."""
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": PYTHONWARNINGS,
            **(extra or {})}  # fmt: skip


def launch_env() -> dict:
    """:func:`subprocess_env` without the cluster schedulers' variables: a single-node run on loopback."""
    return {k: v for k, v in subprocess_env().items() if k not in CLUSTER_VARIABLES}


#: forks the first process of each launch from an interpreter that has imported torch, Lightning and lightning_dp
WARM = WarmStarter(launch_env, REPO)
atexit.register(WARM.close)


def run_script(
    script: str, *args: str, timeout: float = 180, env: dict | None = None, check: bool = True,
    deaths_expected: bool = False, port: int | None = None, replace_killed: bool = False,
    grow: tuple[int, Path] | None = None,
) -> subprocess.CompletedProcess:  # fmt: skip
    """Run ``python -m tests.scripts.<script> args``; kill the whole process group on timeout. With
    ``LIGHTNING_DP_TEST_NODES=N`` in ``env``, start ``N`` processes, each a single-device node (``NODE_RANK``).

    With ``check`` a non-zero exit raises; the output (stdout and stderr) is in ``.stdout`` either way, and every
    process's exit code in ``.codes``. ``deaths_expected``: a process that exits non-zero gives the others no
    shorter time to finish (a test that kills one). ``port``: the nodes' ``MASTER_PORT`` (default: a free one).
    ``replace_killed``: a node killed by a signal is started again, once, with the same command and
    ``LIGHTNING_DP_TEST_REPLACEMENT=1`` (its code comes after the others' in ``.codes``). ``grow=(M, path)``: once
    ``path`` exists, nodes ``N`` to ``M - 1`` start as new processes of the running job (``WORLD_SIZE=M``, the
    command's ``--num-nodes`` set to ``M``, ``LIGHTNING_DP_TEST_REPLACEMENT=1``; their codes come last)."""
    full_env = {**launch_env(), **(env or {})}
    command = [sys.executable, "-m", f"tests.scripts.{script}", *args]
    nodes = int(full_env.get("LIGHTNING_DP_TEST_NODES") or 0)
    if nodes:  # Lightning's general-purpose cluster recipe: one single-device node per process, on loopback
        main_port = str(port or free_port())
        envs = [{**full_env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": main_port, "WORLD_SIZE": str(nodes),
                 "NODE_RANK": str(node), "LOCAL_RANK": "0"} for node in range(nodes)]  # fmt: skip
    else:
        envs = [full_env]
    later: tuple[Path, list[tuple[list[str], dict]]] | None = None
    if grow is not None:
        grown, when = grow
        if not nodes or "--num-nodes" not in command:
            raise ValueError("grow= needs LIGHTNING_DP_TEST_NODES and a command with --num-nodes N")
        at = command.index("--num-nodes") + 1
        bigger = [*command[:at], str(grown), *command[at + 1 :]]
        later = (when, [(bigger, {**envs[0], "WORLD_SIZE": str(grown), "NODE_RANK": str(node),
                                  "LIGHTNING_DP_TEST_REPLACEMENT": "1"}) for node in range(nodes, grown)])  # fmt: skip
    codes, outputs, timed_out = run_processes(command, envs, timeout, failure_grace=None if deaths_expected else
                                              FAILURE_GRACE_SECONDS, replace_killed=replace_killed,
                                              later=later)  # fmt: skip
    out = _joined(outputs)
    if timed_out:
        raise AssertionError(f"{script} {' '.join(args)} timed out after {timeout}s:\n{out[-5000:]}")
    returncode = next((code for code in codes if code), 0)
    if check and returncode != 0:
        raise AssertionError(f"{script} {' '.join(args)} exited with {returncode}:\n{out[-5000:]}")
    completed = subprocess.CompletedProcess(command, returncode, out, None)
    completed.codes = codes  # type: ignore[attr-defined]
    return completed


#: how long the other processes of a launch may take to fail on their own once one has failed (their errors tell
#: more than a kill), before they are killed
FAILURE_GRACE_SECONDS = 10.0


def run_processes(
    command: list[str], envs: list[dict], timeout: float, cwd: Path = REPO,
    failure_grace: float | None = FAILURE_GRACE_SECONDS, replace_killed: bool = False,
    later: tuple[Path, list[tuple[list[str], dict]]] | None = None,
) -> tuple[list[int], list[str], bool]:  # fmt: skip
    """Run ``command`` once per environment in ``envs`` (each in a session of its own, output to a file, not a
    pipe that could fill; started by :data:`WARM`) and wait for all: ``(exit codes, outputs, timed out)``. Once one
    exits non-zero the others get ``failure_grace`` seconds (``None``: no less than ``timeout``); at ``timeout`` all
    are killed, and nothing is left running either way. ``replace_killed``: see :func:`run_script`. ``later=(path,
    starts)``: each ``(command, environment)`` of ``starts`` is started once ``path`` exists."""
    logs = [tempfile.TemporaryFile(mode="w+") for _ in envs]
    procs: list[subprocess.Popen | WarmProcess] = []
    deadline = time.monotonic() + timeout
    timed_out = False
    try:
        with COUNTER.one_launch():
            for env, log in zip(envs, logs, strict=True):
                procs.append(WARM.start(command, env, cwd, log))
        replaced: set[int] = set()
        while any(p.poll() is None for p in procs):
            if later is not None and later[0].exists():
                for extra, env in later[1]:
                    logs.append(tempfile.TemporaryFile(mode="w+"))
                    procs.append(WARM.start(extra, env, cwd, logs[-1]))
                later = None
            for i, env in enumerate(envs):
                code = procs[i].poll() if replace_killed and i not in replaced else None
                if code is not None and code < 0:
                    replaced.add(i)
                    logs.append(tempfile.TemporaryFile(mode="w+"))
                    procs.append(WARM.start(command, {**env, "LIGHTNING_DP_TEST_REPLACEMENT": "1"}, cwd, logs[-1]))
            if time.monotonic() > deadline:
                timed_out = True
                ask_for_stacks([proc.pid for proc in procs if proc.poll() is None])
                break
            if failure_grace is not None and any(p.returncode for p in procs):
                deadline = min(deadline, time.monotonic() + failure_grace)
            time.sleep(0.05)
    finally:
        for proc in procs:
            _kill_group(proc)  # leave no rank behind
            proc.wait()
    outputs = []
    for log in logs:
        log.seek(0)
        outputs.append(log.read())
        log.close()
    return [p.returncode for p in procs], outputs, timed_out


def _kill_group(proc: subprocess.Popen | WarmProcess) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _joined(outputs: list[str]) -> str:
    """One process's output as it is; several under a header each (one per node)."""
    if len(outputs) == 1:
        return outputs[0]
    return "".join(f"--- node {node} ---\n{out}" for node, out in enumerate(outputs))


#: per-rank batch and optimizer steps of the equivalence runs of ``tests.scripts.fit`` (96 samples: every case stays
#: inside one epoch)
BATCH = 8
STEPS = 3


def load_ranks(out_dir: Path, world_size: int) -> list[dict]:
    return [torch.load(out_dir / f"rank{r}.pt") for r in range(world_size)]


#: a few steps of the Hydra app: one epoch of three batches, one validation and two test batches
QUICK = ["trainer.max_epochs=1", "trainer.limit_train_batches=3", "trainer.limit_val_batches=1",
         "trainer.limit_test_batches=2", "trainer.enable_progress_bar=false"]  # fmt: skip


def run_app(args, cwd, timeout=300, check=True):
    """Run ``examples/train.py args`` in ``cwd`` with :func:`launch_env` (a single-node run on loopback, whatever
    cluster variables this process has picked up); kill the whole process group on timeout.

    With ``check`` a non-zero exit fails the test. Returns (exit code, output).
    """
    command = [sys.executable, str(REPO / "examples" / "train.py"), *args]
    codes, outputs, timed_out = run_processes(command, [launch_env()], timeout, cwd=Path(cwd))
    if timed_out:
        raise AssertionError(f"train.py {args} timed out:\n{outputs[0][-4000:]}")
    if check:
        assert codes[0] == 0, outputs[0][-6000:]
    return codes[0], outputs[0]


def kill_process_tree(root: int) -> None:
    """SIGKILL ``root`` and every process below it, found by ancestry before any dies (torchrun starts each worker
    in a session of its own, out of reach of ``killpg``)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                parent = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry))
    found, todo = [root], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    for pid in found:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
