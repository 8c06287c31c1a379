"""Codecs: what a gradient bucket looks like on the wire.

A codec is one axis of a synchronization scheme (see ``docs/architecture.md``), independent of the transport:
it runs a transport's exchanges on an encoded form of the bucket and decodes the result into the bucket, so
every strategy gains a new codec by taking one more class, the way DDP's communication hooks wrap a bucket's
all-reduce. A codec that compresses keeps its own state (residuals for error feedback) per bucket.
"""

from __future__ import annotations

from lightning_dp.comm.buckets import GradientBucket
from lightning_dp.comm.transports import Transport


class Codec:
    """The bucket travels as it is (full precision): the transport's exchanges unchanged.

    Subclasses encode before and decode after :meth:`reduce` (gradients up) and :meth:`share` (averaged
    gradients down, and for the parameter servers updated weights down: a lossy codec must keep the residuals of
    the two apart).
    """

    name = "none"

    def reduce(self, bucket: GradientBucket, transport: Transport) -> None:
        """Average ``bucket`` over the ranks through ``transport`` (see :meth:`Transport.reduce`)."""
        transport.reduce(bucket)

    def share(self, bucket: GradientBucket, transport: Transport) -> None:
        """Send the owners' values of ``bucket`` to every rank through ``transport`` (see :meth:`Transport.share`)."""
        transport.share(bucket)
