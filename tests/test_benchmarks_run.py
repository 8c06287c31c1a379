"""The benchmarks still run as ``python -m benchmarks.<name>`` (smallest settings; the numbers themselves are not
asserted here)."""

import math
import shutil
import subprocess
import sys

import pytest

from benchmarks.dedicated_servers import PHASES
from benchmarks.gloo_flows import PATTERNS as GLOO_PATTERNS
from benchmarks.report import rows as result_rows
from tests.helpers.launch import launch_env, run_processes
from tests.helpers.netns import skip_without_netns


def run(args, timeout=240):
    """``python args`` in the checkout, as a launch of the tests (a single-node environment; started warm where it
    can be): its exit code, and its output (stdout and stderr together) as ``.stdout``."""
    codes, outputs, timed_out = run_processes([sys.executable, *args], [launch_env()], timeout)
    assert not timed_out, f"{args} did not finish in {timeout} s:\n{outputs[0][-5000:]}"
    return subprocess.CompletedProcess(args, codes[0], outputs[0])


@pytest.mark.multiprocess
def test_collectives_benchmark_runs(tmp_path):
    out = run(["-m", "benchmarks.collectives", "--world-sizes", "2", "--sizes-mb", "1", "--repeats", "1",
               "--shm-wait", "sleep", "--name", "collectives_sleeping", "--out", str(tmp_path)])  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:]
    rows = result_rows(tmp_path / "collectives_sleeping.json")
    ops = {"p2p", "shm_allreduce", "shm_in_place", "ring_allreduce", "gloo_all_reduce", "central_ps", "sharded_ps"}
    # MPI only where mpi4py is installed, or a row saying why it was skipped
    assert {r["op"] for r in rows} - {"mpi_allreduce", "mpi_skipped"} == ops | {"memory_copy"}
    text = (tmp_path / "collectives_sleeping.md").read_text()
    assert "| N | S (MB) |" in text and "--shm-wait sleep" in text


@pytest.mark.multiprocess
@pytest.mark.netns
@skip_without_netns
def test_emulated_cluster_benchmark_runs_and_cleans_up(tmp_path):
    out = run(["-m", "benchmarks.emulated_cluster", "--world-sizes", "2", "--size-mb", "2", "--repeats", "1",
               "--out", str(tmp_path)])  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:]
    row = result_rows(tmp_path / "emulated_cluster.json")[0]
    # a rate limit of 1 Gbit/s really binds: the central server cannot beat the analytic time
    assert row["measured_s"]["central_ps"] >= 0.9 * row["analytic_s"]["central_ps"]
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert "lddp-" not in namespaces


@pytest.mark.multiprocess
@pytest.mark.netns
@skip_without_netns
def test_emulated_hierarchical_benchmark_runs(tmp_path):
    out = run(["-m", "benchmarks.emulated_cluster", "--world-sizes", "2", "--ranks-per-host", "2", "--size-mb", "4",
               "--repeats", "2", "--out", str(tmp_path)])  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:]
    row = result_rows(tmp_path / "emulated_hierarchical.json")[0]
    assert (row["hosts"], row["ranks_per_host"], row["world_size"]) == (2, 2, 4)
    assert set(row["measured_s"]) == {"hierarchical", "ring_allreduce", "gloo_all_reduce"}
    # the links bind: no scheme beats its analytic time (hierarchical: one link load of S, flat: 1.5)
    for scheme, analytic in row["analytic_s"].items():
        assert row["measured_s"][scheme] >= 0.9 * analytic, scheme
    assert row["analytic_s"]["hierarchical"] < row["analytic_s"]["ring_allreduce"]


@pytest.mark.multiprocess
@pytest.mark.netns
@skip_without_netns
def test_dedicated_servers_benchmark_runs_and_the_links_bind(tmp_path):
    out = run(["-m", "benchmarks.dedicated_servers", "--trainers", "2", "--servers", "0", "1", "--size-mb", "2",
               "--repeats", "1", "--out", str(tmp_path)])  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:]
    rows = result_rows(tmp_path / "dedicated_servers.json")
    assert [(r["trainers"], r["servers"]) for r in rows] == [(2, 0), (2, 1)]
    for r in rows:  # no exchange beats the bandwidth bound of its split, nor do its network phases together
        assert r["measured_s"]["dedicated"] >= 0.9 * r["formula_s"]
        phases = r["phases_s"]
        assert set(phases) == set(PHASES) and min(phases.values()) > 0
        assert phases["push"] + phases["servers' weights"] + phases["pull"] >= 0.9 * r["formula_s"]
    assert "lddp-" not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


@pytest.mark.multiprocess
@pytest.mark.netns
@skip_without_netns
def test_gloo_flows_benchmark_runs_and_the_links_bind(tmp_path):
    out = run(["-m", "benchmarks.gloo_flows", "--hosts", "2", "--size-mb", "4", "--repeats", "1",
               "--out", str(tmp_path)])  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:]
    (row,) = result_rows(tmp_path / "gloo_flows.json")
    assert row["hosts"] == 2 and set(row["measured_s"]) == set(GLOO_PATTERNS)
    for seconds in row["measured_s"].values():  # 1 Gbit/s binds: nothing beats (n - 1) / n of 4 MB at that rate
        assert seconds >= 0.9 * row["bound_s"] == pytest.approx(0.9 * 2 * 2**20 / 125e6)
    assert "lddp-" not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


@pytest.mark.multiprocess
def test_scale_model_measures_a_message_and_prices_every_point(tmp_path):
    from benchmarks.scale_model import HOROVOD, RANKS, clusters, schemes

    out = run(["-m", "benchmarks.scale_model", "--messages", "200", "--out", str(tmp_path)])
    assert out.returncode == 0, out.stdout[-3000:]
    rows = result_rows(tmp_path / "scale_model.json")
    sweep = [r for r in rows if r["kind"] == "sweep"]
    assert len(sweep) == len(clusters(0.0)) * 2 * len(RANKS) * len(schemes(8))
    assert [r["model"] for r in rows if r["kind"] == "anchor"] == [m for m in HOROVOD for _ in ("RDMA", "TCP")]
    parameters = {r["cluster"]: r for r in rows if r["kind"] == "cluster"}
    assert set(parameters) >= set(clusters(0.0))
    mu = parameters["25 Gbit/s TCP, 3:1"]["message_seconds"]
    assert 0 < mu < 0.01 and all(r["message_seconds_measured"] for r in sweep)  # microseconds, not nothing
    priced = [r for r in rows if r["kind"] != "cluster"]
    assert all(0 < r["efficiency"] <= 1 and r["exposed_s"] <= r["comm_s"] + 1e-12 for r in priced)
    text = (tmp_path / "scale_model.md").read_text()
    tables = len(clusters(0.0)) * 2
    # the legend, each table's title, and each row's fastest scheme
    assert text.count("**") == 2 * (1 + tables + tables * len(RANKS))
    assert "| Inception V3 | 90% |" in text


@pytest.mark.unit
def test_strategy_specs_of_the_benchmarks():
    from benchmarks.end_to_end import build_strategy

    strategy, callbacks = build_strategy("sharded_ps@ring+powersgd")
    assert (strategy.intra_node, strategy.compression, callbacks) == ("ring", "powersgd", [])
    name, callbacks = build_strategy("ddp+bf16_hook")
    assert name == "ddp" and len(callbacks) == 1
    assert build_strategy("ring_allreduce") == ("ring_allreduce", [])
    servers, _ = build_strategy("sharded_ps#3", external_servers=True)
    assert (servers.num_servers, servers.start_servers) == (3, False)
    with pytest.raises(ValueError, match="ddp\\+zip_hook"):
        build_strategy("ddp+zip_hook")
    blocking, _ = build_strategy("sharded_ps@ring:blocking")
    assert (blocking.intra_node, blocking.overlap_pull) == ("ring", False)
    with pytest.raises(ValueError, match="':blocking'"):
        build_strategy("sharded_ps:lazy")
    surviving, _ = build_strategy("ring_allreduce~continue@ring")
    assert (surviving.intra_node, surviving.rank_loss.name) == ("ring", "continue")


@pytest.mark.multiprocess
def test_straggler_benchmark_runs_one_setting(tmp_path):
    from benchmarks.straggler import GLOBAL_BATCH, PERSISTENT_SETTINGS, SETTINGS, expected_step, throughput_report
    from benchmarks.straggler import run as run_one
    from lightning_dp.demos import DigitsDataModule

    row = run_one("mlp", 2, SETTINGS[-1], "transient", 0.01, 1, tmp_path)
    assert row["setting"] == "async" and row["staleness"] == "none"
    assert row["steps_per_rank"] == 10  # asynchronous: no rank is more steps ahead than its own run is long
    assert 0 <= row["staleness_max"] <= row["steps_per_rank"] - 1 and 0 <= row["staleness_mean"] <= row["staleness_max"]
    data = DigitsDataModule(batch_size=GLOBAL_BATCH // 2)
    data.setup("fit")
    epoch = 2 * math.ceil(len(data.train_set) / 2)  # every sample once, padded to a multiple of N
    assert row["samples"] == epoch and row["samples_per_s"] > 0
    row.update(t=0.01, expected_step_s=expected_step("async", "transient", 0.01, 0.04, 2))
    assert row["expected_step_s"] == pytest.approx(0.01 + 0.2 * 0.04)
    assert expected_step("sync", "transient", 0.01, 0.04, 2) == pytest.approx(0.01 + (1 - 0.8**2) * 0.04)
    assert expected_step("ring_allreduce balanced", "persistent", 0.01, 0.01, 2) == pytest.approx(0.02 * 2 / 3)
    # a slow rank 0 under balanced batches: it ends with the smaller share of each global batch
    setting = {s[0]: s for s in PERSISTENT_SETTINGS}
    balanced = run_one("mlp", 2, setting["ring_allreduce balanced"], "persistent", 0.02, 1, tmp_path)
    assert balanced["strategy"] == "ring_allreduce" and balanced["balance"] == "throughput"
    assert sum(balanced["shares"]) == GLOBAL_BATCH and balanced["shares"][0] < GLOBAL_BATCH // 2
    assert balanced["samples"] == epoch
    # backup workers: each step uses one of the two ranks' gradients, the other's is late or skipped and not counted
    backup = run_one("mlp", 2, setting["parameter_server backup b=1"], "persistent", 0.02, 1, tmp_path)
    assert backup["late_gradients"] + backup["skipped_steps"] == backup["steps_per_rank"] == 10
    assert epoch // 2 - GLOBAL_BATCH // 2 < backup["samples"] <= epoch // 2
    report = "\n".join(throughput_report([row, balanced, backup]))
    assert "| mlp | 2 | transient | async |" in report
    assert f"| {balanced['shares'][0]} / {balanced['shares'][1]} |" in report


@pytest.mark.multiprocess
@pytest.mark.netns
@skip_without_netns
@pytest.mark.skipif(shutil.which("gcc") is None, reason="the delay switch of the emulated hosts is compiled with gcc")
def test_advisor_validation_runs_on_delayed_links_and_cleans_up(tmp_path):
    out = run(["-m", "benchmarks.advisor_validation", "--hosts", "2", "--rates-mbit", "1000", "--latencies-ms", "10",
               "--sizes-mb", "1", "--repeats", "1", "--out", str(tmp_path)])  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:]
    rows = result_rows(tmp_path / "advisor_validation.json")
    one_per_host = [r for r in rows if r["ranks_per_host"] == 1]
    assert sorted(r["scheme"] for r in one_per_host) == sorted(
        ["ring_allreduce", "parameter_server", "sharded_ps", "ring_allreduce+fp16"]
    )
    # 10 ms is in the hierarchical sub-grid: two ranks per host, the flat and the hierarchical ring at 4 MB
    two_per_host = [(r["scheme"], r["size_mb"]) for r in rows if r["ranks_per_host"] == 2]
    assert sorted(two_per_host) == [("ring_allreduce", 4.0), ("ring_allreduce+shm", 4.0)]
    # the switch delays every packet: the ping-pong measures the 10 ms (plus the software's own fraction of a ms)
    assert all(0.010 <= r["latency_s"] < 0.015 for r in rows)
    # a ring of two ranks: two message rounds at least, so never under 20 ms
    assert next(r for r in one_per_host if r["scheme"] == "ring_allreduce")["measured_s"] >= 0.02
    report = (tmp_path / "advisor_validation.md").read_text()
    assert "| N | rate | latency |" in report and "| ring_allreduce+shm | 2 | 2 |" in report
    assert not [line for line in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
                .splitlines() if line.startswith("lddp-")]  # fmt: skip


@pytest.mark.multiprocess
def test_gpu_check_runs_in_stages_keeps_what_a_cut_off_run_found_and_refuses_without_cuda(tmp_path):
    """The CPU stand-in of the GPU check: a stage past its time limit is stopped and stored as such, ``--resume``
    runs it again and keeps what finished, and each stage's result is written when it ends."""
    import torch

    check = ["-m", "benchmarks.gpu_check", "--accelerator", "cpu", "--out", str(tmp_path)]
    stored = tmp_path / "gpu_check_on_cpu.json"

    def stages():
        return result_rows(stored)[0]["stages"]

    # the smoke stage gets 1.2 s, less than a rank takes to import torch: its launches are stopped
    cut = run([*check, "--quick", "--slack", "0.02", "--budget", "60"])
    assert cut.returncode == 1 and stored.exists(), cut.stdout[-5000:]
    assert list(stages()) == ["smoke"], cut.stdout[-3000:]
    assert stages()["smoke"]["status"] == "stopped" and stages()["smoke"]["limit_s"] == pytest.approx(1.2)
    assert {run["outcome"] for run in stages()["smoke"]["runs"].values()} == {"STOPPED"}
    smoke = run([*check, "--quick", "--resume"])
    assert smoke.returncode == 0, smoke.stdout[-5000:]
    runs = stages()["smoke"]["runs"]
    assert sorted(runs) == ["parameter_server", "ring_allreduce", "sharded_ps", "sharded_ps+servers"]
    assert all(r["outcome"] == "PASSED" for r in runs.values()), runs
    strategies = ["--strategies", "ddp", "ring_allreduce", "--steps", "2", "--warmup", "2"]
    out = run([*check, "--resume", "--stages", "smoke", "end_to_end", *strategies])
    assert out.returncode == 0, out.stdout[-5000:]
    assert "gpu_check: smoke kept from the stored results (passed)" in out.stdout
    assert list(stages()) == ["smoke", "end_to_end"] and stages()["smoke"]["runs"] == runs
    rows = stages()["end_to_end"]["rows"]
    assert [(r["world_size"], r["strategy"]) for r in rows] == [
        (n, s) for n in (1, 2) for s in ("ddp", "ring_allreduce")
    ]
    assert [r["vs_ddp"] for r in rows if r["strategy"] == "ddp"] == [1.0, 1.0]
    assert all(r["steps_per_s"] > 0 and r["vs_ddp"] > 0 for r in rows)
    summaries = [line for line in out.stdout.splitlines() if line.startswith("gpu_check: smoke passed;")]
    assert len(summaries) == 1, out.stdout[-3000:]
    assert summaries[0].startswith("gpu_check: smoke passed; end_to_end passed; two ranks sharing the device, steps/s")
    report = (tmp_path / "gpu_check_on_cpu.md").read_text()
    assert "| smoke | passed |" in report and "| collectives | not run |" in report
    if not torch.cuda.is_available():
        refused = run(["-m", "benchmarks.gpu_check", "--out", str(tmp_path)], timeout=60)
        assert refused.returncode == 2 and "no CUDA device here" in refused.stdout


@pytest.mark.multiprocess
def test_faults_benchmark_runs_the_survivors_path(tmp_path):
    out = run(["-m", "benchmarks.faults", "--strategies", "sharded_ps", "--paths", "launcher", "--fault-step", "6",
               "--checkpoint-every", "4", "--app", "trainer.max_epochs=2", "test=false", "--out", str(tmp_path)],
              timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:]
    clean, fault = result_rows(tmp_path / "faults.json")
    assert (clean["fault"], fault["fault"], fault["lost_rank"]) == (False, True, 2)
    assert clean["strategy"] == fault["strategy"] == "sharded_ps"
    assert clean["global_step"] == fault["global_step"] == 20
    # the fault's time is the lost rank's own record, the recovery the survivors' next step after it
    assert 0 < fault["recovery_seconds"] < 5 and fault["steps_redone"] in (0, 1)
    assert "| `sharded_ps` | survivors go on (strategy's launcher) | 2 |" in (tmp_path / "faults.md").read_text()
