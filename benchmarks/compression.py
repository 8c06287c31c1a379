"""Compression on slow links: steps/s, bytes per step and accuracy for every codec, against torch's DDP hooks.

Throughput (needs root: one Lightning node per emulated host, links shaped with tc; N = 3 hosts):

    sudo python -m benchmarks.compression                   # reference CNN and ResNet-18, 1000 and 100 Mbit/s
    sudo python -m benchmarks.compression --quick           # reference CNN, 100 Mbit/s, fewer steps

Every row is one ``Trainer.fit`` on fake data (``benchmarks.end_to_end``'s worker); ``vs none`` is steps/s over the
same strategy uncompressed, ``vs torch`` over Lightning's ``ddp`` with torch's hook for the same codec
(``bf16_compress_hook``, ``powerSGD_hook`` at rank 4, both compressing from the 3rd step), in the same run;
torch's PowerSGD runs with one bucket (with several, its callbacks issue collectives in different orders on gloo).
Bytes: what every rank sent in the last step, summed, over the uncompressed run's, beside the analytic ratio of
the codec from the model's shapes alone (:func:`analytic_ratio`: 1/2 for 16 bits; for PowerSGD the factors
``(n + m) r`` per ``n x m`` matrix plus what stays uncompressed). Writes results/compression.{json,md}.

Accuracy (no root; the ranks of one machine over sockets, ``strategy.intra_node=ring``, since shared memory leaves
nothing to compress):

    python -m benchmarks.compression --accuracy             # the default digits run, every strategy x codec

runs ``examples/train.py`` unchanged but for the overrides and writes results/compression_accuracy.{json,md,png}:
test accuracy after the run and validation accuracy after every epoch, one line per codec.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.end_to_end import MODELS, build_model, median, run_emulated
from benchmarks.report import pyplot, save

REPO = Path(__file__).resolve().parents[1]
HOSTS = 3
#: runs of one row before giving up (a row that needed more than one says so in the table); see
#: ``benchmarks.end_to_end.build_strategy`` for torch's powerSGD_hook on gloo, which gets one bucket here
ATTEMPTS = 3
#: (spec, codec, uncompressed baseline spec, torch's hook for the same codec)
THROUGHPUT = [
    ("ddp", "none", None, None),
    ("ddp+bf16_hook", "bf16", "ddp", None),
    ("ddp+powersgd_hook", "powersgd", "ddp", None),
    ("ring_allreduce", "none", None, "ddp"),
    ("ring_allreduce+bf16", "bf16", "ring_allreduce", "ddp+bf16_hook"),
    ("ring_allreduce+powersgd", "powersgd", "ring_allreduce", "ddp+powersgd_hook"),
    ("sharded_ps", "none", None, "ddp"),
    ("sharded_ps+bf16", "bf16", "sharded_ps", "ddp+bf16_hook"),
    ("sharded_ps+powersgd", "powersgd", "sharded_ps", "ddp+powersgd_hook"),
]
STRATEGIES = ("ring_allreduce", "parameter_server", "sharded_ps")
CODECS = ("none", "bf16", "fp16", "powersgd")


def powersgd_elements(shapes: list[tuple[int, ...]], rank: int, strict: bool = False) -> int:
    """Elements PowerSGD's two all-reduces carry for gradients of ``shapes`` (the paper's count, written from the
    shapes alone): an ``n x m`` matrix (``n = shape[0]``, ``m`` the rest) travels as ``(n + m) r`` elements,
    ``r = min(rank, n, m)``, when that is at most half of ``n m`` (under half for torch's hook, ``strict``);
    everything else travels whole."""
    total = 0
    for shape in shapes:
        numel = math.prod(shape)
        n = shape[0] if len(shape) >= 2 else 0
        m = numel // n if n else 0
        r = min(rank, n, m)
        factors = (n + m) * r
        small_enough = 2 * factors < numel if strict else 2 * factors <= numel
        total += factors if n and small_enough else numel
    return total


def analytic_ratio(model: str, strategy: str, codec: str) -> float:
    """Bytes all ranks send in a step with ``codec`` over without it, for ``model``'s trainable parameters in
    float32 under ``strategy``, counting what each exchange moves (every sum below is times N - 1 over the ranks):
    G gradient elements and F used-flags (one per parameter), S = G + F, W PowerSGD's factors plus what it leaves
    uncompressed plus the flags (:func:`powersgd_elements`).

    - ring: 2 S; 16-bit S; PowerSGD 2 W (two all-reduces).
    - central server: S up and S down; 16-bit half of both; PowerSGD 2 W (its all-reduces are a push and a pull)
      and S of weights down.
    - sharded servers: G up, 2 F (the flags' ring), G down; 16-bit G / 2 each way; PowerSGD 2 W and G of weights.
    """
    from benchmarks.end_to_end import POWERSGD_RANK

    name = strategy.partition("+")[0].partition("@")[0]
    shapes = [tuple(p.shape) for p in build_model(model).parameters() if p.requires_grad]
    grads = sum(math.prod(s) for s in shapes)
    if codec == "none":
        return 1.0
    if name == "ddp":  # torch's hooks: no flags; its PowerSGD compresses a matrix only where that saves over half
        return 0.5 if codec == "bf16" else powersgd_elements(shapes, POWERSGD_RANK, strict=True) / grads
    flags = len(shapes)
    total = grads + flags
    low_rank = codec == "powersgd"
    wire = powersgd_elements(shapes, POWERSGD_RANK) + flags if low_rank else total / 2
    if name == "sharded_ps":
        plain = 2 * grads + 2 * flags
        return (2 * wire + grads if low_rank else grads + 2 * flags) / plain
    if name == "parameter_server":
        return (2 * wire + total if low_rank else total) / (2 * total)
    return (2 * wire if low_rank else total) / (2 * total)


def throughput(models: list[str], rates: list[float], steps: int, warmup: int) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for model in models:
            for rate in rates:
                measured: dict[str, dict] = {}
                for spec, codec, baseline, torch_hook in THROUGHPUT:
                    ranks, attempts = None, 0
                    while ranks is None:
                        attempts += 1
                        try:
                            ranks = run_emulated(model, HOSTS, rate, spec, steps, warmup, Path(tmp))
                        except RuntimeError:
                            if attempts == ATTEMPTS:
                                raise
                    sent = [r["last_step_bytes"][0] for r in ranks] if ranks[0]["last_step_bytes"] else None
                    row = {
                        "model": model,
                        "rate_mbit": rate,
                        "strategy": spec,
                        "codec": codec,
                        "steps_per_s": median([r["steps_per_s"] for r in ranks]),
                        "bytes_sent": sum(sent) if sent else None,
                        "analytic_ratio": analytic_ratio(model, spec, codec),
                        "steps": steps,
                        "attempts": attempts,
                    }
                    if baseline is not None:
                        base = measured[baseline]
                        row["vs_none"] = row["steps_per_s"] / base["steps_per_s"]
                        if row["bytes_sent"] and base["bytes_sent"]:
                            row["bytes_ratio"] = row["bytes_sent"] / base["bytes_sent"]
                    if torch_hook is not None:
                        row["vs_torch"] = row["steps_per_s"] / measured[torch_hook]["steps_per_s"]
                    measured[spec] = row
                    print(json.dumps(row), flush=True)
                    rows.append(row)
    return rows


def throughput_report(rows: list[dict]) -> list[str]:
    """The throughput table of ``rows`` (``Machine: ...`` first)."""
    steps = rows[0]["steps"]
    lines = [
        f"Machine: {os.cpu_count()} CPUs; {HOSTS} hosts in network namespaces (one rank each), links shaped to the "
        f"rate both ways; {steps} timed steps per row, fake data",
        "",
        "| model | Mbit/s | strategy | steps/s | vs none | vs torch | bytes sent (MB, all ranks) | bytes / none "
        "| analytic |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    notes = [
        "",
        "`bytes / none`: all ranks' bytes of the last step over the same strategy's uncompressed run; `analytic`: "
        "the same ratio from the model's shapes and the strategy's exchanges (`analytic_ratio` in the script: the "
        "servers' weights travel uncompressed under PowerSGD, the sharded servers' flags always in float32; for "
        "`ddp` the hook's own ratio). `(k runs)`: the k-th run of the row succeeded.",
    ]

    def cell(r: dict, key: str, fmt: str = "{:.2f}") -> str:
        return fmt.format(r[key]) if r.get(key) is not None else ""

    for r in rows:
        sent = f"{r['bytes_sent'] / 1e6:.1f}" if r.get("bytes_sent") else ""
        strategy = r["strategy"] + (f" ({r['attempts']} runs)" if r.get("attempts", 1) > 1 else "")
        lines.append(
            f"| {r['model']} | {r['rate_mbit']:g} | {strategy} | {r['steps_per_s']:.3f} | {cell(r, 'vs_none')} | "
            f"{cell(r, 'vs_torch')} | {sent} | {cell(r, 'bytes_ratio', '{:.3f}')} | {r['analytic_ratio']:.3f} |"
        )
    return lines + notes


def run_digits(strategy: str, codec: str, workdir: Path) -> dict:
    """The default digits run under ``strategy`` with ``codec`` over sockets; test accuracy and val_acc per epoch."""
    run_dir = workdir / f"{strategy}-{codec}"
    overrides = [
        f"strategy={strategy}", f"strategy.compression={codec}", "strategy.intra_node=ring",
        "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false", f"hydra.run.dir={run_dir}",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "PYTHONPATH": str(REPO)}
    subprocess.run(
        [sys.executable, str(REPO / "examples" / "train.py"), *overrides],
        check=True, env=env, cwd=workdir, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=1800,
    )  # fmt: skip
    summary = json.loads((run_dir / "metrics.json").read_text())
    per_epoch: dict[int, float] = {}
    for metrics in run_dir.glob("logs/version_*/metrics.csv"):
        with metrics.open() as f:
            for line in csv.DictReader(f):
                if line.get("val_acc"):
                    per_epoch[int(line["epoch"])] = float(line["val_acc"])
    return {
        "strategy": strategy,
        "codec": codec,
        "test_acc": summary["metrics"]["test_acc"],
        "val_acc_per_epoch": [per_epoch[e] for e in sorted(per_epoch)],
    }


def accuracy(strategies: list[str], codecs: list[str]) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for strategy in strategies:
            for codec in codecs:
                row = run_digits(strategy, codec, Path(tmp))
                print(json.dumps(row), flush=True)
                rows.append(row)
    return rows


def accuracy_report(rows: list[dict]) -> list[str]:
    lines = [
        f"Machine: {os.cpu_count()} CPUs; `python examples/train.py` (2 processes, 10 epochs of the bundled digits) "
        "with `strategy=S strategy.compression=C strategy.intra_node=ring`",
        "",
        "| strategy | codec | test accuracy | vs none (points) | val accuracy after epoch 1 / 5 / 10 |",
        "|---|---|---|---|---|",
    ]
    plain = {r["strategy"]: r["test_acc"] for r in rows if r["codec"] == "none"}
    for r in rows:
        vs = f"{100 * (r['test_acc'] - plain[r['strategy']]):+.1f}" if r["strategy"] in plain else ""
        curve = r["val_acc_per_epoch"]
        picks = " / ".join(f"{100 * curve[e]:.1f}" for e in (0, 4, 9) if e < len(curve))
        lines.append(f"| {r['strategy']} | {r['codec']} | {100 * r['test_acc']:.1f} % | {vs} | {picks} |")
    return lines


def plot_accuracy(rows: list[dict], out: Path) -> None:
    """results/compression_accuracy.png: validation accuracy per epoch, one panel per strategy, one line per codec."""
    plt = pyplot()
    if plt is None:
        return
    strategies = list(dict.fromkeys(r["strategy"] for r in rows))
    fig, axes = plt.subplots(1, len(strategies), figsize=(5 * len(strategies), 4), squeeze=False, sharey=True)
    for ax, strategy in zip(axes[0], strategies):
        for r in rows:
            if r["strategy"] == strategy:
                curve = r["val_acc_per_epoch"]
                label = f"{r['codec']} (test {100 * r['test_acc']:.1f} %)"
                ax.plot(range(1, len(curve) + 1), [100 * a for a in curve], marker="o", label=label)
        ax.set(xlabel="epoch", ylabel="validation accuracy (%)", title=strategy, ylim=(80, 100))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "compression_accuracy.png", dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--accuracy", action="store_true", help="the digits run per strategy x codec (no root)")
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS))
    parser.add_argument("--rates-mbit", type=float, nargs="+")
    parser.add_argument("--steps", type=int)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--strategies", nargs="+", choices=STRATEGIES, default=list(STRATEGIES))
    parser.add_argument("--codecs", nargs="+", choices=CODECS, default=list(CODECS))
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args()
    out = Path(args.out)
    if args.accuracy:
        rows = accuracy(args.strategies, args.codecs)
        save(out, "compression_accuracy", rows, accuracy_report)
        plot_accuracy(rows, out)
        return
    models = args.models or (["reference_cnn"] if args.quick else ["reference_cnn", "resnet18"])
    rates = args.rates_mbit or ([100.0] if args.quick else [1000.0, 100.0])
    steps = args.steps or (3 if args.quick else 5)
    rows = throughput(models, rates, steps, args.warmup)
    save(out, "compression", rows, throughput_report)


if __name__ == "__main__":
    main()
