"""Writing a benchmark's results: rows as JSON, the table as markdown under the command that made it."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def command_line() -> str:
    """How this benchmark was started, as a user would type it (``python -m benchmarks.<name> ...``)."""
    return " ".join(["python", "-m", f"benchmarks.{Path(sys.argv[0]).stem}", *sys.argv[1:]])


def save(out: Path | str, name: str, rows: list[dict], lines: list[str]) -> None:
    """Write ``<out>/<name>.json`` (the rows) and ``<out>/<name>.md`` (``Command:`` then ``lines``); print the table."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(rows, indent=1))
    text = "\n".join([f"Command: `{command_line()}`  ", *lines]) + "\n"
    (out / f"{name}.md").write_text(text)
    print(text, end="")


def pyplot() -> Any:
    """``matplotlib.pyplot`` drawing to files (the Agg backend), or ``None`` with a note when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot (pip install '.[bench]')")
        return None
    return plt
