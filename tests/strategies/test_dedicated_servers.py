"""Dedicated parameter-server processes (``num_servers > 0``): the load split and its formula, equivalence with one
process, failures named, no process left behind, checkpoints that resume under another strategy."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from itertools import pairwise

import pytest
import torch

from lightning_dp import ParameterServerStrategy, ShardedParameterServerStrategy
from lightning_dp.comm.buckets import GradientBucket
from lightning_dp.comm.cost import dedicated_exchange_seconds as communication_time
from lightning_dp.comm.errors import ConfigurationError
from lightning_dp.comm.servers import check_importable, member_segments, member_shares
from lightning_dp.comm.servers.members import MESSAGE_BYTES_VARIABLE
from tests.helpers.launch import BATCH, STEPS, load_ranks, run_script, subprocess_env
from tests.helpers.replicas import assert_identical_replicas
from tests.scripts.models import RegressionModel, reference_training

SERVER_LOG = re.compile(r"\[lightning_dp\.server\] server (\d+) \(pid (\d+)\)")


# ---------------------------------------------------------------------------------------------------- the split
@pytest.mark.unit
@pytest.mark.parametrize("n", [2, 3, 4, 6])
def test_the_split_balances_every_machine_and_gives_the_formula(n):
    ring = 2 * (n - 1) / n
    for k in range(0, n + 3):
        shares = member_shares(n, k, trainers_serve=True)
        assert len(shares) == n + k and sum(shares) == pytest.approx(1.0) and min(shares) >= 0
        x, y = shares[0], (shares[-1] if k else 0.0)
        trainer = (1 - x) + (n - 1) * x  # its gradients out to the other owners, its share's weights to the others
        server = n * y  # every trainer's gradients of its share in (the weights out: the same)
        t = communication_time(n, k, nbytes=1.0, bandwidth=1.0)
        assert max(trainer, server) == pytest.approx(t)
        if 0 < k <= n:
            assert trainer == pytest.approx(server)  # the optimum: no machine waits for another
            assert ring / t == pytest.approx(1 + k * (n - 2) / n**2)  # the speed-up over all-reduce
    assert communication_time(n, 0, 1.0, 1.0) == pytest.approx(ring)
    assert communication_time(n, n, 1.0, 1.0) == pytest.approx(1.0)


@pytest.mark.unit
def test_central_servers_share_whole_parameters_balanced_by_bytes():
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (10, 3, 50, 7, 30)]
    buckets = [GradientBucket(0, params[:2]), GradientBucket(1, params[2:])]
    shares = member_shares(2, 2, trainers_serve=False)
    assert shares == [0.0, 0.0, 0.5, 0.5]
    segments = member_segments(buckets, shares, whole_parameters=True)
    for bucket in buckets:  # contiguous, no gaps, trainers own nothing
        ranges = segments[bucket.index]
        assert ranges[0][1] == ranges[0][0] and ranges[1][1] == ranges[1][0]
        assert ranges[2][0] == 0 and ranges[2][1] == ranges[3][0] and ranges[3][1] == bucket.grad_numel
        for lo, hi in bucket.slices:  # every parameter whole on one server
            assert sum(1 for s, e in ranges if s < hi and lo < e) == 1
    served = [sum(segments[b.index][m][1] - segments[b.index][m][0] for b in buckets) for m in (2, 3)]
    assert served == [63, 37]  # the cut nearest to half of 100 elements lies after the 50-element parameter

    shares = member_shares(3, 1, trainers_serve=True)
    sharded = member_segments(buckets, shares, whole_parameters=False)
    for bucket in buckets:  # every bucket cut by the shares on its own: each push reaches every member
        ranges = sharded[bucket.index]
        assert ranges[0][0] == 0 and ranges[-1][1] == bucket.grad_numel
        assert all(a[1] == b[0] for a, b in pairwise(ranges))
        counts = [hi - lo for lo, hi in ranges]
        assert counts == pytest.approx([bucket.grad_numel * s for s in shares], abs=1) and min(counts) > 0


@pytest.mark.unit
def test_options_are_checked_at_construction():
    with pytest.raises(ConfigurationError, match="num_servers"):
        ParameterServerStrategy(num_servers=-1)
    with pytest.raises(ConfigurationError, match="staleness=0"):
        ShardedParameterServerStrategy(num_servers=1, staleness=2)
    with pytest.raises(ConfigurationError, match="compression='none'"):
        ShardedParameterServerStrategy(num_servers=1, compression="fp16")
    with pytest.raises(ConfigurationError, match="server_rank"):
        ParameterServerStrategy(num_servers=1, server_rank=1)
    with pytest.raises(ConfigurationError, match="start_servers"):
        ParameterServerStrategy(num_servers=1, start_servers="yes")


@pytest.mark.unit
@pytest.mark.parametrize("value", ["0", "-4", "1MB", ""])
def test_a_bad_partition_size_is_refused_at_construction(monkeypatch, value):
    monkeypatch.setenv(MESSAGE_BYTES_VARIABLE, value)
    with pytest.raises(ConfigurationError, match=f"{MESSAGE_BYTES_VARIABLE}=.*positive integer"):
        ShardedParameterServerStrategy(num_servers=1)
    ParameterServerStrategy()  # without servers the variable means nothing
    monkeypatch.setenv(MESSAGE_BYTES_VARIABLE, "4096")
    ShardedParameterServerStrategy(num_servers=1)


@pytest.mark.unit
def test_an_optimizer_the_servers_cannot_import_is_refused():
    class LocalSGD(torch.optim.SGD):
        pass

    check_importable(torch.optim.AdamW, "test")
    with pytest.raises(ConfigurationError, match="cannot be imported by the server processes"):
        check_importable(LocalSGD, "test")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _server_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lightning_dp.server", *args], capture_output=True, text=True,
                          timeout=timeout, env=subprocess_env())  # fmt: skip


@pytest.mark.multiprocess
def test_the_server_cli_refuses_bad_options_and_a_missing_job():
    port = str(_free_port())
    bad = _server_cli("--master-addr", "127.0.0.1", "--master-port", port, "--server-index", "2", "--num-servers", "2")
    assert bad.returncode == 2 and "--server-index must be in [0, 2)" in bad.stderr
    start = time.monotonic()
    missing = _server_cli("--master-addr", "127.0.0.1", "--master-port", port, "--server-index", "0",
                          "--num-servers", "1", "--timeout", "2")  # fmt: skip
    assert missing.returncode == 2 and f"found no lightning-dp job at 127.0.0.1:{port}" in missing.stderr
    assert time.monotonic() - start < 45


# ---------------------------------------------------------------------------------------------------- runs
def _server_pids(output: str) -> dict[int, int]:
    return {int(index): int(pid) for index, pid in SERVER_LOG.findall(output)}


def _assert_gone(pids, grace: float = 15.0) -> None:
    deadline = time.monotonic() + grace
    alive = set(pids)
    while alive and time.monotonic() < deadline:
        for pid in list(alive):
            try:
                os.kill(pid, 0)
                if open(f"/proc/{pid}/stat").read().split()[2] == "Z":  # a zombie has exited
                    alive.discard(pid)
            except (ProcessLookupError, FileNotFoundError):
                alive.discard(pid)
        time.sleep(0.2)
    assert not alive, f"server processes outlived the run: {sorted(alive)}"


CASES = [
    # strategy, trainers, servers, optimizer, clipping; without clipping by norm the servers step as buckets arrive
    ("parameter_server", 2, 1, "sgd", None),
    ("parameter_server", 3, 2, "adamw", "norm"),
    ("sharded_ps", 3, 2, "sgd", "norm"),
    ("sharded_ps", 2, 2, "adamw", "value"),
    ("sharded_ps", 3, 1, "sgd", None),  # the trainers keep a share: their own step after backward
]
#: cases that cut the model into a bucket per parameter, so that every member serves part of several buckets
SMALL_BUCKETS = {("sharded_ps", 3, 1, "sgd", None)}
#: cases whose servers step partitions of a few elements (bytes), cutting parameters and shares at odd places
PARTITION_BYTES = {("parameter_server", 2, 1, "sgd", None): "20", ("sharded_ps", 2, 2, "adamw", "value"): "12"}


@pytest.mark.multiprocess
@pytest.mark.parametrize("strategy, n, k, optimizer, clip", CASES, ids=["-".join(map(str, c)) for c in CASES])
def test_equals_one_process_on_the_global_batch(tmp_path, strategy, n, k, optimizer, clip):
    args = ["--strategy", strategy, "--devices", str(n), "--num-servers", str(k), "--optimizer", optimizer]
    args += ["--steps", str(STEPS)] + (["--clip", clip] if clip else [])
    small_buckets = (strategy, n, k, optimizer, clip) in SMALL_BUCKETS
    if small_buckets:
        args += ["--bucket-cap-mb", "0.000001"]
    partition = PARTITION_BYTES.get((strategy, n, k, optimizer, clip))
    env = {MESSAGE_BYTES_VARIABLE: partition} if partition else None
    run = run_script("fit", *args, "--out", str(tmp_path), env=env)
    ranks = load_ranks(tmp_path, n)
    trainable = sum(1 for p in RegressionModel().parameters() if p.requires_grad)
    assert ranks[0]["buckets"] == (trainable if small_buckets else 1)
    assert_identical_replicas(ranks)
    reference = reference_training(BATCH * n, STEPS, optimizer, clip=clip)
    assert len(ranks[0]["weights"]) == len(reference)
    for step, (got, want) in enumerate(zip(ranks[0]["weights"], reference, strict=True)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=f"step {step + 1} differs from one process")
    assert all(r["world_size"] == n for r in ranks)  # the servers are not Lightning ranks
    pids = _server_pids(run.stdout)
    assert sorted(pids) == list(range(k)) and "did not stop cleanly" not in run.stdout
    assert all(f"server {j} done after {STEPS} steps" in run.stdout for j in range(k))
    _assert_gone(pids.values())
    if strategy == "parameter_server":  # a trainer serves nothing: it receives all the weights (S), holds no state
        flags = 4 * sum(1 for p in RegressionModel().parameters() if p.requires_grad)
        assert ranks[0]["last_step_bytes"][1] == ranks[0]["sync_bytes"] - flags
        assert ranks[0]["optimizer_state_bytes"] == 0


@pytest.mark.multiprocess
def test_a_killed_server_is_named_by_every_trainer_and_nothing_is_left(tmp_path):
    args = ["--strategy", "sharded_ps", "--devices", "2", "--num-servers", "2", "--steps", "6", "--timeout", "60"]
    start = time.monotonic()
    run = run_script("fit", *args, "--kill-server-step", "3", "--out", str(tmp_path), timeout=150, check=False)
    assert run.returncode != 0
    assert time.monotonic() - start < 120
    assert "PeerUnreachableError" in run.stdout and "server 0 (member 2)" in run.stdout, run.stdout[-3000:]
    _assert_gone(_server_pids(run.stdout).values())


@pytest.mark.multiprocess
@pytest.mark.parametrize("rank", [0, 1])
def test_a_killed_trainer_stops_the_servers(tmp_path, rank):
    """Trainer 1 killed: trainer 0 fails and the servers exit non-zero with the reason; trainer 0 killed: its
    servers die with it (and remote ones lose its sockets)."""
    args = ["--strategy", "parameter_server", "--devices", "2", "--num-servers", "2", "--steps", "6"]
    run = run_script("fit", *args, "--kill-rank", str(rank), "--kill-step", "3", "--timeout", "30",
                     "--out", str(tmp_path), timeout=150, check=False)  # fmt: skip
    assert run.returncode != 0
    pids = _server_pids(run.stdout)
    assert sorted(pids) == [0, 1]
    _assert_gone(pids.values())
    if rank == 1:
        assert re.search(r"server \d stops: .*(rank 1|trainer 1)", run.stdout), run.stdout[-3000:]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_checkpoint_with_servers_resumes_under_ring_allreduce(tmp_path):
    ckpt = tmp_path / "epoch1.ckpt"
    run_script("resume", "--strategy", "sharded_ps", "--num-servers", "2", "--max-epochs", "1", "--save-to", str(ckpt),
               "--out", str(tmp_path / "a"), timeout=240)  # fmt: skip
    saved = torch.load(ckpt, weights_only=False)
    assert saved["optimizer_states"][0]["state"], "the servers' optimizer state is missing"
    run_script("resume", "--strategy", "ring_allreduce", "--max-epochs", "2", "--resume-from", str(ckpt),
               "--out", str(tmp_path / "b"))  # fmt: skip
    resumed = load_ranks(tmp_path / "b", 2)
    steps_per_epoch = 96 // (2 * 8)
    assert resumed[0]["global_step"] == 2 * steps_per_epoch
    assert torch.equal(resumed[0]["weights"][-1], resumed[1]["weights"][-1])
    uninterrupted = reference_training(2 * 8, 2 * steps_per_epoch, "adamw")
    torch.testing.assert_close(resumed[0]["weights"][-1], uninterrupted[-1], rtol=1e-5, atol=1e-5)
