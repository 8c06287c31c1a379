"""Fixtures the strategy tests share across modules."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers.launch import run_script


@pytest.fixture(scope="session")
def uninterrupted(tmp_path_factory):
    """``tests/scripts/midepoch.py`` trained once per (strategy, options) by Lightning's own launch, without
    interruption: two epochs, a checkpoint every 3 steps. Returns (folder, each rank's results)."""
    runs: dict[tuple, tuple[Path, list[dict]]] = {}

    def run(strategy: str, *options: str) -> tuple[Path, list[dict]]:
        key = (strategy, *options)
        if key not in runs:
            out = tmp_path_factory.mktemp(f"uninterrupted-{strategy}")
            run_script("midepoch", "--strategy", strategy, *options, "--out", str(out), timeout=180)
            runs[key] = (out, [torch.load(out / f"rank{r}.pt") for r in range(2)])
        return runs[key]

    return run
