"""Flat gradient buckets filled during backward and reduced on a background thread.

Gradients are produced in roughly the reverse order of parameter registration, so buckets are formed in that
order: the first bucket fills first and its communication starts while backward is still computing the rest.
Each bucket is handed to the communication thread as soon as all of its gradients have arrived, strictly in
bucket order, so every rank issues the same messages in the same order whatever the autograd schedule.

A bucket ends with one "used" flag per parameter. A parameter that produced no gradient on a rank contributes
zeros and a 0 flag; after the reduction a flag of 0 means no rank used the parameter, and its ``.grad`` stays
``None``, exactly as in single-process training. Under the ring and the central server the flags ride inside
the bucket's own messages.

A parameter's gradient can be accumulated more than once in one backward: reentrant activation checkpointing
runs a nested backward per checkpointed segment, and a weight used in two segments gets two accumulations. The
reducer learns, on the first synchronized backward (during which no bucket leaves before backward ends), how
many accumulations each parameter receives, and afterwards hands a bucket over only once every parameter in it
has received them all.

On CUDA the gradients are copied into the buckets on the stream that produced them; the communication thread runs
on the rank's device and a stream of its own, behind one event per producing stream, and the caller's stream waits
for the reduced buckets before anything reads them (the ordering DDP's reducer uses; see
:mod:`lightning_dp.comm.execution`).
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager

import torch
from torch import Tensor
from torch.nn import Parameter

from lightning_dp.comm.errors import SparseGradientError, UnsupportedChangeError
from lightning_dp.comm.execution import execution_for

#: the first bucket is small, as in DistributedDataParallel, so communication starts early in backward
FIRST_BUCKET_CAP_BYTES = 1024 * 1024


def assign_buckets(
    params: Sequence[Tensor], bucket_cap_bytes: int, first_bucket_cap_bytes: int = FIRST_BUCKET_CAP_BYTES
) -> list[list[int]]:
    """Group parameter indices into buckets of at most ``bucket_cap_bytes`` (a larger tensor gets its own bucket).

    Parameters are taken in reverse order (the order backward produces their gradients). The first bucket is
    capped at ``min(first_bucket_cap_bytes, bucket_cap_bytes)``. A bucket holds one dtype on one device.
    """
    buckets: list[list[int]] = []
    current: list[int] = []
    current_bytes = 0
    current_kind = None
    for index in reversed(range(len(params))):
        p = params[index]
        kind = (p.dtype, p.device)
        size = p.numel() * p.element_size()
        cap = min(first_bucket_cap_bytes, bucket_cap_bytes) if not buckets else bucket_cap_bytes
        if current and (kind != current_kind or current_bytes + size > cap):
            buckets.append(current)
            current, current_bytes = [], 0
        current.append(index)
        current_bytes += size
        current_kind = kind
    if current:
        buckets.append(current)
    return buckets


class GradientBucket:
    """One flat buffer: the gradients of ``params`` back to back, then one used-flag per parameter."""

    def __init__(self, index: int, params: list[Parameter]) -> None:
        self.index = index
        self.params = params
        self.slices: list[tuple[int, int]] = []
        offset = 0
        for p in params:
            self.slices.append((offset, offset + p.numel()))
            offset += p.numel()
        self.grad_numel = offset
        self.buffer = torch.zeros(offset + len(params), dtype=params[0].dtype, device=params[0].device)
        self.flags = self.buffer[offset:]
        self.ready = [False] * len(params)
        self.num_ready = 0
        #: this rank's own use of each parameter, as :meth:`fill` last wrote its flag (a host copy: reading the flags
        #: back from a device would wait for it)
        self.used = [False] * len(params)
        #: handed to the communication thread in this round (its contents may no longer change)
        self.launched = False
        #: CUDA: the streams that copied gradients into the bucket this round (by stream id)
        self.streams: dict[int, torch.cuda.Stream] = {}
        #: CUDA: recorded by :meth:`seal` on each of :attr:`streams`; the communication stream waits for them
        self.events: list[torch.cuda.Event] = []

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    def grad_view(self, i: int) -> Tensor:
        start, end = self.slices[i]
        return self.buffer[start:end].view_as(self.params[i])

    def relocate(self, buffer: Tensor) -> None:
        """Move the bucket into ``buffer`` (same length and dtype; e.g. shared memory), keeping its contents."""
        if buffer.shape != self.buffer.shape or buffer.dtype != self.buffer.dtype:
            raise ValueError(f"a bucket of {self.buffer.numel()} {self.buffer.dtype} cannot move into {buffer.shape}")
        buffer.copy_(self.buffer)
        self.buffer = buffer
        self.flags = buffer[self.grad_numel :]

    def mirrored(self, buffer: Tensor) -> GradientBucket:
        """This bucket's layout (index, parameters, slices, flags) over ``buffer`` instead of its own buffer (same
        length and dtype, e.g. a host copy of a device bucket); this bucket is left as it is."""
        if buffer.shape != self.buffer.shape or buffer.dtype != self.buffer.dtype:
            raise ValueError(f"a bucket of {self.buffer.numel()} {self.buffer.dtype} cannot mirror into {buffer.shape}")
        mirror = copy.copy(self)
        mirror.buffer = buffer
        mirror.flags = buffer[self.grad_numel :]
        return mirror

    def holds(self, i: int, grad: Tensor) -> bool:
        """Whether ``grad`` is parameter ``i``'s view into this bucket (a gradient that lives in the bucket)."""
        if grad.layout != torch.strided:
            return False
        view = self.grad_view(i)
        return grad.data_ptr() == view.data_ptr() and grad.shape == view.shape and grad.stride() == view.stride()

    def fill(self, i: int, grad: Tensor | None) -> None:
        """Copy parameter ``i``'s gradient in (zeros and a 0 flag when it has none); copying again overwrites.
        A gradient that already lives in the bucket (:meth:`holds`) is not copied."""
        view = self.grad_view(i)
        self.used[i] = grad is not None
        flag = self.flags[i : i + 1]  # filled in place: `flags[i] = 1` would copy a host number to the device and wait
        if grad is None:
            view.zero_()
            flag.zero_()
        else:
            if grad.is_sparse:
                raise SparseGradientError(
                    f"a parameter of shape {tuple(grad.shape)} produced a sparse gradient (e.g. nn.Embedding("
                    "sparse=True)); lightning-dp's buckets carry dense gradients only: use sparse=False, or "
                    "strategy='ddp' for sparse gradients"
                )
            if not self.holds(i, grad):
                view.copy_(grad)
            flag.fill_(1)
        if view.is_cuda:
            stream = torch.cuda.current_stream(view.device)
            self.streams.setdefault(stream.stream_id, stream)

    def seal(self) -> None:
        """The bucket is complete: record one event on each stream that wrote into it (after its last copy)."""
        self.events = []
        for stream in self.streams.values():
            event = torch.cuda.Event()
            event.record(stream)
            self.events.append(event)

    def mark_ready(self, i: int) -> None:
        if not self.ready[i]:
            self.ready[i] = True
            self.num_ready += 1

    def pack_params(self, start: int = 0, end: int | None = None) -> None:
        """Copy the parameters' current values into elements ``[start, end)`` of the gradient region."""
        end = self.grad_numel if end is None else end
        self.read_params(start, end, self.buffer[start:end])

    def read_params(self, start: int, end: int, out: Tensor) -> Tensor:
        """Copy the parameters' values at elements ``[start, end)`` of the gradient region into ``out`` (1-D, of
        length ``end - start``) and return it."""
        for p, (lo, hi) in zip(self.params, self.slices):
            a, b = max(lo, start), min(hi, end)
            if a < b:
                out[a - start : b - start].copy_(p.detach().reshape(-1)[a - lo : b - lo])
        return out

    def write_params(self, start: int, end: int, values: Tensor) -> None:
        """Overwrite the parameters' values at elements ``[start, end)`` of the gradient region with ``values``."""
        with torch.no_grad():
            for p, (lo, hi) in zip(self.params, self.slices):
                a, b = max(lo, start), min(hi, end)
                if a < b:
                    flat = p.view(-1) if p.is_contiguous() else p.detach().reshape(-1).clone()
                    flat[a - lo : b - lo].copy_(values[a - start : b - start])
                    if not p.is_contiguous():
                        p.copy_(flat.view_as(p))

    def unpack_params(self, keep: tuple[int, int] | None = None) -> None:
        """Overwrite every parameter with its values from the gradient region (after weights were pulled), except
        elements ``keep = (start, end)``, which the parameters already hold (an owner's own updated weights)."""
        if keep is not None and keep[0] < keep[1]:
            start, end = keep
            self.write_params(0, start, self.buffer[:start])
            self.write_params(end, self.grad_numel, self.buffer[end : self.grad_numel])
            return
        with torch.no_grad():
            for i, p in enumerate(self.params):
                p.copy_(self.grad_view(i))

    @property
    def complete(self) -> bool:
        return self.num_ready == len(self.params)

    def reset(self) -> None:
        self.ready = [False] * len(self.params)
        self.num_ready = 0
        self.launched = False
        self.streams = {}
        self.events = []


def read_used(buckets: Sequence[GradientBucket]) -> dict[int, list[bool]]:
    """Per bucket index, whether each parameter's flag is non-zero (after a reduction: whether any rank used it), read
    from every bucket at once: on a device, one synchronization for them all."""
    if not buckets:
        return {}
    flags = torch.cat([b.flags for b in buckets]) != 0
    # sync: whether a parameter gets a gradient at all (param.grad = None) is decided on the host, once per step
    used = flags.tolist()
    result, offset = {}, 0
    for bucket in buckets:
        result[bucket.index] = used[offset : offset + len(bucket.params)]
        offset += len(bucket.params)
    return result


class BucketReducer:
    """Reduces the gradients of ``params`` bucket by bucket while backward runs.

    ``reduce_bucket(bucket)`` runs on one background thread, in bucket order, and must leave in
    ``bucket.buffer`` the reduced values every rank should use (or do whatever the synchronization scheme
    needs with them). Call :meth:`finish` after backward: it flushes buckets whose gradients never arrived,
    waits for all communication, and writes the reduced gradients into ``param.grad`` when ``copy_back``.
    Inside :meth:`no_sync` (gradient accumulation) the hooks do nothing and gradients accumulate locally.

    With ``gradient_as_bucket_view`` (as in ``DistributedDataParallel``) each ``param.grad`` becomes a view into its
    bucket once its gradient was copied in, and :meth:`copy_back` writes nothing: later backwards accumulate in
    the bucket and the averaged values are the gradients. Only for schemes that keep nothing but gradients in the
    buckets, and only for contiguous parameters (others keep a gradient of their own).

    With ``overlap`` buckets leave while backward runs; without it (or after :meth:`stop_overlap`) they all leave
    at :meth:`finish`, after every collective that backward itself issues (SyncBatchNorm's, an all_gather with
    gradients) on another NCCL communicator, so that no two ranks interleave the two communicators differently.
    """

    def __init__(
        self,
        params: Iterable[Parameter],
        reduce_bucket: Callable[[GradientBucket], None],
        bucket_cap_mb: float = 25.0,
        overlap: bool = True,
        gradient_as_bucket_view: bool = False,
        device: torch.device | None = None,
    ) -> None:
        unique: dict[int, Parameter] = {}
        for p in params:
            if p.requires_grad:
                unique.setdefault(id(p), p)
        self.params = list(unique.values())
        self.reduce_bucket = reduce_bucket
        self.bucket_cap_bytes = max(1, int(bucket_cap_mb * 1024 * 1024))
        self.buckets = [
            GradientBucket(i, [self.params[j] for j in indices])
            for i, indices in enumerate(assign_buckets(self.params, self.bucket_cap_bytes))
        ]
        self._location = {id(p): (b, i) for b in self.buckets for i, p in enumerate(b.params)}
        self._enabled = True
        self._overlap = overlap
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self._fresh = False
        #: accumulations of each parameter's gradient in the current backward, and how many a complete backward
        #: brings (learned on the first synchronized backward; ``None`` until then)
        self._accumulations = {id(p): 0 for p in self.params}
        self._expected: dict[int, int] | None = None
        self._next_launch = 0
        self._futures: list[Future] = []
        self._lock = threading.Lock()
        if device is None:
            device = self.params[0].device if self.params else torch.device("cpu")
        #: where the exchanges run and how they are timed (the buckets' device; see :mod:`~.execution`)
        self.execution = execution_for(device)
        self._executor = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="lightning-dp-comm", initializer=self.execution.thread_started
        )
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in self.params]

    @property
    def enabled(self) -> bool:
        """Whether backward synchronizes (false inside :meth:`no_sync`)."""
        return self._enabled

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally (no communication) inside this context."""
        previous, self._enabled = self._enabled, False
        try:
            yield
        finally:
            self._enabled = previous

    @property
    def overlap(self) -> bool:
        """Whether buckets leave while backward runs (see the class docstring)."""
        return self._overlap

    def stop_overlap(self) -> None:
        """From now on every bucket leaves at :meth:`finish`."""
        self._overlap = False

    @property
    def fresh(self) -> bool:
        """Whether the buckets hold reduced values no one consumed yet (from a successful :meth:`finish` on)."""
        return self._fresh

    def consume(self) -> bool:
        """Take the reduced buckets (a scheme that reads them as gradients, once): returns :attr:`fresh` and clears
        it, so that a step without a new backward reads nothing stale."""
        fresh, self._fresh = self._fresh, False
        return fresh

    def _on_grad_ready(self, param: Parameter) -> None:
        if not self._enabled:
            return
        key = id(param)
        bucket, i = self._location[key]
        self._accumulations[key] += 1
        if bucket.launched:
            raise UnsupportedChangeError(
                f"the gradient of a parameter of shape {tuple(param.shape)} was accumulated more often in this "
                "backward than in the first synchronized one, after its bucket had already been sent. Either "
                "backward ran outside the strategy (in manual optimization call self.manual_backward(loss), not "
                "loss.backward()), or reentrant activation checkpointing reuses the parameter in a number of "
                "segments that changes from step to step (use torch.utils.checkpoint.checkpoint(..., "
                "use_reentrant=False))"
            )
        bucket.fill(i, param.grad)
        if self.gradient_as_bucket_view and param.grad is not None and param.is_contiguous():
            param.grad = bucket.grad_view(i)
        if self._expected is not None and self._accumulations[key] >= self._expected[key]:
            bucket.mark_ready(i)
            if self._overlap and bucket.complete:
                self._launch_ready_buckets()

    def _launch_ready_buckets(self) -> None:
        with self._lock:
            while self._next_launch < len(self.buckets) and self.buckets[self._next_launch].complete:
                bucket = self.buckets[self._next_launch]
                bucket.launched = True
                bucket.seal()
                self._futures.append(self._executor.submit(self._timed_reduce, bucket))
                self._next_launch += 1

    def _timed_reduce(self, bucket: GradientBucket) -> None:
        self.execution.run(self.reduce_bucket, bucket)

    def post(self, exchange: Callable[[GradientBucket], None], bucket: GradientBucket) -> Future:
        """Run ``exchange(bucket)`` on the communication thread, after every exchange posted before it, timed like the
        gradients' (the servers' weight pull). On CUDA it waits for the work the caller's stream has queued so far;
        :meth:`wait` makes the caller's stream wait for it in turn."""
        if bucket.buffer.is_cuda:
            stream = torch.cuda.current_stream(bucket.buffer.device)
            bucket.streams = {stream.stream_id: stream}
            bucket.seal()
        return self._executor.submit(self.execution.run, exchange, bucket)

    def wait(self, future: Future) -> None:
        """Wait for an exchange :meth:`post` returned (re-raising its error); the time it then still ran is exposed."""
        self.execution.begin_wait()
        try:
            future.result()
        finally:
            self.execution.end_wait()
        self.execution.join()

    def take_timing(self) -> tuple[float, float, float]:
        """``(communication seconds, seconds of them backward's caller waited for, seconds the exchanges waited for
        slower peers)`` since the last call; resets them. On a CUDA device the first two are the device's time, as
        far as its events completed, and the peers' wait is inside the exchanges (see :mod:`~.execution`)."""
        return self.execution.take_timing()

    def finish(self, copy_back: bool = True) -> None:
        """Complete this round of synchronization (see class docstring). Re-raises any communication error."""
        for bucket in self.buckets:
            for i, p in enumerate(bucket.params):
                if not bucket.ready[i]:
                    # no (or not every) gradient this backward; an accumulated one from earlier micro-batches counts
                    bucket.fill(i, p.grad)
                    bucket.mark_ready(i)
        self._launch_ready_buckets()
        self.execution.begin_wait()
        self._fresh = False
        try:
            for future in self._futures:
                future.result()
        except BaseException:
            for future in self._futures:  # do not leave later buckets queued behind a failed exchange
                future.cancel()
            raise
        finally:
            self.execution.end_wait()
            self._futures.clear()
            self._next_launch = 0
            for bucket in self.buckets:
                bucket.reset()
            self._learn_accumulations()
        self.execution.join()
        self._fresh = True
        if copy_back:
            self.copy_back()

    def abandon(self) -> None:
        """Give up this round (its exchanges failed, or must not complete): cancel what has not started, wait until
        the communication thread has ended what has (with its own error, dropped here), and reset the buckets as
        :meth:`finish` does, their contents left as the exchanges left them."""
        for future in self._futures:
            future.cancel()
        self._executor.submit(lambda: None).result()
        self._futures.clear()
        self._next_launch = 0
        self._fresh = False
        for bucket in self.buckets:
            bucket.reset()
        self._learn_accumulations()

    def resend(self, copy_back: bool = True) -> None:
        """Exchange every bucket again as it holds now (its contents restored after a failed :meth:`finish`), and
        complete the round as :meth:`finish` does."""
        for bucket in self.buckets:
            bucket.ready = [True] * len(bucket.params)
            bucket.num_ready = len(bucket.params)
        self.finish(copy_back)

    def _learn_accumulations(self) -> None:
        counts = self._accumulations
        if self._expected is None:
            self._expected = {k: max(1, n) for k, n in counts.items()}
        else:  # more accumulations than learned, caught before the bucket left: expect them from now on
            for k, n in counts.items():
                self._expected[k] = max(self._expected[k], n)
        self._accumulations = dict.fromkeys(counts, 0)

    def copy_back(self) -> None:
        """Write each bucket's reduced gradients into ``param.grad``; parameters no rank used keep ``None``."""
        used_in = read_used(self.buckets)
        for bucket in self.buckets:
            used = used_in[bucket.index]
            for i, p in enumerate(bucket.params):
                if not used[i]:
                    p.grad = None
                elif p.grad is None:
                    view = bucket.grad_view(i)
                    p.grad = view if self.gradient_as_bucket_view and p.is_contiguous() else view.clone()
                elif not bucket.holds(i, p.grad):
                    p.grad.copy_(bucket.grad_view(i))

    def close(self) -> None:
        """Remove the hooks and stop the communication thread; gradients that were views into a bucket become
        tensors of their own (the buckets, possibly shared memory, are released with the reducer)."""
        for bucket in self.buckets:
            for i, p in enumerate(bucket.params):
                if p.grad is not None and bucket.holds(i, p.grad):
                    p.grad = p.grad.clone()
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        # an exchange still running after a failure ends on its own (peer error or timeout); do not wait for it
        self._executor.shutdown(wait=False, cancel_futures=True)
