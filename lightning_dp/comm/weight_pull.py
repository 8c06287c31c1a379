"""The servers' weight pull: how the weights updated by their owners reach every rank after a step.

Two modes, chosen once when the exchange is set up:

- :class:`BlockingPull`: every bucket's weights travel before the optimizer step returns, as a plain parameter
  server does; nothing is in flight between steps.
- :class:`OverlappedPull`: the step only posts each bucket's pull on the communication thread, in the order the
  next forward uses the parameters, and returns; the thread writes each bucket's weights into the parameters once
  they arrived. A forward pre-hook on every module that holds trainable parameters waits for the buckets holding
  that module's own parameters just before its forward runs, so layer ``k``'s forward overlaps the pull of the
  layers after it. Every forward reads exactly the weights after the step: a module reads its parameters only
  after their buckets were written. Whatever else reads the weights between steps calls
  :meth:`BlockingPull.complete` first.

A parameter is current from the start of the forward of any module it is registered on. A parameter read before
that (a module reading another module's weight functionally before that module's forward ran) would see the
weights of the step before: :class:`ReadProbe` watches the first synchronized forward for such reads, and the
strategy then runs the pull blocking for the rest of the fit.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from typing import Any

from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from lightning_dp.comm.buckets import BucketReducer, GradientBucket
from lightning_dp.comm.stats import CommStats

#: ``exchange(bucket)``: the owners' packed weights of ``bucket`` reach every rank's copy of the bucket
Exchange = Callable[[GradientBucket], None]


class BlockingPull:
    """The pull runs in :meth:`post`: every rank holds the new weights when it returns.

    ``exchange`` moves one bucket's weights, ``unpack(bucket)`` writes them into the parameters where this rank
    must take them, ``reducer`` times the communication (all of it exposed)."""

    overlapped = False

    def __init__(self, exchange: Exchange, unpack: Callable[[GradientBucket], None], reducer: BucketReducer) -> None:
        self.exchange = exchange
        self.unpack = unpack
        self.reducer = reducer
        #: seconds the training loop spent in the pull (blocking: all of it; overlapped: waiting for it)
        self.waited_seconds = 0.0

    def post(self, buckets: Sequence[GradientBucket]) -> None:
        """The owners' new weights of ``buckets`` reach every rank (collective: every rank posts the same buckets)."""
        start = time.perf_counter()
        with self.reducer.execution.blocking():  # on a GPU, the device's time: NCCL returns before it is done
            for bucket in buckets:
                self.exchange(bucket)
                self.unpack(bucket)
        self.waited_seconds += time.perf_counter() - start

    @property
    def pending(self) -> int:
        """Buckets posted whose weights are not in the parameters yet."""
        return 0

    def complete(self) -> None:
        """Every posted bucket's weights are in the parameters."""

    def discard(self) -> None:
        """The run failed: forget what is in flight without waiting for it (it ends with the communication thread)."""

    def close(self) -> None:
        """Remove what the mode installed on the model."""


class OverlappedPull(BlockingPull):
    """The pull of a step overlaps the next forward (see the module docstring).

    ``module``: the model whose modules get the forward pre-hooks. ``needs_unpack(bucket)``: whether this rank
    takes the bucket's weights from the exchange (a rank that owns the whole bucket already holds them, so its
    forward never waits for it). ``stats``: the counter the exchanges add their bytes to; the bytes of a step's pull
    are booked to that step when it is posted (the same bytes every step, measured on the first, whose pull
    :meth:`post` therefore waits for), so a step's bytes are the same as with :class:`BlockingPull`."""

    overlapped = True

    def __init__(
        self,
        exchange: Exchange,
        unpack: Callable[[GradientBucket], None],
        reducer: BucketReducer,
        module: nn.Module,
        needs_unpack: Callable[[GradientBucket], bool],
        stats: CommStats | None = None,
    ) -> None:
        super().__init__(exchange, unpack, reducer)
        self.stats = stats if stats is not None else CommStats()
        #: ``(sent, received)`` bytes of each bucket's last pull, by bucket index (written by the communication thread)
        self.bucket_bytes: dict[int, tuple[int, int]] = {}
        self.buckets = reducer.buckets
        self._needs_unpack = {b.index: needs_unpack(b) for b in self.buckets}
        #: the index of the bucket holding each synchronized parameter, by ``id``
        self.bucket_of = {id(p): b.index for b in self.buckets for p in b.params}
        #: posted buckets by index, in the order they were posted
        self._in_flight: dict[int, Future] = {}
        #: bucket indices in the order this rank's training forwards first asked for them (until :meth:`agree_order`)
        self.forward_order: list[int] = []
        self._order_learned = False
        #: the order every rank posts the pulls in (the same on every rank: the pulls are collective)
        self.post_order: list[int] = [b.index for b in reversed(self.buckets)]
        #: buckets whose weights a forward pre-hook waited for, and those :meth:`complete` took (counters)
        self.waited_in_forward = 0
        self.completed_late = 0
        #: every module that holds synchronized parameters itself, with the buckets holding them
        self.holders = [(sub, indices) for sub in module.modules()
                        if (indices := self.buckets_holding(sub.parameters(recurse=False)))]  # fmt: skip
        self._hooks = [sub.register_forward_pre_hook(self._pre_forward_hook(indices)) for sub, indices in self.holders]

    def buckets_holding(self, params: Iterable[Tensor]) -> list[int]:
        """Indices of the buckets that hold any of ``params`` (parameters no bucket holds, frozen ones, have none)."""
        return sorted({self.bucket_of[id(p)] for p in params if id(p) in self.bucket_of})

    def _pre_forward_hook(self, indices: list[int]) -> Callable[..., None]:
        def wait_for_own_weights(module: nn.Module, args: Any) -> None:
            self.wait_for(indices, learn=module.training)

        return wait_for_own_weights

    def agree_order(self, order: Sequence[int]) -> None:
        """Post from now on in ``order`` (one rank's :attr:`forward_order`, the same on every rank): the buckets the
        next forward uses first go first; buckets it never asked for last, in reverse bucket order (the order of
        registration, which a forward usually follows)."""
        self._order_learned = True
        seen = set(order)
        self.post_order = [*order, *(b.index for b in reversed(self.buckets) if b.index not in seen)]

    def post(self, buckets: Sequence[GradientBucket]) -> None:
        self.complete()  # a second optimizer's step: its buckets may be the first one's
        posted = {b.index for b in buckets}
        for index in self.post_order:
            if index in posted:
                self._in_flight[index] = self.reducer.post(self._counted_exchange, self.buckets[index])
        if not posted <= self.bucket_bytes.keys():
            self.complete()  # the first pull of these buckets: its bytes are known once it ran
        self.stats.add(sum(self.bucket_bytes[i][0] for i in posted), sum(self.bucket_bytes[i][1] for i in posted))

    def _counted_exchange(self, bucket: GradientBucket) -> None:
        """On the communication thread: the exchange, its bytes counted apart, then the weights into the parameters
        (no forward reads them before :meth:`wait_for` returned, nothing else before :meth:`complete`)."""
        counted = CommStats()
        with self.stats.diverted(counted):
            self.exchange(bucket)
        self.bucket_bytes[bucket.index] = (counted.bytes_sent, counted.bytes_received)
        if self._needs_unpack[bucket.index]:
            self.unpack(bucket)

    @property
    def pending(self) -> int:
        return len(self._in_flight)

    def wait_for(self, indices: Iterable[int], learn: bool = True) -> None:
        """The weights of buckets ``indices`` are in the parameters (a forward is about to read them). ``learn``: a
        training forward asks, whose order the pulls should follow (see :meth:`agree_order`)."""
        for index in indices:
            if learn and not self._order_learned and index not in self.forward_order:
                self.forward_order.append(index)
            future = self._in_flight.pop(index, None)
            if future is None:
                continue
            if self._needs_unpack[index]:
                self.waited_in_forward += 1
                self._take(self.buckets[index], future)
            else:  # this rank holds the weights already; the exchange only has to end before the buckets are reused
                self._in_flight[index] = future

    def complete(self) -> None:
        while self._in_flight:
            index = next(iter(self._in_flight))
            future = self._in_flight.pop(index)
            self.completed_late += int(self._needs_unpack[index])
            self._take(self.buckets[index], future)

    def _take(self, bucket: GradientBucket, future: Future) -> None:
        start = time.perf_counter()
        try:
            self.reducer.wait(future)
        except BaseException:
            self.discard()
            raise
        self.waited_seconds += time.perf_counter() - start

    def discard(self) -> None:
        for future in self._in_flight.values():
            future.cancel()
        self._in_flight.clear()

    def close(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()


class ReadProbe(TorchFunctionMode):
    """Watches a forward for reads of a synchronized parameter before any module it is registered on started its
    forward: under :class:`OverlappedPull` such a read would see the weights of the step before.

    Enter it around one forward (the first synchronized one, when nothing is in flight);
    :attr:`early_reads` then names the parameters read early (``names``: parameter names by ``id``)."""

    def __init__(self, pull: OverlappedPull, names: dict[int, str]) -> None:
        super().__init__()
        self.pull = pull
        self.names = names
        self.current: set[int] = set()
        self.early_reads: list[str] = []
        #: whether a forward ran under the probe (then :attr:`early_reads` is its finding)
        self.watched = False
        self._hooks: list[Any] = []

    def __enter__(self) -> ReadProbe:
        self.current = set()
        self.early_reads = []
        self._hooks = [module.register_forward_pre_hook(self._mark_current(indices))
                       for module, indices in self.pull.holders]  # fmt: skip
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        self.watched = True

    def _mark_current(self, indices: list[int]) -> Callable[..., None]:
        def mark(module: nn.Module, args: Any) -> None:
            self.current.update(indices)

        return mark

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        for value in tree_flatten((args, kwargs))[0]:
            if isinstance(value, nn.Parameter):
                index = self.pull.bucket_of.get(id(value))
                if index is not None and index not in self.current:
                    name = self.names.get(id(value), f"a parameter of shape {tuple(value.shape)}")
                    if name not in self.early_reads:
                        self.early_reads.append(name)
        return func(*args, **kwargs)
