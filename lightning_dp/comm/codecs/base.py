"""The codec contract: a bucket travels as it is; a compressing codec subclasses :class:`Codec`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch

from lightning_dp.comm.buckets import GradientBucket
from lightning_dp.comm.cost import Wire
from lightning_dp.comm.errors import ConfigurationError
from lightning_dp.comm.transports.base import CodecTransport, Transport

#: the ``compression`` option's values
CODEC_NAMES = ("none", "fp16", "bf16", "powersgd")


class Codec:
    """The bucket travels as it is (full precision): the transport's exchanges unchanged.

    The life of a codec: :meth:`bind` once the transport laid out the buckets; per synchronization
    :meth:`reduce` (gradients up), and where every rank needs the averaged gradients :meth:`share`; for the
    parameter servers, per step, :meth:`before_update` on the owners just before they run the optimizer and
    :meth:`share_weights` once the owners packed their new weights into the bucket. A lossy codec must keep the
    residuals of the two directions apart.
    """

    name = "none"
    #: whether :meth:`share_weights` may leave values on an owner that differ from its parameters (then every rank,
    #: owners included, takes the weights from the bucket)
    rewrites_weights = False
    #: exchanges of the encoded bucket one reduction takes (a low-rank codec sends two factors, one after the other)
    passes: ClassVar[int] = 1
    #: whether the weights the servers send back travel encoded too (or in full precision)
    encodes_weights: ClassVar[bool] = True
    #: whether an exchange abandoned half-way can run again over the survivors of a lost rank
    #: (``on_rank_loss="continue"``): what the abandoned attempt left in its state is at most a rounding of the
    #: bucket, and none of its state must agree across ranks
    survives_rank_loss: ClassVar[bool] = True

    @property
    def keeps_residuals(self) -> bool:
        """Whether each rank carries an error-feedback residual from one step to the next (lost with the rank)."""
        return False

    def bind(self, buckets: Sequence[GradientBucket], transport: Transport) -> None:
        """Prepare for ``buckets`` travelling over ``transport`` (every rank, the same buckets)."""

    def reduce(self, bucket: GradientBucket, transport: Transport) -> None:
        """Average ``bucket`` over the ranks through ``transport`` (see :meth:`Transport.reduce`)."""
        transport.reduce(bucket)

    def share(self, bucket: GradientBucket, transport: Transport) -> None:
        """Send the owners' averaged gradients of ``bucket`` to every rank (see :meth:`Transport.share`)."""
        transport.share(bucket)

    def before_update(self, bucket: GradientBucket, transport: Transport) -> None:
        """An owner is about to run the optimizer on its part of ``bucket``'s parameters."""

    def share_weights(self, bucket: GradientBucket, transport: Transport) -> None:
        """The owners packed their updated weights into ``bucket``: leave on every rank the weights it must take."""
        transport.share(bucket)

    def rebind(self, buckets: Sequence[GradientBucket], transport: Transport) -> None:
        """:meth:`bind` to a new transport (the survivors' after a loss), keeping this rank's state."""
        state = self.state_dict()
        self.bind(buckets, transport)
        self.load_state_dict(state)

    def wire_bytes(self, bucket: GradientBucket) -> int:
        """Bytes one rank's contribution of ``bucket`` takes on the wire (once compression is running)."""
        return bucket.nbytes

    def traffic(self, buckets: Sequence[GradientBucket]) -> Wire:
        """How ``buckets`` travel with this codec once it runs: the cost model's record of them."""
        return Wire(tuple(self.wire_bytes(b) for b in buckets), self.passes, self.encodes_weights)

    def state_dict(self) -> dict[str, Any]:
        """This rank's codec state (CPU tensors), for a checkpoint; empty when the codec keeps none."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (after :meth:`bind`); raises ``ValueError``, changing nothing, when it does not
        fit the buckets."""


def check_compressible(buckets: Sequence[GradientBucket], name: str) -> None:
    """Refuse compression ``name`` for gradients narrower than float32 (with a message naming the option)."""
    narrow = sorted({str(b.buffer.dtype) for b in buckets if b.buffer.dtype not in (torch.float32, torch.float64)})
    if narrow:
        raise ConfigurationError(
            f"compression={name!r} encodes float32 gradients, but some of the model's gradients are {narrow[0]} "
            "(a 16-bit '-true' precision): they already travel in 16 bits. Use compression='none', or a '-mixed' "
            "precision."
        )


def encoding_transport(transport: Transport, name: str) -> CodecTransport:
    """``transport`` as one that carries encoded buckets; a transport of full-precision buckets only (shared memory
    inside one machine, dedicated servers) is refused, naming the codec."""
    if not isinstance(transport, CodecTransport):
        raise ConfigurationError(
            f"compression={name!r} cannot run over {type(transport).__name__}, which carries full-precision buckets "
            "only; use compression='none'"
        )
    return transport
