"""Codecs: what a gradient bucket looks like on the wire.

A codec is one axis of a synchronization scheme (see ``docs/architecture.md``), independent of the transport:
it runs a transport's exchanges on an encoded form of the bucket and decodes the result into the bucket, so
every strategy gains a new codec by taking one more class, the way DDP's communication hooks wrap a bucket's
all-reduce. A codec that compresses keeps its own state per bucket (residuals for error feedback, low-rank
factors), which :meth:`Codec.state_dict` hands to checkpoints.

- :class:`~.base.Codec` (``"none"``): the bucket travels as it is.
- :class:`~.half_precision.HalfPrecisionCodec` (``"fp16"``, ``"bf16"``): 16 bits per element each way, with
  error feedback.
- :class:`~.powersgd.PowerSGDCodec` (``"powersgd"``): rank-``r`` factors of every matrix-shaped gradient
  (Vogels et al., NeurIPS 2019), with error feedback and warm start.

:func:`make_codec` builds one by name.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lightning_dp.comm.buckets import GradientBucket
from lightning_dp.comm.codecs.base import CODEC_NAMES, Codec, check_compressible
from lightning_dp.comm.codecs.half_precision import HalfPrecisionCodec
from lightning_dp.comm.codecs.powersgd import PowerSGDCodec
from lightning_dp.comm.errors import ConfigurationError


def make_codec(
    name: str, error_feedback: bool = True, powersgd_rank: int = 4, powersgd_warmup_steps: int = 10
) -> Codec:
    """The codec of the ``compression`` option ``name`` (one of :data:`CODEC_NAMES`)."""
    if name == "none":
        return Codec()
    if name in ("fp16", "bf16"):
        return HalfPrecisionCodec(torch.float16 if name == "fp16" else torch.bfloat16, error_feedback)
    if name == "powersgd":
        return PowerSGDCodec(powersgd_rank, powersgd_warmup_steps, error_feedback)
    allowed = ", ".join(map(repr, CODEC_NAMES))
    raise ConfigurationError(f"compression={name!r} is not supported; allowed values: {allowed}")


def compression_ratio(codec: Codec, buckets: Sequence[GradientBucket]) -> float:
    """Bytes on the wire with ``codec`` over bytes without it, for ``buckets`` (after any warm-up)."""
    total = sum(b.nbytes for b in buckets)
    return sum(codec.wire_bytes(b) for b in buckets) / total if total else 1.0


__all__ = [
    "CODEC_NAMES",
    "Codec",
    "HalfPrecisionCodec",
    "PowerSGDCodec",
    "check_compressible",
    "compression_ratio",
    "make_codec",
]
