"""Where a bucket's bytes are while a transport moves them: in place, or staged through pinned host memory.

NCCL's messages read and write device memory; gloo's point-to-point messages read and write host memory only (a
CUDA pointer handed to them aborts the process inside gloo). A transport whose process group moves host memory
only, carrying buckets that live on a CUDA device, therefore runs each exchange on a host copy of the bucket
(:class:`HostStaging`), the way gloo's own all-reduce of CUDA tensors does:

- one pinned host buffer per bucket, allocated once when the transport is bound (and, on first use, one more for
  a codec's residual or a tensor a codec all-reduces);
- before an exchange the bucket is copied in on the current CUDA stream (the communication thread's own, which
  already waits for the events recorded where the gradients were produced), and the host waits for that copy
  alone before it sends;
- the exchange runs on the host copy (the partial sums and averages are computed on the host), and the result is
  copied back on the same stream without blocking the host: whatever reads the bucket next on that stream, or
  waits for its events, sees the result. The host buffer is written again only once that copy has finished.

:class:`Staging` is the other mode: the exchange reads and writes the bucket where it is. :func:`staging_for`
chooses between them once, when a transport is bound to its buckets.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import Tensor

from lightning_dp.comm.buckets import GradientBucket


def moves_host_memory_only(backend: str) -> bool:
    """Whether the point-to-point messages of a process group of ``backend`` can read host memory only (gloo)."""
    return backend == "gloo"


class Staging:
    """Exchanges read and write each bucket in place (host buckets, or device buckets under NCCL)."""

    def bind(self, buckets: Sequence[GradientBucket]) -> None:
        """Prepare for ``buckets`` (once, when the transport is bound)."""

    @contextmanager
    def bucket(
        self, bucket: GradientBucket, residual: Tensor | None = None
    ) -> Iterator[tuple[GradientBucket, Tensor | None]]:
        """The bucket (and the codec's ``residual``, the bucket's shape) as the exchange inside the block reads and
        writes them; what the block leaves in them is in ``bucket`` and ``residual`` afterwards."""
        yield bucket, residual

    @contextmanager
    def tensor(self, tensor: Tensor, bucket: GradientBucket) -> Iterator[tuple[Tensor, GradientBucket]]:
        """``tensor`` (1-D, of ``bucket``'s dtype, at most its length) and ``bucket`` (whose memory the exchange may
        use) as an all-reduce inside the block reads and writes them; the result is in ``tensor`` afterwards."""
        yield tensor, bucket


class HostStaging(Staging):
    """Exchanges run on pinned host copies of the buckets (see the module docstring)."""

    def __init__(self) -> None:
        #: per bucket index: the host copy of the bucket, and a second buffer of its size (a residual, or a tensor
        #: a codec all-reduces), allocated on first use
        self._host: dict[int, Tensor] = {}
        self._spare: dict[int, Tensor] = {}
        #: per bucket index: recorded after the last copy back out of its host buffers
        self._copied_back: dict[int, torch.cuda.Event] = {}

    def bind(self, buckets: Sequence[GradientBucket]) -> None:
        self._host = {b.index: _host_buffer_like(b.buffer) for b in buckets}
        self._spare, self._copied_back = {}, {}

    def _buffers(self, bucket: GradientBucket, spare: bool) -> tuple[Tensor, Tensor | None]:
        """The bucket's host buffers, once the last copy out of them has finished (they are about to be written)."""
        copied_back = self._copied_back.pop(bucket.index, None)
        if copied_back is not None:
            copied_back.synchronize()
        if spare and bucket.index not in self._spare:
            self._spare[bucket.index] = _host_buffer_like(bucket.buffer)
        return self._host[bucket.index], self._spare[bucket.index] if spare else None

    @contextmanager
    def bucket(
        self, bucket: GradientBucket, residual: Tensor | None = None
    ) -> Iterator[tuple[GradientBucket, Tensor | None]]:
        host, spare = self._buffers(bucket, spare=residual is not None)
        on_stream = _on_stream(bucket.buffer)
        host.copy_(bucket.buffer, non_blocking=on_stream)
        staged_residual = None
        if residual is not None:
            assert spare is not None
            if residual.numel() != bucket.buffer.numel():
                raise ValueError(f"a residual of {residual.numel()} elements for a bucket of {bucket.buffer.numel()}")
            staged_residual = spare.view_as(residual)
            staged_residual.copy_(residual, non_blocking=on_stream)
        _wait_for_copies(bucket.buffer.device)
        yield bucket.mirrored(host), staged_residual
        bucket.buffer.copy_(host, non_blocking=on_stream)
        if residual is not None:
            assert staged_residual is not None
            residual.copy_(staged_residual, non_blocking=on_stream)
        self._record_copy_back(bucket)

    @contextmanager
    def tensor(self, tensor: Tensor, bucket: GradientBucket) -> Iterator[tuple[Tensor, GradientBucket]]:
        if tensor.dim() != 1 or tensor.numel() > bucket.buffer.numel() or tensor.dtype != bucket.buffer.dtype:
            raise ValueError(
                f"a staged all-reduce takes a 1-D {bucket.buffer.dtype} tensor of at most {bucket.buffer.numel()} "
                f"elements (its bucket's), got {tuple(tensor.shape)} {tensor.dtype}"
            )
        host, spare = self._buffers(bucket, spare=True)
        assert spare is not None
        staged = spare[: tensor.numel()]
        staged.copy_(tensor, non_blocking=_on_stream(tensor))
        _wait_for_copies(tensor.device)
        yield staged, bucket.mirrored(host)
        tensor.copy_(staged, non_blocking=_on_stream(tensor))
        self._record_copy_back(bucket)

    def _record_copy_back(self, bucket: GradientBucket) -> None:
        device = bucket.buffer.device
        if device.type == "cuda":
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
            self._copied_back[bucket.index] = event


def staging_for(backend: str, buckets: Sequence[GradientBucket]) -> Staging:
    """:class:`HostStaging` where a group of ``backend`` moves host memory only and a bucket lives on a device,
    otherwise :class:`Staging`."""
    on_device = any(b.buffer.device.type != "cpu" for b in buckets)
    return HostStaging() if on_device and moves_host_memory_only(backend) else Staging()


def _on_stream(tensor: Tensor) -> bool:
    """Whether copies of ``tensor`` to and from the host run asynchronously on a CUDA stream (ordered by the events
    here); on any other device they are blocking."""
    return tensor.device.type == "cuda"


def _host_buffer_like(tensor: Tensor) -> Tensor:
    """A host buffer of ``tensor``'s shape and dtype, pinned when ``tensor`` is on a CUDA device (copies between
    them then run asynchronously on a stream)."""
    return torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=tensor.device.type == "cuda")


def _wait_for_copies(device: torch.device) -> None:
    """Block the host until the work queued so far on ``device``'s current stream (the copies just issued) is done."""
    if device.type == "cuda":
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        event.synchronize()
