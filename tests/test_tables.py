"""The results' markdown and the documents' result blocks are what ``python -m benchmarks.tables`` renders from
``benchmarks/results/*.json``: no table or quoted figure can drift from its stored result."""

import json
import shutil

import pytest

from benchmarks.report import RESULTS, load, save
from benchmarks.tables import RENDERERS, REPO, outputs, render

pytestmark = pytest.mark.unit


def test_every_result_and_document_is_as_rendered_from_the_json():
    stale = [str(path.relative_to(REPO)) for path, text in outputs().items() if path.read_text() != text]
    assert not stale, f"run python -m benchmarks.tables: {stale}"


def test_every_stored_result_has_a_renderer_and_its_command_and_machine():
    for path in RESULTS.glob("*.json"):
        record = load(path)
        assert path.stem in RENDERERS, path.name
        assert record["command"].startswith("python -m benchmarks.") and record["machine"] and record["rows"]


def test_a_changed_figure_in_a_document_is_found_and_rewritten(tmp_path):
    shutil.copytree(RESULTS, tmp_path / "benchmarks" / "results")
    good = render("restarts")
    doc = tmp_path / "README.md"
    doc.write_text("intro\n<!-- results: restarts -->\n" + good.replace("| 10 | 10 | 10 |", "| 10 | 10 | 9 |") +
                   "<!-- /results -->\nafter\n")  # fmt: skip
    assert "| 10 | 10 | 9 |" in doc.read_text()
    rendered = outputs(tmp_path)[doc]
    assert rendered == "intro\n<!-- results: restarts -->\n" + good + "\n<!-- /results -->\nafter\n"


def test_a_saved_result_renders_to_the_markdown_the_benchmark_wrote(tmp_path):
    rows = [{"strategy": "ring_allreduce", "runs": 2, "finished": 2, "exact": 1, "hung": 0, "seconds_per_run": 3.25}]
    from benchmarks.restarts import report_lines

    save(tmp_path, "restarts", rows, report_lines(rows), command="python -m benchmarks.restarts --runs 2")
    assert json.loads((tmp_path / "restarts.json").read_text())["rows"] == rows
    assert render("restarts", results=tmp_path) == (tmp_path / "restarts.md").read_text()
    assert "| `ring_allreduce` | 2 | 2 | 1 | 0 | 3.2 |" in (tmp_path / "restarts.md").read_text()
