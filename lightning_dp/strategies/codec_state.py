"""A strategy's codec: the one its ``compression`` option asks for where buckets cross a network, and every rank's
codec state (error-feedback residuals, low-rank factors, the servers' full-precision weights) in a checkpoint, under
:data:`CODEC_STATE_KEY`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_dp.comm.buckets import GradientBucket
from lightning_dp.comm.codecs import Codec, check_compressible, make_codec
from lightning_dp.comm.transports import Transport

#: the checkpoint entry holding every rank's codec state
CODEC_STATE_KEY = "lightning_dp_codec"


def gather_codec_states(codec: Codec, group: dist.ProcessGroup | None) -> list[Any] | None:
    """Every rank's ``codec`` state, in ``group``'s rank order, on its rank 0 (``None`` elsewhere; collective over
    ``group``, the ranks that train now)."""
    gathered: list[Any] | None = [None] * dist.get_world_size(group) if dist.get_rank(group) == 0 else None
    dist.gather_object(codec.state_dict(), gathered, group=group, group_dst=0)
    dist.barrier(group=group)  # no rank completes it before rank 0 has every state (see rank_loss's sync points)
    return gathered


def with_codec_states(checkpoint: dict[str, Any], codec: Codec, gathered: list[Any] | None) -> dict[str, Any]:
    """``checkpoint`` with every rank's ``codec`` state (:func:`gather_codec_states`; ``None``: not on this rank)."""
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


def choose_codec(
    owner: str,
    compression: str,
    transport: Transport,
    buckets: list[GradientBucket],
    error_feedback: bool,
    powersgd_rank: int,
    powersgd_warmup_steps: int,
) -> Codec:
    """The codec of ``compression`` for ``buckets`` over ``transport``; the identity (saying so, naming ``owner``)
    where every bucket stays inside one machine's shared memory."""
    if compression == "none":
        return Codec()
    check_compressible(buckets, compression)  # wherever the run happens to be: the same answer
    if not transport.crosses_network:
        rank_zero_info(
            f"{owner}: compression={compression!r} has nothing to compress: every bucket of this run stays inside one "
            "machine's shared memory, so it runs uncompressed (full precision). Use intra_node='ring' to compress "
            "between the ranks of one machine anyway."
        )
        return Codec()
    return make_codec(compression, error_feedback, powersgd_rank, powersgd_warmup_steps)
