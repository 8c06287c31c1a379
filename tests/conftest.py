"""Test tiers: every test is ``unit`` or ``multiprocess``, optionally also ``netns``, ``slow`` or ``gpu``.

python -m pytest -m unit                  # in-process tests only, well under a minute
python -m pytest -m "not slow"            # everything but the longest launches
python -m pytest                          # everything (netns, SLURM, Ray and gpu tests skip where they cannot run)

With ``LIGHTNING_DP_REQUIRE_TIERS=1`` (set by ``.ci/run``) a test that skips fails instead, naming its reason, unless
it is a ``gpu`` test: CI runs every tier but the GPU ones, and a tier that cannot run there is an error, not a pass.

"""

from __future__ import annotations

import os

import pytest

from tests.helpers.launch_report import LaunchReport

TIERS = ("unit", "multiprocess")
MARKERS = {
    "unit": "runs in this process, starts no other process; fast",
    "multiprocess": "starts processes: run_distributed, run_script, the Hydra app, a Trainer fitting with devices > 1",
    "netns": "builds emulated hosts in network namespaces (needs root, iproute2 and tc; skipped otherwise)",
    "slow": "a single test that takes over ~30 s on 2 CPU cores",
    "gpu": "needs CUDA (skipped without it)",
}


def pytest_configure(config: pytest.Config) -> None:
    for name, description in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {description}")
    report = LaunchReport()
    report.install()
    config.pluginmanager.register(report, _LAUNCH_REPORT)


def pytest_unconfigure(config: pytest.Config) -> None:
    report = config.pluginmanager.get_plugin(_LAUNCH_REPORT)
    if report is not None:
        report.uninstall()


_LAUNCH_REPORT = "lightning_dp_launch_report"


@pytest.hookimpl(tryfirst=True)  # before -m deselects anything: a test without its tier fails every selection
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    wrong = []
    for item in items:
        tiers = [tier for tier in TIERS if item.get_closest_marker(tier) is not None]
        if len(tiers) != 1:
            wrong.append(f"  {item.nodeid}: {' and '.join(tiers) or 'no tier'}")
    if wrong:
        raise pytest.UsageError(
            "every test needs exactly one of the markers @pytest.mark.unit (in-process) or "
            "@pytest.mark.multiprocess (starts processes), per test or as the module's pytestmark; "
            "see tests/conftest.py:\n" + "\n".join(wrong)
        )


#: set by CI: every tier but the GPU tests must run (see the module docstring)
REQUIRE_TIERS = os.environ.get("LIGHTNING_DP_REQUIRE_TIERS") == "1"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    report = yield
    if REQUIRE_TIERS and report.skipped and not hasattr(report, "wasxfail") and item.get_closest_marker("gpu") is None:
        _fail_skip(report, item.nodeid)
    return report


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector: pytest.Collector):
    report = yield
    if REQUIRE_TIERS and report.skipped and not collector.nodeid.endswith("test_gpu.py"):
        _fail_skip(report, collector.nodeid)
    return report


def _fail_skip(report, nodeid: str) -> None:
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    reason = reason.removeprefix("Skipped: ")
    report.outcome = "failed"
    required = "LIGHTNING_DP_REQUIRE_TIERS=1 requires every tier but the GPU ones"
    report.longrepr = f"{nodeid} skipped, but {required}: {reason}"


def _shared_memory_segments() -> set[str]:
    from lightning_dp.comm.transports.shm import NAME_PREFIX, SHM_DIR

    return {n for n in os.listdir(SHM_DIR) if n.startswith(NAME_PREFIX)} if os.path.isdir(SHM_DIR) else set()


def pytest_sessionstart(session: pytest.Session) -> None:
    session.config.stash[_SEGMENTS_BEFORE] = _shared_memory_segments()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """The shared-memory transports leave nothing in /dev/shm, also after the tests that kill ranks."""
    left = _shared_memory_segments() - session.config.stash.get(_SEGMENTS_BEFORE, set())
    if left:
        print(f"\nshared-memory segments left behind by the test run: {sorted(left)}")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


_SEGMENTS_BEFORE = pytest.StashKey[set]()
