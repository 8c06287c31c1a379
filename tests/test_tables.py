"""The results' markdown and the documents' result blocks are what ``python -m benchmarks.tables`` renders from
``benchmarks/results/*.json``: no table or quoted figure can drift from its stored result."""

import importlib
import json
import shutil

import pytest

from benchmarks.report import RESULTS, load, save
from benchmarks.tables import REPO, fill_blocks, outputs, render

pytestmark = pytest.mark.unit


def test_every_result_and_document_is_as_rendered_from_the_json():
    stale = [str(path.relative_to(REPO)) for path, text in outputs().items() if path.read_text() != text]
    assert not stale, f"run python -m benchmarks.tables: {stale}"


def test_every_stored_result_names_its_command_machine_and_report_function():
    for path in RESULTS.glob("*.json"):
        record = load(path)
        module, function = record["report"].split(":")
        assert callable(getattr(importlib.import_module(module), function)), path.name
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


def test_a_block_that_lost_its_closing_line_is_an_error_not_a_deleted_neighbour():
    text = "<!-- results: restarts -->\nold\n<!-- results: restarts -->\nold\n<!-- /results -->\n"
    with pytest.raises(ValueError, match="2 result blocks open and 1 close"):
        fill_blocks(text)


def test_a_saved_result_renders_to_the_markdown_the_benchmark_wrote(tmp_path):
    from benchmarks.restarts import report_lines

    rows = [{"strategy": "ring_allreduce", "runs": 2, "finished": 2, "exact": 1, "hung": 0, "seconds_per_run": 3.25}]
    save(tmp_path, "restarts", rows, report_lines, command="python -m benchmarks.restarts --runs 2")
    record = json.loads((tmp_path / "restarts.json").read_text())
    assert record["rows"] == rows and record["report"] == "benchmarks.restarts:report_lines"
    assert record["machine"].startswith(tuple("0123456789"))  # the machine the report named here
    assert render("restarts", results=tmp_path) == (tmp_path / "restarts.md").read_text()
    assert "| `ring_allreduce` | 2 | 2 | 1 | 0 | 3.2 |" in (tmp_path / "restarts.md").read_text()
    save(tmp_path, "restarts", rows, report_lines, command="c", machine="the machine that measured")
    assert load(tmp_path / "restarts.json")["machine"] == "the machine that measured"


def test_the_stored_analytic_byte_ratios_follow_from_the_models_shapes():
    from benchmarks.compression import analytic_ratio

    rows = load(RESULTS / "compression.json")["rows"]
    assert len(rows) == 36
    for r in rows:
        assert analytic_ratio(r["model"], r["strategy"], r["codec"]) == pytest.approx(r["analytic_ratio"], rel=1e-12)


def test_a_report_run_as_a_module_is_recorded_by_its_import_name():
    import types

    from benchmarks.report import report_name

    namespace = {"__name__": "__main__", "__spec__": types.SimpleNamespace(name="benchmarks.straggler")}
    exec("def table(rows):\n    return rows\n", namespace)
    assert namespace["table"].__module__ == "__main__"
    assert report_name(namespace["table"]) == "benchmarks.straggler:table"
