"""Writing and reading a benchmark's results.

``results/<name>.json`` holds the command that ran, the machine it ran on, the rows it measured and the report
function (``module:function``) that renders them; ``results/<name>.md`` is that rendering, under the command and
the machine. ``python -m benchmarks.tables`` renders every ``.md`` (and the tables in the READMEs and guides) again
from the JSON, so the two never disagree.
"""

from __future__ import annotations

import importlib
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

#: a benchmark's report function: the rows in, ``Machine: ...`` and then the markdown body out
Report = Callable[[list[dict]], list[str]]

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


def save(
    out: Path | str, name: str, rows: list[dict], report: Report, command: str | None = None, machine: str | None = None
) -> None:
    """Write ``<out>/<name>.json`` (command, machine, rows, report) and ``<out>/<name>.md``, ``report``'s rendering of
    the rows as read back from the JSON; print the markdown. The machine is the one ``report`` names here unless
    given (a report rendered again from stored rows keeps the machine that measured them)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    record = {"command": command or command_line(), "machine": machine, "report": report_name(report), "rows": rows}
    (out / f"{name}.json").write_text(json.dumps(record, indent=1))  # the measurements first, whatever follows
    stored = json.loads((out / f"{name}.json").read_text())
    here, body = split_machine(report(stored["rows"]))
    if machine is None:
        stored["machine"] = here
        (out / f"{name}.json").write_text(json.dumps(stored, indent=1))
    text = markdown(stored["command"], stored["machine"], body)
    (out / f"{name}.md").write_text(text)
    print(text, end="")


def report_name(report: Report) -> str:
    """``module:function`` of ``report``, by the module's import name also when it runs as ``python -m``."""
    module = report.__module__
    if module == "__main__":
        spec = getattr(report, "__globals__", {}).get("__spec__")
        module = spec.name if spec is not None else f"benchmarks.{Path(sys.argv[0]).stem}"
    return f"{module}:{report.__qualname__}"


def render(record: dict[str, Any]) -> str:
    """A saved result's markdown: its report function's rendering of its rows, under its command and machine."""
    module, function = record["report"].split(":")
    _, body = split_machine(getattr(importlib.import_module(module), function)(record["rows"]))
    return markdown(record["command"], record["machine"], body)


def load(path: Path | str) -> dict[str, Any]:
    """A saved result: ``{"command": ..., "machine": ..., "report": "module:function", "rows": [...]}``."""
    record = json.loads(Path(path).read_text())
    if not isinstance(record, dict) or not {"command", "machine", "report", "rows"} <= record.keys():
        raise ValueError(f"{path} is not a benchmark result (command, machine, report, rows)")
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
