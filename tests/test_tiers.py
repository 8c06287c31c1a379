"""CI runs every tier but the GPU tests: with ``LIGHTNING_DP_REQUIRE_TIERS=1`` a skip fails, naming its reason, and a
GPU test's skip stays a skip (``tests/conftest.py``); without it every skip stays a skip."""

from pathlib import Path

import pytest

pytest_plugins = ["pytester"]
pytestmark = pytest.mark.unit

TESTS = """
import pytest

@pytest.mark.unit
def test_a_tier_that_cannot_run_here():
    pytest.skip("no SLURM cluster: slurmd missing")

@pytest.mark.unit
@pytest.mark.gpu
def test_on_a_gpu():
    pytest.skip("needs a CUDA device")

@pytest.fixture
def cluster():
    pytest.skip("needs root to create network namespaces")

@pytest.mark.unit
def test_behind_a_skipping_fixture(cluster):
    pass

@pytest.mark.unit
def test_that_runs():
    assert True
"""


@pytest.mark.parametrize("required", [True, False])
def test_ci_fails_every_skip_but_the_gpu_tests(pytester, monkeypatch, required):
    pytester.makeconftest((Path(__file__).parent / "conftest.py").read_text())
    pytester.makepyfile(test_tiers_sample=TESTS)
    _require(monkeypatch, required)
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-rfEs")
    if required:
        result.assert_outcomes(passed=1, skipped=1, failed=1, errors=1)
        result.stdout.fnmatch_lines(["*requires every tier but the GPU ones: no SLURM cluster: slurmd missing*"])
        result.stdout.fnmatch_lines(["*requires every tier but the GPU ones*network namespaces*"])
    else:
        result.assert_outcomes(passed=1, skipped=3)


@pytest.mark.parametrize("required", [True, False])
def test_ci_fails_a_module_that_skips_for_a_missing_package(pytester, monkeypatch, required):
    pytester.makeconftest((Path(__file__).parent / "conftest.py").read_text())
    pytester.makepyfile(test_module_skip='import pytest\npytest.importorskip("no_such_package_here")\n')
    _require(monkeypatch, required)
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider")
    if required:
        result.assert_outcomes(errors=1)
        result.stdout.fnmatch_lines(["*requires every tier but the GPU ones*no_such_package_here*"])
    else:
        result.assert_outcomes(skipped=1)


def _require(monkeypatch, required: bool) -> None:
    if required:
        monkeypatch.setenv("LIGHTNING_DP_REQUIRE_TIERS", "1")
    else:
        monkeypatch.delenv("LIGHTNING_DP_REQUIRE_TIERS", raising=False)
