"""``lightning_dp.advise``: the ranking follows the cost model, and ``python -m lightning_dp.advise`` runs offline,
quickly, with stable JSON."""

import json
import subprocess
import sys
import time

import pytest
import torch
from torch import nn

from lightning_dp.advise import Measured, advise, candidate_schemes
from lightning_dp.comm.cost import Link, Topology
from tests.helpers.launch import REPO, subprocess_env


def _measured(module: nn.Module, link: Link) -> Measured:
    nbytes = [sum(p.numel() * 4 for p in module.parameters())]
    return Measured(nbytes, 0.010, 0.020, 0.002, 2 * nbytes[0], link, "given")


@pytest.mark.unit
def test_latency_decides_between_the_ring_and_the_sharded_servers():
    model = nn.Sequential(nn.Linear(1024, 1024), nn.Linear(1024, 1024))  # 8 MiB of gradients
    far = advise(model, None, num_nodes=4, ranks_per_node=1, measured=_measured(model, Link(0.05, 125e6)))
    assert far.best.scheme.label() == "sharded_ps"
    rows = {p.scheme.label(): p for p in far.predictions}
    assert rows["sharded_ps"].cost.rounds < rows["ring_allreduce"].cost.rounds  # what decides at 50 ms
    assert far.reason.startswith("predicted step") and "sharded" not in far.reason  # against another strategy
    # a short link and a long backward: the ring's exchange hides behind backward, the servers' pull does not
    near = _measured(model, Link(1e-5, 125e6))
    near.backward_seconds = 1.0
    close = advise(model, None, num_nodes=4, ranks_per_node=1, measured=near)
    assert close.best.scheme.strategy in ("ring_allreduce", "ddp")
    # the ranking is by predicted step time, and every candidate appears once
    steps = [p.step_seconds for p in close.predictions]
    assert steps == sorted(steps)
    labels = [p.scheme.label() for p in close.predictions]
    assert len(labels) == len(set(labels)) == len(candidate_schemes(Topology(4, 1)))


@pytest.mark.unit
def test_json_is_stable_for_the_same_measurements():
    model = nn.Linear(64, 32)
    measured = _measured(model, Link(0.001, 1.25e8))
    first = advise(model, None, 2, 2, measured=measured).to_json()
    second = advise(model, None, 2, 2, measured=measured).to_json()
    assert first == second
    data = json.loads(first)
    assert sorted(data) == ["measured", "model", "notes", "predictions", "recommendation", "topology", "version"]
    assert sorted(data["predictions"][0]) == [
        "communication_seconds", "exposed_seconds", "message_rounds", "network_bytes", "notes",
        "optimizer_state_bytes_per_rank", "options", "rank", "scheme", "step_seconds", "strategy",
    ]  # fmt: skip


@pytest.mark.unit
def test_compute_is_measured_on_a_copy():
    from lightning_dp.advise import measure_compute
    from lightning_dp.demos import ReferenceCNN

    model = ReferenceCNN()
    before = [p.detach().clone() for p in model.parameters()]
    batch = (torch.randn(8, 1, 28, 28), torch.randint(0, 10, (8,)))
    forward, backward, step, state = measure_compute(model, batch, repeats=1)
    assert forward > 0 and backward > 0 and step > 0
    assert state == 2 * sum(p.numel() * 4 for p in model.parameters()) + 4 * len(before)  # Adam: two moments, step
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert all(p.grad is None for p in model.parameters())


def _advise(*args: str) -> tuple[dict, float]:
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "lightning_dp.advise", *args, "--json"], cwd=REPO,
                         env=subprocess_env(), capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout), time.perf_counter() - start


def _shape(value):
    if isinstance(value, dict):
        return {k: _shape(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_shape(value[0])] if value else []
    return type(value).__name__


@pytest.mark.multiprocess
def test_the_command_runs_offline_in_well_under_a_minute_with_stable_json():
    measured, seconds = _advise("model=reference_cnn", "trainer.devices=4", "trainer.num_nodes=2")
    assert seconds < 50
    assert measured["measured"]["link"]["source"].startswith("measured between two processes")
    assert measured["notes"]  # a link measured on one machine for two machines is said to be so
    given, _ = _advise("model=reference_cnn", "trainer.devices=4", "trainer.num_nodes=2", "latency_ms=10",
                       "bandwidth_mbit=1000")  # fmt: skip
    assert given["measured"]["link"]["latency"] == pytest.approx(0.01)
    assert _shape({**given, "notes": []}) == _shape({**measured, "notes": []})
    assert given["topology"] == {"num_nodes": 2, "ranks_per_node": 4, "world_size": 8}
    assert given["measured"]["bucket_bytes"] == measured["measured"]["bucket_bytes"]
    assert sorted(p["scheme"] for p in given["predictions"]) == sorted(p["scheme"] for p in measured["predictions"])
    assert given["recommendation"]["scheme"] in {p["scheme"] for p in given["predictions"]}


@pytest.mark.multiprocess
def test_bad_input_is_named():
    out = subprocess.run([sys.executable, "-m", "lightning_dp.advise", "latency_ms=10"], cwd=REPO,
                         env=subprocess_env(), capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.returncode != 0 and "give both latency_ms and bandwidth_mbit" in out.stderr


@pytest.mark.unit
def test_the_table_keeps_every_number_under_its_header_whatever_the_scheme_names():
    model = nn.Linear(64, 32)
    table = advise(model, None, 2, 2, measured=_measured(model, Link(0.001, 1.25e8))).table().splitlines()
    header = next(line for line in table if line.startswith(" #  scheme"))
    rows = [line for line in table if line[:2].strip().isdigit()]
    assert len(rows) == len(candidate_schemes(Topology(2, 2))) and max(len(r.split("  ")[1]) for r in rows) > 44
    for column in ("comm ms", "exposed ms", "step ms", "rounds", "state MiB"):
        end = header.index(column) + len(column)  # numbers are right-aligned under their column's last character
        for row in rows:
            assert row[end - 1] != " " and (end == len(row) or row[end] == " "), (column, row)


@pytest.mark.unit
def test_a_persistent_straggler_brings_balanced_batches_and_backup_workers():
    model = nn.Linear(256, 256)
    measured = _measured(model, Link(1e-4, 1.25e9))  # compute 32 ms a step, a fast link
    plain = advise(model, None, 1, 4, measured=measured)
    assert not any(p.scheme.balance != "none" or p.scheme.backup_workers for p in plain.predictions)
    slow = advise(model, None, 1, 4, measured=measured, slowest=2.0)
    rows = {p.scheme.label(): p for p in slow.predictions}
    compute = measured.compute_seconds
    ring, balanced = rows["ring_allreduce"], rows["ring_allreduce balance=throughput"]
    assert ring.step_seconds == pytest.approx(2 * compute + ring.exposed_seconds)  # equal shares wait for it
    assert balanced.step_seconds == pytest.approx(compute * 4 * 2 / (3 * 2 + 1) + balanced.exposed_seconds)
    backup = rows["sharded_ps backup_workers=1"]
    assert backup.step_seconds == pytest.approx((compute + backup.exposed_seconds) * 4 / 3)  # 3/4 of the samples
    assert "smaller batch" in "; ".join(backup.notes) and "2x slower" in " ".join(slow.notes)
    # balanced batches train exactly: they are recommended over every equal-share scheme, backup workers are not
    assert slow.best.scheme.balance == "throughput"
    options = {row["scheme"]: row["options"] for row in json.loads(slow.to_json())["predictions"]}
    assert options["ring_allreduce balance=throughput"]["balance"] == "throughput"
    assert (options["ring_allreduce"]["balance"], options["sharded_ps backup_workers=1"]["backup_workers"]) == (
        "none",
        1,
    )
    with pytest.raises(ValueError, match="slowest must be a number >= 1"):
        advise(model, None, 1, 4, measured=measured, slowest=0.5)
