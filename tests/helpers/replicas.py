"""What every rank recorded after every step: replicas bit-identical, and close to a reference run."""

from __future__ import annotations

import torch

#: how close a strategy's weights must be to ``ddp``'s or to one process's (tests on GPUs monkeypatch it)
TOLERANCE = dict(rtol=1e-5, atol=1e-6)


def prefixed(prefix: str):
    """An ``assert_close`` message that puts ``prefix`` before torch's own description of the mismatch."""
    return lambda message: f"{prefix}: {message}"


def assert_identical_replicas(ranks: list[dict], key: str = "weights") -> None:
    """``ranks[r][key]`` (weights after every step) holds as many steps on every rank, at least one, each
    bit-identical to rank 0's."""
    counts = [len(rank[key]) for rank in ranks]
    assert len(ranks) >= 2 and counts[0] > 0 and len(set(counts)) == 1, f"{key}: steps recorded per rank: {counts}"
    for r, other in enumerate(ranks[1:], start=1):
        for step, (weights, theirs) in enumerate(zip(ranks[0][key], other[key], strict=True)):
            assert torch.equal(weights, theirs), f"{key}: rank {r} differs from rank 0 after step {step + 1}"


def close(got, want, what: str) -> None:
    torch.testing.assert_close(got, want, **TOLERANCE, msg=lambda m: f"{what}: {m}")


def assert_replicas_follow(ranks: list[dict], key: str, reference: list, what: str) -> None:
    """``ranks[r][key]`` (weights after every step) is identical on every rank (:func:`assert_identical_replicas`),
    as many steps as ``reference`` holds, each close to ``reference``'s."""
    assert_identical_replicas(ranks, key)
    assert len(ranks[0][key]) == len(reference), f"{what}: {len(ranks[0][key])} steps against {len(reference)}"
    for step, (got, want) in enumerate(zip(ranks[0][key], reference, strict=True)):
        close(got, want, f"{what}: step {step + 1}")


def assert_continues(full: list[dict], resumed: list[dict]) -> None:
    """The resumed run ends with the uninterrupted run's weights, bit for bit, having trained exactly the batches
    the uninterrupted run trained after the checkpoint."""
    for rank, (a, b) in enumerate(zip(full, resumed, strict=True)):
        assert b["resumed_from"] is not None, rank
        assert torch.equal(a["weights"], b["weights"]), (rank, (a["weights"] - b["weights"]).abs().max())
        assert a["trained"][len(a["trained"]) - len(b["trained"]) :] == b["trained"], rank
        assert 0 < len(b["trained"]) < len(a["trained"]), rank
