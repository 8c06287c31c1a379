"""Every rank's codec state (error-feedback residuals, low-rank factors, the servers' full-precision weights) in a
checkpoint, under :data:`CODEC_STATE_KEY`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch.distributed as dist

from lightning_dp.comm.codecs import Codec

#: the checkpoint entry holding every rank's codec state
CODEC_STATE_KEY = "lightning_dp_codec"


def with_codec_states(
    checkpoint: dict[str, Any], codec: Codec, world_size: int, is_global_zero: bool
) -> dict[str, Any]:
    """``checkpoint`` with every rank's ``codec`` state gathered on rank 0 (collective over the default group)."""
    gathered: list[Any] | None = [None] * world_size if is_global_zero else None
    dist.gather_object(codec.state_dict(), gathered, dst=0)
    if gathered is None:
        return checkpoint
    return {**checkpoint, CODEC_STATE_KEY: {"codec": codec.name, "ranks": gathered}}


def load_codec_state(checkpoint: Mapping[str, Any], codec: Codec, world_size: int, rank: int) -> str | None:
    """Restore this ``rank``'s ``codec`` state from ``checkpoint``; what kept it from doing so, or ``None``."""
    saved = checkpoint.get(CODEC_STATE_KEY)
    if saved is None:
        return "the checkpoint holds no codec state"
    if saved["codec"] != codec.name or len(saved["ranks"]) != world_size:
        return f"the checkpoint's codec state is for {saved['codec']!r} on {len(saved['ranks'])} ranks"
    try:
        codec.load_state_dict(saved["ranks"][rank])
    except ValueError as error:
        return f"rank {rank}: {error}"
    return None
