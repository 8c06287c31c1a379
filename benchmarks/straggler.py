"""Stragglers: throughput and accuracy of synchronous, bounded-staleness (SSP) and asynchronous parameter servers,
and of throughput-balanced batches.

    python -m benchmarks.straggler              # throughput: N = 3 and 4, reference CNN and an MLP
    python -m benchmarks.straggler --devices 4  # throughput: N = 4 only (~10 minutes)
    python -m benchmarks.straggler --quick      # throughput: N = 4, the MLP
    python -m benchmarks.straggler --accuracy   # digits, N = 4, 10 epochs per setting

Every run is one ``Trainer.fit`` with N processes on this machine, on the bundled digits (global batch 128), each rank
sleeping where a straggler would be slow:

- (a) transient: before each step each rank sleeps ``d`` with probability ``p`` (independently; 0.2 and 4 t here,
  where t is the step time of the same synchronous run without delays, measured first in the same cell);
- (b) persistent: rank 0 computes at half speed: before each backward it sleeps t times its share of the samples
  relative to an equal share (t with equal batches), the others never.

The staleness settings run ``sharded_ps``; under (b) ``balance="throughput"`` runs on each of the three strategies
and ``backup_workers=1`` on both parameter servers, each compared with the same strategy's synchronous run in the
same cell. Samples per second count the samples whose gradients a step used (a backup worker's late or skipped
batches do not count); steps per second count every rank's steps, as Chen et al. report backup workers.

Throughput is samples per second over all ranks, from the first rank's start to the last rank's end of training
(a parameter server's end of training is a flush, so that is when every update is in); ``expected`` under (a) is
the analytic step time: a synchronous step waits for the slowest of N ranks, ``t + (1 - (1 - p)^N) d``, a rank that
never waits pays its own average, ``t + p d``. Writes results/straggler.{json,md}.

``--accuracy`` runs the digits training of ``examples/train.py`` (reference CNN, Adam, 10 epochs) under (a) at
N = 4 for every setting, and after every epoch evaluates the test set on rank 0 (after the flush that precedes
validation: every update of every rank is in): results/straggler_accuracy.{json,md,png}, test accuracy against
wall-clock time, one line per setting.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.report import pyplot, save

REPO = Path(__file__).resolve().parents[1]
#: (label, strategy, staleness option, balance option, backup workers, the label of its baseline) of every setting
#: under both patterns
SETTINGS = [
    ("sync", "sharded_ps", "0", "none", 0, "sync"),
    ("SSP k=1", "sharded_ps", "1", "none", 0, "sync"),
    ("SSP k=2", "sharded_ps", "2", "none", 0, "sync"),
    ("SSP k=4", "sharded_ps", "4", "none", 0, "sync"),
    ("async", "sharded_ps", "none", "none", 0, "sync"),
]
#: the settings run under (b) only
PERSISTENT_SETTINGS = [
    ("backup b=1", "sharded_ps", "0", "none", 1, "sync"),
    ("balanced", "sharded_ps", "0", "throughput", 0, "sync"),
    ("ring_allreduce sync", "ring_allreduce", "0", "none", 0, "ring_allreduce sync"),
    ("ring_allreduce balanced", "ring_allreduce", "0", "throughput", 0, "ring_allreduce sync"),
    ("parameter_server sync", "parameter_server", "0", "none", 0, "parameter_server sync"),
    ("parameter_server backup b=1", "parameter_server", "0", "none", 1, "parameter_server sync"),
    ("parameter_server balanced", "parameter_server", "0", "throughput", 0, "parameter_server sync"),
]
GLOBAL_BATCH = 128
P_DELAY = 0.2
DELAY_STEPS = 4.0  # d in units of t


def build_model(name: str):
    import torch
    import torch.nn.functional as F
    from lightning import LightningModule

    from lightning_dp.demos.cnn import ReferenceCNN

    if name == "reference_cnn":
        return ReferenceCNN()

    class DigitsMLP(LightningModule):
        """A communication-light model (26 k parameters): 784 -> 32 -> 10."""

        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(784, 32), torch.nn.ReLU(),
                                           torch.nn.Linear(32, 10))  # fmt: skip

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-3)

    return DigitsMLP()


def worker(args) -> None:
    """One rank of one run (Lightning starts the others with the same command)."""
    import lightning as L
    import torch
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.strategies import StrategyRegistry

    from lightning_dp.comm.cluster.rendezvous import register_close_at_exit
    from lightning_dp.demos import DigitsDataModule

    register_close_at_exit()  # Lightning's ddp leaves its gloo group up: pytorch/pytorch#190489
    torch.set_num_threads(1)
    L.seed_everything(0, workers=True)
    staleness = None if args.staleness == "none" else int(args.staleness)
    equal_share = GLOBAL_BATCH // args.devices

    class Straggle(Callback):
        def __init__(self) -> None:
            self.record: dict = {"steps": 0, "samples": 0, "delayed_s": 0.0}

        def on_train_start(self, trainer, pl_module):
            self.record["start"] = time.time()
            self.rng = random.Random(1000 * trainer.global_rank + 7)
            self.batch_size = equal_share
            self.left_out = 0

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.batch_size = len(batch[1])
            if args.pattern == "transient" and self.rng.random() < args.p:
                time.sleep(args.delay)
                self.record["delayed_s"] += args.delay

        def on_before_backward(self, trainer, pl_module, loss):
            if args.pattern == "persistent" and trainer.global_rank == 0:  # half speed, in the step's computation
                sleep = args.delay * self.batch_size / equal_share
                time.sleep(sleep)
                self.record["delayed_s"] += sleep

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.record["steps"] += 1
            left_out = getattr(trainer.strategy, "late_gradients", 0) + getattr(trainer.strategy, "skipped_steps", 0)
            if left_out == self.left_out:  # a step used this batch's gradient
                self.record["samples"] += self.batch_size
            self.left_out = left_out

        def on_train_end(self, trainer, pl_module):
            self.record["end"] = time.time()

    class TestEveryEpoch(Callback):
        """Rank 0: test accuracy after every epoch's validation (every rank holds the same, flushed weights)."""

        def __init__(self, datamodule) -> None:
            self.datamodule = datamodule
            self.curve: list[dict] = []

        def on_validation_end(self, trainer, pl_module):
            if trainer.sanity_checking or trainer.global_rank != 0:
                return
            x, y = self.datamodule.test_set.tensors
            was_training = pl_module.training
            pl_module.eval()
            with torch.no_grad():
                accuracy = (pl_module(x).argmax(1) == y).float().mean().item()
            pl_module.train(was_training)
            self.curve.append({"epoch": trainer.current_epoch + 1, "time": time.time(), "test_acc": accuracy})

    data = DigitsDataModule(batch_size=equal_share)
    data.setup("fit")
    straggle, tester = Straggle(), TestEveryEpoch(data)
    entry = StrategyRegistry[args.strategy]
    options = {"balance": args.balance}
    if args.strategy != "ring_allreduce":
        options.update(staleness=staleness, backup_workers=args.backup_workers)
    trainer = L.Trainer(
        strategy=entry["strategy"](**{**entry["init_params"], **options}),
        accelerator="cpu",
        devices=args.devices,
        max_epochs=args.epochs,
        limit_val_batches=None if args.accuracy else 0,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[straggle, tester],
    )
    model = build_model(args.model)
    trainer.fit(model, datamodule=data)
    seen = getattr(trainer.strategy, "staleness_seen", None)
    balancer = getattr(trainer.strategy.batches, "balancer", None)
    result = {**straggle.record, "rank": trainer.global_rank, "batch": equal_share,
              "staleness_max": seen.max if seen else 0, "staleness_mean": seen.mean() if seen else 0.0,
              "shares": list(balancer.shares) if balancer is not None else None, "curve": tester.curve,
              "late": getattr(trainer.strategy, "late_gradients", 0),
              "skipped": getattr(trainer.strategy, "skipped_steps", 0)}  # fmt: skip
    Path(args.result_dir).mkdir(parents=True, exist_ok=True)
    (Path(args.result_dir) / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))


def run(model: str, devices: int, setting: tuple, pattern: str, delay: float, epochs: int, tmp: Path,
        accuracy: bool = False) -> dict:  # fmt: skip
    """One run of ``setting`` (an entry of :data:`SETTINGS`); the ranks' records combined: samples/s over all
    ranks, first start to last end."""
    label, strategy, staleness, balance, backups, baseline = setting
    result_dir = tmp / f"{model}-{devices}-{strategy}-{staleness}-{balance}-{pattern}-{time.monotonic_ns()}"
    cmd = [sys.executable, "-m", "benchmarks.straggler", "--worker", "--model", model, "--devices", str(devices),
           "--strategy", strategy, "--staleness", staleness, "--balance", balance, "--backup-workers", str(backups),
           "--pattern", pattern,
           "--delay", str(delay), "--p", str(P_DELAY), "--epochs", str(epochs), "--result-dir", str(result_dir),
           *(["--accuracy"] if accuracy else [])]  # fmt: skip
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    subprocess.run(cmd, check=True, env=env, cwd=tmp, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   timeout=1800)  # fmt: skip
    ranks = [json.loads((result_dir / f"rank{r}.json").read_text()) for r in range(devices)]
    start, end = min(r["start"] for r in ranks), max(r["end"] for r in ranks)
    samples = sum(r["samples"] for r in ranks)
    return {
        "model": model, "devices": devices, "setting": label, "baseline": baseline, "strategy": strategy,
        "staleness": staleness, "balance": balance, "backup_workers": backups, "shares": ranks[0]["shares"],
        "late_gradients": sum(r["late"] for r in ranks), "skipped_steps": sum(r["skipped"] for r in ranks),
        "pattern": pattern, "delay_s": delay,
        "epochs": epochs, "seconds": end - start, "samples": samples, "samples_per_s": samples / (end - start),
        "seconds_per_epoch": (end - start) / epochs, "steps_per_rank": ranks[0]["steps"],
        "staleness_max": max(r["staleness_max"] for r in ranks),
        "staleness_mean": sum(r["staleness_mean"] for r in ranks) / devices,
        "curve": [{**c, "time": c["time"] - start} for c in ranks[0]["curve"]],
    }  # fmt: skip


def throughput(models: list[str], sizes: list[int], epochs: int) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for model in models:
            for devices in sizes:
                base = run(model, devices, SETTINGS[0], "none", 0.0, epochs, Path(tmp))
                t = base["seconds"] / base["steps_per_rank"]  # one synchronous step without delays
                base.update(setting="sync, no delays", baseline=None, t=t)
                rows.append(base)
                print(json.dumps(base), flush=True)
                for pattern, delay in (("transient", DELAY_STEPS * t), ("persistent", t)):
                    for setting in SETTINGS + (PERSISTENT_SETTINGS if pattern == "persistent" else []):
                        label = setting[0]
                        row = run(model, devices, setting, pattern, delay, epochs, Path(tmp))
                        row.update(t=t, expected_step_s=expected_step(label, pattern, t, delay, devices))
                        rows.append(row)
                        print(json.dumps(row), flush=True)
    return rows


def expected_step(label: str, pattern: str, t: float, d: float, n: int) -> float | None:
    """Analytic seconds per step under (a); under (b) every equal-share setting is bound by the slow rank's share,
    2 t, balanced shares by the N ranks' speeds together, 2 t N / (2 N - 1), and backup workers by the fast ranks, t
    (with samples of N - 1 ranks per step)."""
    if pattern == "persistent":
        if "backup" in label:
            return t * n / (n - 1)  # seconds per N ranks' worth of samples
        return 2 * t * n / (2 * n - 1) if label.endswith("balanced") else 2 * t
    if label == "sync":
        return t + (1 - (1 - P_DELAY) ** n) * d
    if label == "async":
        return t + P_DELAY * d
    return None  # SSP: between the two, closer to async the larger k


def throughput_report(rows: list[dict]) -> list[str]:
    lines = [
        f"Machine: {os.cpu_count()} CPUs, every rank a process on it (1 thread each); `sharded_ps` unless the setting "
        f"names another strategy, digits, global batch {GLOBAL_BATCH}; (a) transient: p = {P_DELAY}, d = "
        f"{DELAY_STEPS:g} t; (b) persistent: rank 0 at half speed (sleeps t per equal share of samples in each step). "
        "t: seconds per step of the synchronous run without delays (first row of each block). Each row is compared "
        "with its strategy's synchronous row of the same block.",
        "",
        "| model | N | pattern | setting | samples/s | vs sync | expected vs sync | steps/s vs sync | s/epoch | "
        "max / mean staleness | shares at the end | late / skipped |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    baselines = {(r["model"], r["devices"], r["pattern"], r["setting"]): r for r in rows}
    for r in rows:
        base = baselines.get((r["model"], r["devices"], r["pattern"], r.get("baseline")))
        vs = f"{r['samples_per_s'] / base['samples_per_s']:.2f}x" if base else ""
        steps = (
            f"{(r['steps_per_rank'] / r['seconds']) / (base['steps_per_rank'] / base['seconds']):.2f}x" if base else ""
        )
        expected = ""
        if base and r.get("expected_step_s") and base.get("expected_step_s"):
            expected = f"{base['expected_step_s'] / r['expected_step_s']:.2f}x"
        pattern = "none" if r["setting"] == "sync, no delays" else r["pattern"]
        shares = " / ".join(map(str, r["shares"])) if r.get("shares") and r.get("balance") != "none" else ""
        left_out = f"{r['late_gradients']} / {r['skipped_steps']}" if r.get("backup_workers") else ""
        lines.append(
            f"| {r['model']} | {r['devices']} | {pattern} | {r['setting']} | {r['samples_per_s']:.0f} | {vs} | "
            f"{expected} | {steps} | {r['seconds_per_epoch']:.2f} | {r['staleness_max']} / {r['staleness_mean']:.2f} | "
            f"{shares} | {left_out} |"
        )
    return lines


def accuracy(devices: int, epochs: int) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        base = run("reference_cnn", devices, SETTINGS[0], "none", 0.0, 1, Path(tmp))
        t = base["seconds"] / base["steps_per_rank"]
        for setting in SETTINGS:
            row = run("reference_cnn", devices, setting, "transient", DELAY_STEPS * t, epochs, Path(tmp), True)
            row.update(t=t)
            rows.append(row)
            print(json.dumps(row), flush=True)
        for setting in [SETTINGS[0], PERSISTENT_SETTINGS[0], PERSISTENT_SETTINGS[1]]:
            row = run("reference_cnn", devices, setting, "persistent", t, epochs, Path(tmp), True)
            row.update(t=t)
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def accuracy_report(rows: list[dict]) -> list[str]:
    r0 = rows[0]
    lines = [
        f"Machine: {os.cpu_count()} CPUs; `sharded_ps`, N = {r0['devices']} processes, reference CNN (Adam, lr 1e-3) "
        f"on digits, {r0['epochs']} epochs; transient stragglers (p = {P_DELAY}, d = {r0['delay_s']:.2f} s = "
        f"{DELAY_STEPS:g} t), and a persistent one (rank 0 at half speed); test accuracy on rank 0 after every epoch",
        "",
        "| pattern | setting | test accuracy after the last epoch | vs sync (points) | wall-clock (s) | vs sync | "
        "max / mean staleness |",
        "|---|---|---|---|---|---|---|",
    ]
    sync = {r["pattern"]: r for r in rows if r["setting"] == "sync"}
    for r in rows:
        base = sync[r["pattern"]]
        points = 100 * (r["curve"][-1]["test_acc"] - base["curve"][-1]["test_acc"])
        lines.append(
            f"| {r['pattern']} | {r['setting']} | {100 * r['curve'][-1]['test_acc']:.1f} % | {points:+.1f} | "
            f"{r['seconds']:.1f} | {base['seconds'] / r['seconds']:.2f}x faster | {r['staleness_max']} / "
            f"{r['staleness_mean']:.2f} |"
        )
    return lines


def plot_accuracy(rows: list[dict], out: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    patterns = sorted({r["pattern"] for r in rows}, reverse=True)
    fig, axes = plt.subplots(1, len(patterns), figsize=(6.5 * len(patterns), 4), squeeze=False)
    for ax, pattern in zip(axes[0], patterns):
        for r in (r for r in rows if r["pattern"] == pattern):
            ax.plot([c["time"] for c in r["curve"]], [100 * c["test_acc"] for c in r["curve"]], marker="o",
                    label=f"{r['setting']} ({100 * r['curve'][-1]['test_acc']:.1f} %)")  # fmt: skip
        ax.set(xlabel="wall-clock time since the start of training (s)", ylabel="test accuracy (%)", ylim=(80, 100),
               title=f"digits, N = {rows[0]['devices']}, {pattern} stragglers")  # fmt: skip
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "straggler_accuracy.png", dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--accuracy", action="store_true")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", default="reference_cnn", choices=["reference_cnn", "mlp"])
    parser.add_argument("--devices", type=int)
    parser.add_argument("--strategy", default="sharded_ps", help=argparse.SUPPRESS)
    parser.add_argument("--staleness", default="0", help=argparse.SUPPRESS)
    parser.add_argument("--balance", default="none", help=argparse.SUPPRESS)
    parser.add_argument("--backup-workers", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--pattern", default="none", help=argparse.SUPPRESS)
    parser.add_argument("--delay", type=float, default=0.0, help=argparse.SUPPRESS)
    parser.add_argument("--p", type=float, default=P_DELAY, help=argparse.SUPPRESS)
    parser.add_argument("--epochs", type=int)
    parser.add_argument("--result-dir", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    out = Path(args.out)
    if args.accuracy:
        rows = accuracy(args.devices or 4, args.epochs or 10)
        save(out, "straggler_accuracy", rows, accuracy_report)
        plot_accuracy(rows, out)
        return
    models = ["mlp"] if args.quick else ["reference_cnn", "mlp"]
    sizes = [args.devices] if args.devices else [4] if args.quick else [3, 4]
    rows = throughput(models, sizes, args.epochs or (3 if args.quick else 5))
    save(out, "straggler", rows, throughput_report)


if __name__ == "__main__":
    main()
