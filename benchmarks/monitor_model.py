"""``CommMonitor``'s two columns on the example app: the exchange it measured beside the one the cost model
predicted for the same step, over repeated runs of ``python examples/train.py``.

    python -m benchmarks.monitor_model             # 3 runs per setting (about 4 minutes on 2 cores)
    python -m benchmarks.monitor_model --runs 5

Each run is the app as the README shows it (the main job: ``ring_allreduce`` through shared memory, 2 ranks) or
with the overrides below; its ``metrics.json`` holds the monitor's means per step on rank 0. The ratio is measured
over predicted communication seconds per step (each exchange from when its peers were there); exposed seconds and
the wait for the slower peer are shown beside it, the latter with no prediction (the model has no slow ranks).
"""

from __future__ import annotations

import statistics

from benchmarks.app_accuracy import app_machine, app_runs
from benchmarks.report import save

#: setting name -> the app's overrides
SETTINGS = {
    "main job": [],
    "sharded_ps": ["strategy=sharded_ps"],
    "ring_allreduce, 3 ranks": ["trainer.devices=3", "global_batch_size=126"],
}


def report(rows: list[dict]) -> list[str]:
    """The table of ``rows`` (``Machine: ...`` first)."""
    lines = [
        app_machine(
            rows,
            "reference CNN, 10 epochs on the bundled digits",
            "CommMonitor's means per step on rank 0, medians over the runs",
        ),  # fmt: skip
        "",
        "| setting | overrides | runs | measured ms | predicted ms | measured / predicted (least, median, most) "
        "| exposed ms (predicted) | peer wait ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name in dict.fromkeys(r["setting"] for r in rows):
        of = [r for r in rows if r["setting"] == name]
        ratios = [r["measured_s"] / r["predicted_s"] for r in of]

        def ms(key: str, of: list[dict] = of) -> str:
            return f"{1e3 * statistics.median(r[key] for r in of):.2f}"

        lines.append(
            f"| {name} | `{' '.join(of[0]['overrides']) or '(none)'}` | {len(of)} | {ms('measured_s')} | "
            f"{ms('predicted_s')} | {min(ratios):.2f}, {statistics.median(ratios):.2f}, {max(ratios):.2f} | "
            f"{ms('exposed_s')} ({ms('predicted_exposed_s')}) | {ms('peer_wait_s')} |"
        )
    return lines


def main() -> None:
    args, runs = app_runs(__doc__.split("\n\n")[0], SETTINGS, default_runs=3)
    rows = []
    for name, overrides, run, metrics in runs:
        comm = metrics["comm"]
        measured, predicted, link = comm["measured"], comm["predicted"], comm["link"]
        rows.append({"setting": name, "overrides": overrides, "run": run, "steps": comm["steps"],
                     "measured_s": measured["seconds"], "predicted_s": predicted["seconds"],
                     "exposed_s": measured["exposed_seconds"], "predicted_exposed_s": predicted["exposed_seconds"],
                     "peer_wait_s": measured["peer_wait_seconds"], "local_latency_s": link["local_latency"],
                     "local_bandwidth": link["local_bandwidth"],
                     "overlap_slowdown": link["overlap_slowdown"]})  # fmt: skip
        print(f"{name} run {run}: measured {1e3 * rows[-1]['measured_s']:.3f} ms, predicted "
              f"{1e3 * rows[-1]['predicted_s']:.3f} ms")  # fmt: skip
    save(args.out, "monitor_model", rows, report)


if __name__ == "__main__":
    main()
