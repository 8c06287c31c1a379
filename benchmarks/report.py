"""Writing and reading a benchmark's results.

``results/<name>.json`` holds the command that ran, the machine it ran on and the rows it measured;
``results/<name>.md`` is the table the benchmark's report function renders from those rows, under the command and
the machine. ``python -m benchmarks.tables`` renders every ``.md`` (and the tables in the READMEs and guides) again
from the JSON, so the two never disagree.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"


def command_line() -> str:
    """How this benchmark was started, as a user would type it (``python -m benchmarks.<name> ...``)."""
    return " ".join(["python", "-m", f"benchmarks.{Path(sys.argv[0]).stem}", *sys.argv[1:]])


def split_machine(lines: list[str]) -> tuple[str, list[str]]:
    """``lines`` as a report function returns them, ``Machine: ...`` first: that line's text, and the rest."""
    if not lines or not lines[0].startswith("Machine: "):
        raise ValueError("a report starts with its 'Machine: ...' line")
    rest = lines[1:]
    while rest and not rest[0]:
        rest = rest[1:]
    return lines[0].removeprefix("Machine: "), rest


def markdown(command: str, machine: str, body: list[str]) -> str:
    """A result's markdown: the command, the machine, then the report's body."""
    return "\n".join([f"Command: `{command}`  ", f"Machine: {machine}", "", *body]) + "\n"


def save(out: Path | str, name: str, rows: list[dict], lines: list[str], command: str | None = None) -> None:
    """Write ``<out>/<name>.json`` (command, machine, rows) and ``<out>/<name>.md``; print the markdown. ``lines`` is
    what the benchmark's report function returned for ``rows``: ``Machine: ...`` first."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    command = command or command_line()
    machine, body = split_machine(lines)
    record = {"command": command, "machine": machine, "rows": rows}
    (out / f"{name}.json").write_text(json.dumps(record, indent=1))
    text = markdown(command, machine, body)
    (out / f"{name}.md").write_text(text)
    print(text, end="")


def load(path: Path | str) -> dict[str, Any]:
    """A saved result: ``{"command": ..., "machine": ..., "rows": [...]}``."""
    record = json.loads(Path(path).read_text())
    if not isinstance(record, dict) or not {"command", "machine", "rows"} <= record.keys():
        raise ValueError(f"{path} is not a benchmark result (command, machine, rows)")
    return record


def rows(path: Path | str) -> list[dict]:
    """The rows of a saved result."""
    return load(path)["rows"]


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
