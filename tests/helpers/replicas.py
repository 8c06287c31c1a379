"""What every rank recorded after every step: replicas bit-identical, and close to a reference run."""

from __future__ import annotations

import torch

#: how close a strategy's weights must be to ``ddp``'s or to one process's (tests on GPUs monkeypatch it)
TOLERANCE = dict(rtol=1e-5, atol=1e-6)


def prefixed(prefix: str):
    """An ``assert_close`` message that puts ``prefix`` before torch's own description of the mismatch."""
    return lambda message: f"{prefix}: {message}"


def assert_identical_replicas(ranks: list[dict]) -> None:
    """``ranks[r]["weights"]`` (weights after every step) is bit-identical on every rank."""
    for step, weights in enumerate(ranks[0]["weights"]):
        for r, other in enumerate(ranks[1:], start=1):
            assert torch.equal(weights, other["weights"][step]), f"rank {r} differs from rank 0 after step {step + 1}"


def close(got, want, what: str) -> None:
    torch.testing.assert_close(got, want, **TOLERANCE, msg=lambda m: f"{what}: {m}")


def assert_replicas_follow(ranks: list[dict], key: str, reference: list, what: str) -> None:
    """``ranks[r][key]`` (weights after every step) is identical on both ranks and close to ``reference``."""
    assert len(ranks[0][key]) == len(reference), what
    for step, want in enumerate(reference):
        got = ranks[0][key][step]
        assert torch.equal(got, ranks[1][key][step]), f"{what}: ranks differ after step {step + 1}"
        close(got, want, f"{what}: step {step + 1}")
