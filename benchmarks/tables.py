"""Render every result's markdown, and the result blocks in the READMEs and guides, from ``results/*.json``.

    python -m benchmarks.tables            # rewrite results/<name>.md and every result block
    python -m benchmarks.tables --check    # change nothing; exit 1 naming every file that is out of date

A result block in a markdown file is the region between ``<!-- results: NAME -->`` (or ``<!-- results: NAME
VIEW -->``) and ``<!-- /results -->``; it holds the command and machine of ``results/NAME.json`` and the table its
benchmark's report function renders from the rows (or the named view of them). Prose never quotes a number a
block does not show, so after a benchmark runs, this command brings every document up to date.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

from benchmarks.report import RESULTS, load, markdown
from benchmarks.report import render as render_record

REPO = RESULTS.parents[1]
#: the documents whose result blocks are rendered
DOCUMENTS = ("README.md", "benchmarks/README.md", "docs/*.md")

OPENING = "<!-- results: "
CLOSING = "<!-- /results -->"
BLOCK = re.compile(
    r"(<!-- results: (?P<name>\w+)(?: (?P<view>\w+))? -->\n)(?P<body>(?:(?!<!-- results: ).)*?)(<!-- /results -->)",
    re.S,
)


def speedups(rows: list[dict]) -> list[str]:
    """``end_to_end``'s steps/s of every strategy over ``ddp``'s, one row per model and N."""
    strategies = [s for s in dict.fromkeys(r["strategy"] for r in rows) if s != "ddp"]
    lines = [
        "| model | N | " + " | ".join(f"`{s}`" for s in strategies) + " |",
        "|---|---|" + "---|" * len(strategies),
    ]
    for model, n in dict.fromkeys((r["model"], r["world_size"]) for r in rows):
        by = {r["strategy"]: r for r in rows if (r["model"], r["world_size"]) == (model, n)}
        cells = [f"{by[s]['vs_ddp']:.2f}×" if s in by else "" for s in strategies]
        lines.append(f"| {model} | {n} | " + " | ".join(cells) + " |")
    return lines


def comm_bound_phases(rows: list[dict]) -> list[str]:
    """``end_to_end``'s phase table for the communication-bound model."""
    from benchmarks.end_to_end import phase_lines

    return phase_lines([r for r in rows if r["model"] == "comm_bound" and "phase_ms_per_step" in r])


def sgd_pull(rows: list[dict]) -> list[str]:
    """``end_to_end_sgd``'s servers against the ring, the pull overlapped and blocking."""
    from benchmarks.end_to_end import pull_lines

    return pull_lines(rows)


def sgd_resnet_phases(rows: list[dict]) -> list[str]:
    """``end_to_end_sgd``'s phase table for ResNet-18."""
    from benchmarks.end_to_end import phase_lines

    return phase_lines([r for r in rows if r["model"].startswith("resnet18") and "phase_ms_per_step" in r])


def collectives_summary(rows: list[dict]) -> list[str]:
    """The shared-memory all-reduce (in place, as the strategies run it) over gloo's, MPI's and one process's memory
    copy, as ranges over the table's rows."""
    shm = [r for r in rows if r["op"] == "shm_in_place"]
    gloo = [r["vs_gloo"] for r in shm]
    mpi = [r["vs_mpi"] for r in shm if r.get("vs_mpi") is not None]
    copy = [r["vs_memory_copy"] for r in shm]
    two = sum(v >= 2 for v in gloo)
    lines = [f"Shared memory over gloo: {min(gloo):.2f}–{max(gloo):.2f}× (2× or more in {two} of {len(gloo)} rows)."]
    if mpi:
        lines[0] += f" Over MPI: {min(mpi):.2f}–{max(mpi):.2f}× ({sum(v >= 1 for v in mpi)} of {len(mpi)} rows ≥ 1)."
    lines[0] += (
        f" Over one process's memory copy: {min(copy):.2f}–{max(copy):.2f}× "
        f"({sum(v >= 1 for v in copy)} of {len(copy)} rows ≥ 1)."
    )
    return lines


def app_accuracy_summary(rows: list[dict]) -> list[str]:
    """The example app's test accuracy per setting, least and most, as one line."""
    parts = []
    for setting in dict.fromkeys(r["setting"] for r in rows):
        acc = [100 * r["test_acc"] for r in rows if r["setting"] == setting]
        spread = f"{min(acc):.1f} %" if min(acc) == max(acc) else f"{min(acc):.1f}–{max(acc):.1f} %"
        parts.append(f"{setting} {spread}")
    runs = statistics.median(sum(r["setting"] == s for r in rows) for s in {r["setting"] for r in rows})
    return [f"Test accuracy over {runs:g} runs each: " + "; ".join(parts) + "."]


def scale_best(rows: list[dict]) -> list[str]:
    """``scale_model``'s fastest scheme per size, cluster and model."""
    from benchmarks.scale_model import best_lines

    return best_lines(rows)


def scale_anchor(rows: list[dict]) -> list[str]:
    """``scale_model``'s Horovod anchor."""
    from benchmarks.scale_model import anchor_lines

    return anchor_lines(rows)


def straggler_persistent(rows: list[dict]) -> list[str]:
    """``straggler``'s rows with a persistent straggler."""
    from benchmarks.straggler import throughput_report

    return throughput_report([r for r in rows if r["pattern"] == "persistent"])[2:]  # the machine line is the block's


def gpu_check_stages(rows: list[dict]) -> list[str]:
    """``gpu_check``'s table of stages."""
    from benchmarks.gpu_check import stage_lines

    return stage_lines(rows)


#: ``(name, view)`` -> a function of the rows giving the block's body in place of the full report
VIEWS: dict[tuple[str, str], Callable[[list[dict]], list[str]]] = {
    ("end_to_end", "speedups"): speedups,
    ("end_to_end", "phases"): comm_bound_phases,
    ("end_to_end_sgd", "pull"): sgd_pull,
    ("end_to_end_sgd", "phases"): sgd_resnet_phases,
    ("collectives", "summary"): collectives_summary,
    ("app_accuracy", "summary"): app_accuracy_summary,
    ("scale_model", "best"): scale_best,
    ("scale_model", "anchor"): scale_anchor,
    ("straggler", "persistent"): straggler_persistent,
    ("gpu_check_on_cpu", "stages"): gpu_check_stages,
}


def render(name: str, view: str | None = None, results: Path = RESULTS) -> str:
    """The markdown of ``results/<name>.json``: command, machine and the report (or ``view``) of its rows."""
    record = load(results / f"{name}.json")
    if view is None:
        return render_record(record)
    if (name, view) not in VIEWS:
        raise KeyError(f"no view {view!r} of {name}; the views: {sorted(VIEWS)}")
    return markdown(record["command"], record["machine"], VIEWS[name, view](record["rows"]))


def fill_blocks(text: str, results: Path = RESULTS) -> str:
    """``text`` with every result block rendered again; a block without its closing line is an error."""
    if text.count(OPENING) != text.count(CLOSING):
        raise ValueError(f"{text.count(OPENING)} result blocks open and {text.count(CLOSING)} close")
    return BLOCK.sub(lambda m: m[1] + render(m["name"], m["view"], results) + "\n" + m[5], text)


def outputs(root: Path = REPO) -> dict[Path, str]:
    """Every file this command writes, with its new contents."""
    results = root / "benchmarks" / "results"
    files = {results / f"{p.stem}.md": render(p.stem, None, results) for p in sorted(results.glob("*.json"))}
    for pattern in DOCUMENTS:
        for doc in sorted(root.glob(pattern)):
            try:
                files[doc] = fill_blocks(doc.read_text(), results)
            except ValueError as error:
                raise ValueError(f"{doc}: {error}") from None
    return files


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if a file is out of date")
    args = parser.parse_args()
    stale = []
    for path, text in outputs().items():
        if not path.exists() or path.read_text() != text:
            stale.append(path.relative_to(REPO))
            if not args.check:
                path.write_text(text)
    if args.check and stale:
        sys.exit("out of date (run python -m benchmarks.tables): " + ", ".join(map(str, stale)))
    print(f"{'out of date' if args.check else 'rewrote'}: {', '.join(map(str, stale)) or 'nothing'}")


if __name__ == "__main__":
    main()
