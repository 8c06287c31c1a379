"""Digests of a fixed list of deterministic training launches: evidence that a refactor changed no behaviour.

Each launch runs ``python -m tests.scripts.<fit|features> ... --out <tmpdir>`` in a given source tree (a single node
on loopback, two ranks started by Lightning's launcher unless ``--devices 1``) and keeps, for every rank file
``<out>/rank<r>.pt`` and every ModelCheckpoint file of a ``features`` launch, a sha256 of every tensor (with its
dtype and shape) and the plain numbers (byte counts, losses, steps) as they are. Run it on the tree before the
refactor and on the tree after it, then compare the two files; every launch must come out identical::

    python -m tests.scripts.digest_runs --tree /tmp/old-tree --out /tmp/digest-old.json
    python -m tests.scripts.digest_runs --tree . --out /tmp/digest-new.json
    python -m tests.scripts.digest_runs --compare /tmp/digest-old.json /tmp/digest-new.json

``--only NAME ...`` runs some launches (``--list`` names them all). The driver itself imports nothing from the tree
it runs, so this file need only exist in the checkout it is started from.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

#: set by cluster schedulers (and the socket choices that go with them): every launch is a single node on loopback
CLUSTER_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "WORLD_SIZE", "RANK", "LOCAL_RANK", "GROUP_RANK",
                     "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "SLURM_JOB_ID", "SLURM_NTASKS")  # fmt: skip

#: keys of a rank file that differ from run to run by design: "sockets" lists this rank's TCP connections (ports).
#: Everything else the scripts save (weights, buffers, losses, learning rates, sample order, byte counts, staleness
#: histograms of one-device runs) came out bit-identical across repeated runs of one tree.
VARYING_KEYS = frozenset({"sockets"})

#: what is kept of a ModelCheckpoint file (the rest holds paths of the run's temporary directory, callback and loop
#: state that the rank files already cover)
CHECKPOINT_KEYS = ("state_dict", "optimizer_states", "lr_schedulers", "epoch", "global_step")

#: launch name -> (script, its arguments before ``--out``, the fit launches' ``--steps 6`` added below)
_LAUNCHES: dict[str, tuple[str, str]] = {
    # Lightning's features in one launch each (see features.py): fit with ModelCheckpoint, validate, test, predict,
    # bf16-mixed, BatchNorm, manual optimization with two optimizers
    "features-ring_allreduce": ("features", "--phase main --strategy ring_allreduce"),
    "features-parameter_server": ("features", "--phase main --strategy parameter_server"),
    "features-sharded_ps": ("features", "--phase main --strategy sharded_ps"),
    "features-sharded_ps-servers2": ("features", "--phase main --strategy sharded_ps --num-servers 2"),
    "features-parameter_server-servers1": ("features", "--phase main --strategy parameter_server --num-servers 1"),
    # RegressionModel for 6 steps under one option or two (see fit.py)
    # compression with intra_node="ring": the default "shm" sends nothing to compress on one machine and runs
    # uncompressed (the strategy says so at set-up), which would leave the codecs out of the comparison
    "fit-ring_allreduce-bf16": ("fit", "--strategy ring_allreduce --intra-node ring --compression bf16"),
    "fit-ring_allreduce-powersgd": (
        "fit",
        "--strategy ring_allreduce --intra-node ring --compression powersgd --powersgd-rank 1 --powersgd-warmup 2",
    ),
    "fit-sharded_ps-bf16": ("fit", "--strategy sharded_ps --intra-node ring --compression bf16"),
    "fit-parameter_server-fp16": ("fit", "--strategy parameter_server --intra-node ring --compression fp16"),
    "fit-sharded_ps-clip_norm": ("fit", "--strategy sharded_ps --clip norm"),
    "fit-parameter_server-server_rank1-adamw": ("fit", "--strategy parameter_server --server-rank 1 --optimizer adamw"),
    "fit-sharded_ps-intra_ring": ("fit", "--strategy sharded_ps --intra-node ring"),
    "fit-sharded_ps-intra_shm": ("fit", "--strategy sharded_ps --intra-node shm"),
    "fit-parameter_server-servers1": ("fit", "--strategy parameter_server --num-servers 1"),
    # dedicated servers with clipping by value: the eager path
    "fit-sharded_ps-servers1-clip_value": ("fit", "--strategy sharded_ps --num-servers 1 --clip value"),
    "fit-sharded_ps-servers2-clip_norm": ("fit", "--strategy sharded_ps --num-servers 2 --clip norm"),
    # staleness is deterministic with one trainer only (with two, whose push lands first is a race)
    "fit-sharded_ps-devices1-staleness2": ("fit", "--strategy sharded_ps --devices 1 --staleness 2"),
    "fit-parameter_server-devices1-async": ("fit", "--strategy parameter_server --devices 1 --staleness none"),
}
LAUNCHES: dict[str, tuple[str, list[str]]] = {
    name: (script, args.split() + (["--steps", "6"] if script == "fit" else []))
    for name, (script, args) in _LAUNCHES.items()
}


def launch_env(tree: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in CLUSTER_VARIABLES}
    env.update({"PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"})
    return env


def check_tree(tree: Path) -> None:
    """Fail unless ``lightning_dp`` and the scripts import from ``tree`` (not, say, an editable install elsewhere)."""
    probe = "import lightning_dp, tests.scripts.models as m; print(lightning_dp.__file__); print(m.__file__)"
    out = subprocess.run([sys.executable, "-c", probe], cwd=tree, env=launch_env(tree), capture_output=True,
                         text=True, check=True).stdout.split()  # fmt: skip
    for path in out:
        if not Path(path).resolve().is_relative_to(tree):
            raise SystemExit(f"{path} imported from outside {tree}")


def run_launch(tree: Path, script: str, args: list[str], out: Path, timeout: float) -> tuple[int | None, str]:
    """Run one launch to completion (exit code) or to ``timeout`` (``None``); kill its process group either way."""
    command = [sys.executable, "-m", f"tests.scripts.{script}", *args, "--out", str(out)]
    with tempfile.TemporaryFile(mode="w+") as log:  # a file, not a pipe that could fill
        proc = subprocess.Popen(command, cwd=tree, env=launch_env(tree), stdout=log, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)  # fmt: skip
        try:
            code: int | None = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            try:  # leave no rank or server behind
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
        log.seek(0)
        return code, log.read()


def digest(value: Any) -> Any:
    """``value`` with every tensor replaced by ``"<dtype> <shape> <sha256 of its bytes>"``, through lists, tuples
    and dicts; numbers, strings, booleans and ``None`` as they are."""
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        # the bytes numpy().tobytes() gives, for every dtype (bfloat16 has no numpy counterpart)
        data = t.reshape(-1).view(torch.uint8).numpy().tobytes()
        return f"{str(t.dtype).removeprefix('torch.')} {list(t.shape)} {hashlib.sha256(data).hexdigest()}"
    if isinstance(value, dict):
        return {str(k): digest(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [digest(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return f"{type(value).__name__}: {value!r}"


def digest_out(out: Path) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for path in sorted(out.glob("rank*.pt")):
        saved = torch.load(path, map_location="cpu", weights_only=False)
        result[path.stem] = {k: digest(v) for k, v in saved.items() if k not in VARYING_KEYS}
    checkpoints = out / "checkpoints"
    if checkpoints.is_dir():
        result["checkpoints"] = {}
        for path in sorted(checkpoints.iterdir()):
            saved = torch.load(path, map_location="cpu", weights_only=False)
            result["checkpoints"][path.name] = {k: digest(saved[k]) for k in CHECKPOINT_KEYS if k in saved}
    return result


def run_all(tree: Path, names: list[str], out_json: Path, timeout: float) -> int:
    check_tree(tree)
    results: dict[str, Any] = {}
    failed = []
    start = time.monotonic()
    for name in names:
        script, args = LAUNCHES[name]
        began = time.monotonic()
        with tempfile.TemporaryDirectory(prefix="digest-") as tmp:
            code, log = run_launch(tree, script, args, Path(tmp), timeout)
            if code == 0:
                results[name] = digest_out(Path(tmp))
                status = "ok"
            else:
                results[name] = {"error": "timed out" if code is None else f"exit code {code}"}
                status = results[name]["error"]
                failed.append(name)
                print(log[-5000:], file=sys.stderr)
        print(f"{name}: {status} ({time.monotonic() - began:.0f} s)", flush=True)
        out_json.write_text(json.dumps(results, sort_keys=True, indent=1) + "\n")  # what is done so far survives
    print(f"{len(names)} launches in {time.monotonic() - start:.0f} s; {out_json} written", flush=True)
    if failed:
        print(f"failed: {' '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


def differences(a: Any, b: Any, path: str = "") -> list[str]:
    """Paths (dict keys joined by ``.``; list positions dropped) where ``a`` and ``b`` differ, one per leaf."""
    if isinstance(a, dict) and isinstance(b, dict):
        found = []
        for key in sorted(set(a) | set(b)):
            sub = f"{path}.{key}" if path else key
            if key not in a or key not in b:
                found.append(f"{sub} (only in {'B' if key not in a else 'A'})")
            else:
                found += differences(a[key], b[key], sub)
        return found
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for x, y in zip(a, b, strict=True) for d in differences(x, y, path)]
    both_nan = isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b)
    return [] if a == b or both_nan else [path]


def compare(file_a: Path, file_b: Path) -> int:
    a, b = json.loads(file_a.read_text()), json.loads(file_b.read_text())
    print(f"A = {file_a}, B = {file_b}")
    differ = False
    for name in sorted(set(a) | set(b)):
        if name not in a or name not in b:
            print(f"{name}: only in {'A' if name in a else 'B'}")
            differ = True
        elif "error" in a[name] or "error" in b[name]:
            print(f"{name}: failed (A: {a[name].get('error', 'ok')}, B: {b[name].get('error', 'ok')})")
            differ = True
        else:
            found = differences(a[name], b[name])
            counts: dict[str, int] = {}
            for path in found:
                counts[path] = counts.get(path, 0) + 1
            if counts:
                differ = True
                print(f"{name}: differ in")
                for path, n in counts.items():
                    print(f"  {path}" + (f" ({n} values)" if n > 1 else ""))
            else:
                print(f"{name}: identical")
    return 1 if differ else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tree", type=Path, help="the source tree to run the launches in")
    parser.add_argument("--out", type=Path, help="the JSON file of digests to write")
    parser.add_argument("--only", nargs="+", choices=list(LAUNCHES), metavar="NAME", help="run these launches only")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per launch before it is killed")
    parser.add_argument("--list", action="store_true", help="print the launch names and exit")
    parser.add_argument("--compare", nargs=2, type=Path, metavar=("A", "B"), help="compare two digest files")
    args = parser.parse_args()
    if args.list:
        for name, (script, launch_args) in LAUNCHES.items():
            print(f"{name}: {script} {' '.join(launch_args)}")
        return 0
    if args.compare:
        return compare(*args.compare)
    if args.tree is None or args.out is None:
        parser.error("--tree and --out are required (or --compare A B)")
    return run_all(args.tree.resolve(), args.only or list(LAUNCHES), args.out, args.timeout)


if __name__ == "__main__":
    sys.exit(main())
