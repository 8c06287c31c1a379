"""``CommMonitor``'s summary table, from the values a run gathered (no process started)."""

from __future__ import annotations

import pytest

from lightning_dp.monitor import CommSummary

pytestmark = pytest.mark.unit


def test_the_summary_says_which_dedicated_servers_were_lost_and_which_serve_again():
    loss = {"lost_ranks": [], "loss_causes": [], "loss_steps": [], "recovery_seconds": [], "dropped_samples": 0,
            "lost_servers": [1, 0], "server_recovery_seconds": [0.04, 0.35], "returned_servers": [1],
            "server_return_seconds": [0.26], "server_return_steps": [8], "joined_ranks": [], "join_steps": [],
            "handover_bytes": []}  # fmt: skip
    table = CommSummary("sharded_ps", steps=18, rank_loss=loss).table()
    assert "lost dedicated server 1; its replica took its share over 0.040 s later" in table
    assert "lost dedicated server 0; its replica took its share over 0.350 s later" in table
    assert "dedicated server 1 started again and serves again, 0.260 s after it claimed its place" in table


def test_the_summary_says_which_ranks_left_on_purpose_and_how_long_the_members_paused():
    loss = {"lost_ranks": [], "loss_causes": [], "loss_steps": [], "recovery_seconds": [], "dropped_samples": 0,
            "joined_ranks": [], "join_steps": [], "handover_bytes": [], "left_ranks": [2, 1], "leave_steps": [7, 12],
            "leave_pause_seconds": [0.031, 0.2]}  # fmt: skip
    table = CommSummary("ring_allreduce", steps=18, rank_loss=loss).table()
    assert "rank 2 left the job on purpose after 7 steps; the members paused 0.031 s" in table
    assert "rank 1 left the job on purpose after 12 steps; the members paused 0.200 s" in table
    assert "lost rank" not in table
