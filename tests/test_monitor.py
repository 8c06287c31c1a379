"""``CommMonitor``: its values are the strategies' own counters, they reach the CSV logger, and the summary puts
the cost model's prediction beside them."""

import csv
import json
from pathlib import Path

import pytest

from lightning_dp.comm.cost import Link, core_sharing
from lightning_dp.comm.transports.shm import usable_cores
from tests.helpers.launch import run_script

pytestmark = pytest.mark.multiprocess

CASES = [
    ("ring_allreduce", ["--intra-node", "shm"]),
    ("parameter_server", ["--intra-node", "ring"]),
    ("sharded_ps", ["--intra-node", "ring"]),
    ("sharded_ps", ["--staleness", "1"]),
    ("ddp", []),
]


def _csv_rows(log_dir: str) -> list[dict]:
    with open(Path(log_dir) / "metrics.csv") as f:
        return [row for row in csv.DictReader(f) if row.get("comm/bytes_sent")]


@pytest.mark.parametrize("strategy, options", CASES, ids=[" ".join([c[0], *c[1]]) for c in CASES])
def test_monitor_logs_the_strategys_counters_and_the_prediction(tmp_path, strategy, options):
    steps = 4
    args = ["--strategy", strategy, "--steps", str(steps), "--out", str(tmp_path)]
    run_script("monitor", *args, *options, timeout=240)
    result = json.loads((tmp_path / "result.json").read_text())
    rows = _csv_rows(result["log_dir"])
    assert [int(r["step"]) for r in rows] == list(range(steps))
    summary = result["summary"]
    assert summary["steps"] == steps
    logged = [(float(r["comm/bytes_sent"]), float(r["comm/bytes_received"])) for r in rows]
    if strategy == "ddp":  # bytes from the model's size: the ring's 2 (N - 1) / N of the gradients
        assert all(sent == received > 0 for sent, received in logged)
        assert summary["measured"]["seconds"] is None and summary["predicted"]["seconds"] > 0
        return
    # the monitor reads the counters, not the model; and adds nothing that reads gradients (the servers would send
    # the averaged gradients back)
    assert logged == [tuple(map(float, c)) for c in result["counters"]]
    assert result["full_gradients"] is False or strategy == "ring_allreduce"
    # the time a step waited for communication lies inside that step's batch, and inside the exchange it waited for
    for r, batch_seconds in zip(rows, result["batch_seconds"], strict=True):
        seconds, exposed = float(r["comm/seconds"]), float(r["comm/exposed_seconds"])
        assert 0 <= exposed <= batch_seconds and exposed <= seconds, (r, batch_seconds)
        assert seconds > 0 and float(r["comm/peer_wait_seconds"]) >= 0
    predicted = summary["predicted"]
    measured = summary["measured"]
    link = summary["link"]
    assert predicted["seconds"] > 0 and link["bandwidth"] > 0
    # inside the machine: the shared-memory exchange's own barrier and rate where there is one (else the model's
    # barrier and a memory copy), and two ranks' backward and exchange threads (one each here) on its cores
    shared = "--intra-node" in options and options[options.index("--intra-node") + 1] == "shm"
    assert summary["in_node_measured"] == shared and (link["local_latency"] != Link.local_latency) == shared, link
    assert link["overlap_slowdown"] == (core_sharing(2, 1, usable_cores()) if shared else 1.0), link
    if "--staleness" in options:  # each worker pushes alone: no per-rank prediction of the bytes
        assert predicted["bytes_sent"] is None and measured["bytes_sent"] > 0
        return
    # the model's per-rank bytes: exact up to whole elements per chunk
    assert predicted["bytes_sent"] == pytest.approx(measured["bytes_sent"], abs=64)
    assert predicted["bytes_received"] == pytest.approx(measured["bytes_received"], abs=64)


def test_several_optimizer_steps_per_batch_are_all_counted(tmp_path):
    batches = 3
    run_script("monitor", "--strategy", "ring_allreduce", "--steps", str(2 * batches), "--two-steps-per-batch",
               "--out", str(tmp_path), timeout=240)  # fmt: skip
    result = json.loads((tmp_path / "result.json").read_text())
    summary = result["summary"]
    assert summary["steps"] == 2 * batches  # max_steps counts optimizer steps
    rows = _csv_rows(result["log_dir"])
    assert len(rows) == batches  # one row per batch: the mean of its two steps
    # every byte of every step, the second steps' none included
    assert summary["measured"]["bytes_sent"] * summary["steps"] == pytest.approx(result["steps_bytes"][0])
    assert sum(float(r["comm/bytes_sent"]) for r in rows) * 2 == pytest.approx(result["steps_bytes"][0])
