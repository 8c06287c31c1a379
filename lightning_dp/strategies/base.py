"""The data-parallel base every lightning-dp strategy builds on.

:class:`DataParallelStrategy` keeps DDP's process handling (:class:`~.processes.ProcessGroupStrategy`) but never
wraps the module in ``DistributedDataParallel``: a :class:`~lightning_dp.comm.buckets.BucketReducer` collects
gradients into flat buckets during backward and hands each full bucket to the scheme's codec and transport
(:mod:`lightning_dp.comm.codecs`, :mod:`lightning_dp.comm.transports`) on a communication thread. As under DDP,
synchronization completes inside the strategy's ``backward``, before ``on_after_backward``: every gradient hook
and callback sees (and may edit) the averaged gradients.

A subclass provides :meth:`_make_transport`; a scheme whose servers run the optimizer builds on
:class:`~.parameter_server_base.ParameterServerBase` instead.
"""

from __future__ import annotations

import functools
import time
import warnings
from collections.abc import Callable, Generator, Iterable, Mapping
from contextlib import contextmanager
from typing import Any, ClassVar, Literal

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from typing_extensions import override

from lightning_dp._lightning_compat import _optimizers_to_device, trainer_of, unwrap_optimizer, wrap_closure_of
from lightning_dp.comm.buckets import BucketReducer, GradientBucket
from lightning_dp.comm.cluster.fingerprint import check_replicas_match
from lightning_dp.comm.codecs import CODEC_NAMES, Codec
from lightning_dp.comm.cost import Scheme, Wire, rank_traffic
from lightning_dp.comm.errors import UnsupportedChangeError
from lightning_dp.comm.nonfinite import first_nonfinite
from lightning_dp.comm.stats import SyncStats, fastest_run
from lightning_dp.comm.transports import Transport
from lightning_dp.comm.transports.broadcast import broadcast_tensors
from lightning_dp.comm.transports.shards import any_rank
from lightning_dp.comm.transports.shm import WAITS, NodeLayout, SharedMemoryUnavailable
from lightning_dp.strategies.balance import BALANCE, CHECKPOINT_KEY, EqualBatches, make_batches
from lightning_dp.strategies.codec_state import (
    choose_codec,
    gather_codec_states,
    load_codec_state,
    with_codec_states,
)
from lightning_dp.strategies.inspection import nonfinite_gradient_error, refuse_sparse_gradients
from lightning_dp.strategies.options import (
    check_choice,
    check_count,
    check_flag,
    check_known_options,
    check_positive,
    constructor_options,
)
from lightning_dp.strategies.processes import ProcessGroupStrategy

#: values of the ``intra_node`` option
INTRA_NODE = ("shm", "ring")


class DataParallelStrategy(ProcessGroupStrategy):
    """Multi-process data parallelism with a hand-written gradient synchronization scheme.

    Args:
        bucket_cap_mb: size of a gradient bucket in MiB; smaller buckets start communicating earlier in backward.
        broadcast_buffers: copy rank 0's buffers (e.g. BatchNorm running stats) to every rank before each
            synchronized training step, as ``DistributedDataParallel`` does.
        intra_node: how the ranks of one machine exchange buckets: ``"shm"`` (default) through a shared-memory
            segment, at memory speed (CPU tensors only: GPUs keep their socket or NCCL transport; where the ranks
            of a node cannot share memory the strategy warns and uses sockets), or ``"ring"``: through the process
            group's sockets, as across machines. Across machines ``"shm"`` makes the ring all-reduce hierarchical
            (see :class:`~lightning_dp.comm.transports.SharedMemoryTransport`); the parameter servers use shared
            memory on a single machine only.
        shm_wait: how a rank waits for the others of its machine in the shared-memory exchange: ``"auto"``
            (default: ``"spin"`` where the machine's ranks do not outnumber the cores they may run on together, by
            their CPU affinities and the cgroup's CPU quota, else ``"sleep"``), ``"spin"`` (poll for 200 µs, then
            sleep) or ``"sleep"`` (sleep in the kernel at once, leaving the core to a peer that has work).
        compression: how buckets travel over the network (:mod:`lightning_dp.comm.codecs`): ``"none"`` (default),
            ``"fp16"`` / ``"bf16"`` (16 bits per element, both directions) or ``"powersgd"`` (low-rank factors of
            the gradients; weights travel uncompressed). Applies where buckets cross a network: ranks on one
            machine that exchange through shared memory (``intra_node="shm"``) send nothing to compress, and run
            uncompressed (the strategy says so at set-up). Needs float32 gradients.
        error_feedback: keep what compression lost on this rank and add it to the next step's gradients.
        powersgd_rank: the rank ``r`` of PowerSGD's factors.
        powersgd_warmup_steps: synchronizations that run uncompressed before PowerSGD starts.
        balance: how the global batch is split among the ranks (:mod:`~lightning_dp.strategies.balance`):
            ``"none"`` (default): equal batches, as under ``ddp``; ``"throughput"``: each rank's share of the global
            batch (``N`` times the loader's ``batch_size``) follows its measured speed, so a persistently slower rank
            trains fewer samples per step, and each rank's gradient is weighted by its share, so every step is the
            step of the whole global batch (see :mod:`lightning_dp.comm.balance`). Needs a loader with Lightning's
            distributed sampler and a loss that is the mean over the batch.
        balance_interval: with ``balance="throughput"``, the training batches measured between two decisions.
        balance_tolerance: with ``balance="throughput"``, the shares change only when the speeds measured would make
            the step shorter by more than this fraction.
        **kwargs: ``process_group_backend``, ``timeout``, ``start_method`` and Lightning's ``accelerator``,
            ``parallel_devices``, ``cluster_environment``, ``checkpoint_io``, ``precision_plugin`` (see
            :class:`~.processes.ProcessGroupStrategy`).
    """

    #: whether every rank holds the averaged gradients and steps its own optimizer (then it checks them for NaN/inf
    #: itself; the parameter servers vote instead)
    _every_rank_steps: ClassVar[bool] = True
    #: whether ``param.grad`` may be a view into its bucket (only where the buckets never carry anything else)
    _gradient_as_bucket_view: ClassVar[bool] = False

    def __init__(
        self,
        bucket_cap_mb: float = 25.0,
        broadcast_buffers: bool = True,
        intra_node: Literal["shm", "ring"] = "shm",
        shm_wait: Literal["auto", "spin", "sleep"] = "auto",
        compression: Literal["none", "fp16", "bf16", "powersgd"] = "none",
        error_feedback: bool = True,
        powersgd_rank: int = 4,
        powersgd_warmup_steps: int = 10,
        balance: Literal["none", "throughput"] = "none",
        balance_interval: int = 5,
        balance_tolerance: float = 0.1,
        **kwargs: Any,
    ) -> None:
        check_known_options(
            f"strategy {self.strategy_name!r}", kwargs, constructor_options(type(self), ProcessGroupStrategy)
        )
        super().__init__(**kwargs)
        self.bucket_cap_mb = check_positive("bucket_cap_mb", bucket_cap_mb)
        self.broadcast_buffers = check_flag("broadcast_buffers", broadcast_buffers)
        self.intra_node = check_choice("intra_node", intra_node, INTRA_NODE)
        self.shm_wait = check_choice("shm_wait", shm_wait, WAITS)
        self.compression = check_choice("compression", compression, CODEC_NAMES)
        self.error_feedback = check_flag("error_feedback", error_feedback)
        self.powersgd_rank = check_count("powersgd_rank", powersgd_rank, 1)
        self.powersgd_warmup_steps = check_count("powersgd_warmup_steps", powersgd_warmup_steps, 0)
        self.balance = check_choice("balance", balance, BALANCE)
        #: the ``balance`` mode: which samples each rank trains and how its gradient counts
        self.batches: EqualBatches = make_batches(self, self.balance, balance_interval, balance_tolerance,
                                                  dealt=self.rank_loss.name == "continue")  # fmt: skip
        self.reducer: BucketReducer | None = None
        self.transport: Transport | None = None
        self.codec = Codec()
        #: bytes moved by the last step, bucket size, seconds of communication (see :class:`SyncStats`)
        self.sync_stats = SyncStats()
        #: whether every rank holds the averaged gradients in ``param.grad`` after backward (always for the ring; for
        #: the parameter servers only when something reads gradients, see
        #: :func:`~lightning_dp.strategies.inspection.gradient_readers`)
        self.full_gradients = True
        self._synced_params: set[int] = set()
        #: undo what set-up changed in the precision plugin (run at teardown)
        self._restore_precision: list[Callable[[], None]] = []
        self.rank_loss.check_options(self)

    # ------------------------------------------------------------------ model set-up
    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:
            self.batches.reset()
            refuse_sparse_gradients(self.model, f"strategy {self.strategy_name!r}")
            self.rank_loss.check_fit(self)
            self.full_gradients = self._needs_full_gradients(trainer)
        if fitting and self._layer_sync:
            self.model = self._layer_sync.apply(self.model)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self.rank_loss.setup_stage(self, self.model)
        model, state = self.model, self._module_state()
        self.rank_loss.setup_collective(self, lambda group: check_replicas_match(model, group))

        def from_first(group: dist.ProcessGroup | None) -> list[Tensor]:
            broadcast_tensors(state, src=0, group=group)
            return state

        # every replica starts from rank 0's parameters and buffers (the lowest rank training now, after a loss)
        taken = self.rank_loss.setup_collective(self, from_first)
        if taken is not state:  # one sync point behind after a loss: the values a member that completed it holds
            with torch.no_grad():
                for mine, theirs in zip(state, taken, strict=True):
                    mine.copy_(theirs)
        if fitting:
            self.setup_optimizers(trainer)
            self._check_optimizers()
            self._setup_gradient_sync()
        self.setup_precision_plugin()
        if fitting:
            self.rank_loss.setup_trainer(self, trainer)
            _optimizers_to_device(self.optimizers, self.root_device)
            if self._every_rank_steps and self._checks_finite_gradients():
                self._restore_precision.append(wrap_closure_of(self.precision_plugin, self._raise_if_nonfinite))

    def _needs_full_gradients(self, trainer: pl.Trainer) -> bool:
        """Whether every rank must hold the averaged gradients in ``param.grad`` after backward."""
        return True

    def _module_state(self) -> list[Tensor]:
        assert self.model is not None
        return [p.data for p in self.model.parameters()] + list(self.model.buffers())

    def _check_optimizers(self) -> None:
        """Refuse optimizers the scheme cannot run (subclasses)."""

    def _make_transport(self, shared_memory: bool) -> Transport:
        """The transport this scheme's buckets travel over (on :attr:`gradient_group`, counting into
        :attr:`sync_stats`); through shared memory inside a node when ``shared_memory`` (see
        :meth:`_shared_memory_kwargs`)."""
        raise NotImplementedError

    def _uses_shared_memory(self) -> bool:
        """Whether the ranks of a node exchange buckets through shared memory: asked for, CPU tensors, and more than
        one rank per node."""
        return self.intra_node == "shm" and self.root_device.type == "cpu" and self.ranks_on_this_node > 1

    def _shared_memory_kwargs(self) -> dict[str, Any]:
        """What a shared-memory transport needs beyond the group and stats: which ranks share a node, the timeout, how
        a rank waits."""
        assert self._timeout is not None
        return {"node_key": self.node_rank, "timeout": self._timeout.total_seconds(), "wait": self.shm_wait,
                "interrupt": self.rank_loss.interrupt}  # fmt: skip

    def _setup_gradient_sync(self) -> None:
        self._close_gradient_sync()
        self.setup_bucket_exchange()

    def setup_bucket_exchange(self) -> None:
        """The reducer, the transport and the codec over the model's buckets."""
        self.reducer = self.new_reducer()
        shared_memory = self._uses_shared_memory()
        self.transport = self._make_transport(shared_memory)
        try:
            self.transport.bind(self.reducer.buckets)
        except SharedMemoryUnavailable as error:  # raised on every rank together
            rank_zero_warn(
                f"strategy {self.strategy_name!r}: the ranks of a node cannot share memory ({error}); their buckets "
                "travel through sockets instead (intra_node='ring')"
            )
            self.transport = self._make_transport(False)
            self.transport.bind(self.reducer.buckets)
        self.codec = self._make_codec(self.transport, self.reducer.buckets)
        self.codec.bind(self.reducer.buckets, self.transport)
        self.mark_synchronized(self.reducer.params)
        self.sync_stats.bucket_bytes = sum(b.nbytes for b in self.reducer.buckets)

    def new_reducer(self) -> BucketReducer:
        """A reducer over the model's trainable parameters whose full buckets go to :meth:`_reduce_bucket`."""
        assert self.model is not None
        return BucketReducer(
            self.model.parameters(), self._reduce_bucket, self.bucket_cap_mb, overlap=self._may_overlap_backward(),
            gradient_as_bucket_view=self._gradient_as_bucket_view, device=self.root_device,
        )  # fmt: skip

    def mark_synchronized(self, params: Iterable[Tensor]) -> None:
        """The parameters this fit synchronizes (see :meth:`check_trainable_unchanged`)."""
        self._synced_params = {id(p) for p in params}

    def _make_codec(self, transport: Transport, buckets: list[GradientBucket]) -> Codec:
        """The ``compression`` option's codec, where buckets cross a network (see :attr:`Transport.crosses_network`)."""
        return choose_codec(f"strategy {self.strategy_name!r}", self.compression, transport, buckets,
                            self.error_feedback, self.powersgd_rank, self.powersgd_warmup_steps)  # fmt: skip

    def _may_overlap_backward(self) -> bool:
        """Gradient traffic runs on its own process group; under NCCL it may not overlap a backward that issues
        collectives on the default group (SyncBatchNorm), which another thread would interleave differently on
        each rank."""
        assert self.model is not None
        if self._process_group_backend != "nccl":
            return True
        return not any(isinstance(m, torch.nn.SyncBatchNorm) for m in self.model.modules())

    def _reduce_bucket(self, bucket: GradientBucket) -> None:
        """Synchronize one full gradient bucket (runs on the communication thread, in bucket order): averaged on
        its owners, and on every rank when every rank needs the averaged gradients."""
        assert self.transport is not None
        self.rank_loss.save_gradients(bucket)
        self.codec.reduce(bucket, self.transport)
        if self.full_gradients:
            self.codec.share(bucket, self.transport)
        self._after_reduce(bucket)

    def _after_reduce(self, bucket: GradientBucket) -> None:
        """``bucket`` was exchanged (on the communication thread): what else travels with it."""

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    @override
    def configure_ddp(self) -> None:
        raise RuntimeError(f"strategy {self.strategy_name!r} synchronizes gradients itself and never wraps the "
                           "model in DistributedDataParallel")  # fmt: skip

    # ------------------------------------------------------------------ the training step
    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Accumulate gradients locally (no communication) inside this context."""
        if self.reducer is None:
            yield
            return
        with self.reducer.no_sync():
            yield

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self.broadcast_buffers and self.reducer is not None and self.reducer.enabled:
            assert self.model is not None
            buffers = list(self.model.buffers())
            if buffers:
                self.rank_loss.broadcast_buffers(self, buffers)
        self.batches.forward_started()
        return super().training_step(*args, **kwargs)

    @override
    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        """Lightning's backward, with the gradient synchronization completed before ``on_after_backward`` (as
        DDP's reducer completes it inside ``loss.backward()``), so the hooks see and edit averaged gradients."""
        self._before_backward()
        self.pre_backward(closure_loss)
        assert self.lightning_module is not None
        closure_loss = self.precision_plugin.pre_backward(closure_loss, self.lightning_module)
        start = time.perf_counter()
        weighted = self.batches.weighted(closure_loss)  # the hooks see the loss as computed, backward the weighted one
        self.precision_plugin.backward(weighted, self.lightning_module, optimizer, *args, **kwargs)
        self.sync_stats.backward_seconds += time.perf_counter() - start
        self.batches.backward_done()
        self._finish_gradient_sync()
        closure_loss = self.precision_plugin.post_backward(closure_loss, self.lightning_module)
        self.post_backward(closure_loss)
        return closure_loss

    def _before_backward(self) -> None:
        """Backward is about to run (before ``on_before_backward``): whatever still uses the buckets ends here."""

    @override
    def pre_backward(self, closure_loss: Tensor) -> None:
        pass  # DDPStrategy's prepares a DistributedDataParallel wrapper, which this strategy never uses

    @override
    def post_backward(self, closure_loss: Tensor) -> None:
        pass  # the synchronization completed in backward, before on_after_backward

    def _finish_gradient_sync(self) -> None:
        if self.reducer is None or not self.reducer.enabled:
            return
        self.rank_loss.finish_gradient_sync(self, self.reducer, self._copies_back())

    def seal_exchange(self) -> None:
        """The step's gradient exchange completed on this rank; what must also hold before it counts as complete
        (inside its sync point, see :mod:`~lightning_dp.strategies.rank_loss`)."""

    @property
    def exchange_outcome_travels(self) -> bool:
        """Whether a rank one sync point behind at the gradient exchange takes the outcome of a member that completed
        it (its weights and optimizer state: every rank's update is the same), or holds its own part of it already
        (the replicated servers: each one's shard arrived wherever any member completed the exchange)."""
        return True

    def point_completed(self, kind: str) -> None:
        """A sync point of ``kind`` completed on this rank, or was taken from a survivor that completed it."""

    def after_recovery(self, lost: list[int]) -> None:
        """Every survivor agreed on the loss of the global ranks ``lost`` and stands at the same sync point (inside the
        recovery: collective over the survivors)."""

    def after_admission(self, joined: list[int]) -> bool:
        """The new members ``joined`` were admitted, and every member stands at the same sync point with them, before
        they are handed the job's state (the exchange is rebuilt over the grown membership already, and
        :meth:`after_recovery` ran). Returns whether every rank, the new ones included, now holds the optimizers'
        full states (:meth:`optimizer_state` answers from them): the handover then sends their hyperparameters
        only."""
        return False

    def leave(self) -> None:
        """Leave the running job on purpose, at the next step boundary of the fit (a host drained before
        maintenance; as the signal ``SIGUSR2`` does): the other members deal this rank's share of each global batch
        among themselves from the first batch no loader has drawn, it trains every batch before, and at the boundary
        before that batch they go on without it, counted as left, not lost. Its process then ends with exit code 0,
        after Lightning's teardown. Needs ``on_rank_loss="continue"``; refused (with the reason) on the rank that
        leads the members and on one that started its machine's other ranks."""
        self.rank_loss.request_leave(self, "trainer.strategy.leave()")

    def rebuild_exchange(self) -> None:
        """After the membership changed (``on_rank_loss="continue"``): the groups, the transport and the codec over
        the ranks that train now, on the same buckets (collective over them)."""
        self.rebuild_groups()
        self.rebuild_transport()

    def rebuild_groups(self) -> None:
        """The gradient and control groups over the ranks that train now."""
        membership = self.rank_loss.membership
        assert membership is not None
        self.gradient_group = membership.group("gradients")
        self._control_group = membership.group("control")
        self.node_layout = NodeLayout.gather(self.node_rank, self.gradient_group)

    def rebuild_transport(self) -> None:
        """The transport over the current gradient group, bound to the same buckets."""
        shared = self.transport.shared_memory if self.transport is not None else self._uses_shared_memory()
        # the members' kind of exchange (through shared memory inside a node or not), which a new member, set up alone,
        # cannot know: the first member's that is not new (gathered wherever the exchange is set up or not, alike)
        kinds = [torch.empty(1, dtype=torch.int64) for _ in range(dist.get_world_size(self.gradient_group))]
        mine = -1 if self.rank_loss.newcomer or self.reducer is None else int(shared)
        dist.all_gather(kinds, torch.tensor([mine], dtype=torch.int64), group=self.gradient_group)
        if self.reducer is None:  # lost before (or after) a fit's exchange was set up
            return
        shared = next((bool(k) for k in (int(k) for k in kinds) if k >= 0), shared)
        if self.transport is not None:
            self.transport.close()
        self.transport = self._make_transport(shared)
        self.transport.bind(self.reducer.buckets)
        codec = self._make_codec(self.transport, self.reducer.buckets)
        if type(codec) is type(self.codec):  # the same codec over the survivors: each rank keeps its residuals
            self.codec.rebind(self.reducer.buckets, self.transport)
        else:
            self.codec = codec
            self.codec.bind(self.reducer.buckets, self.transport)

    def _copies_back(self) -> bool:
        """Whether this rank takes the reduced gradients into ``param.grad`` right after backward."""
        return self.full_gradients

    def _raise_if_nonfinite(self, optimizer: torch.optim.Optimizer) -> None:
        """Check the gradients for NaN/inf where the optimizer is about to use them: after the closure, the
        ``on_before_optimizer_step`` hooks and clipping (a hook that sanitizes gradients trains, as under DDP), and
        before the update. Every rank holds the same averaged and equally edited gradients, so every rank reaches
        the same verdict."""
        grads = [(p, p.grad) for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        bad = first_nonfinite(grads)
        if bad is not None:
            self.raise_nonfinite(bad)

    def _checks_finite_gradients(self) -> bool:
        """The rule for NaN/inf gradients: raise on every rank, except under a gradient scaler (16-mixed), whose
        own rule is to skip such steps."""
        return getattr(self.precision_plugin, "scaler", None) is None

    def raise_nonfinite(self, param: Tensor | None) -> None:
        """Raise :class:`NonFiniteGradientError` for this step (naming ``param`` if given)."""
        assert self.lightning_module is not None
        raise nonfinite_gradient_error(self.lightning_module, param, self.global_rank)

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        self.check_trainable_unchanged(unwrap_optimizer(optimizer))
        result = ParallelStrategy.optimizer_step(self, optimizer, closure, model, **kwargs)
        self.end_step()
        return result

    def check_trainable_unchanged(self, optimizer: torch.optim.Optimizer) -> None:
        """Buckets (and shards) are laid out at set-up: a parameter made trainable later would never be synchronized
        and the replicas would drift apart silently, so refuse it."""
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.requires_grad and id(p) not in self._synced_params:
                    raise UnsupportedChangeError(
                        f"strategy {self.strategy_name!r}: a parameter of shape {tuple(p.shape)} became trainable (or "
                        "was added to the optimizer) after set-up, so its gradients would never be synchronized. "
                        "Make every parameter that will train trainable before fit() starts."
                    )

    def buckets_of(self, optimizer: torch.optim.Optimizer) -> list[GradientBucket]:
        """The buckets holding any parameter of ``optimizer`` (only those need new weights after its step)."""
        assert self.reducer is not None
        ids = {id(p) for group in optimizer.param_groups for p in group["params"]}
        return [b for b in self.reducer.buckets if any(id(p) in ids for p in b.params)]

    def end_step(self, blocking_seconds: float = 0.0) -> None:
        """Book-keeping after an optimizer step; ``blocking_seconds`` of communication ran on the main thread."""
        comm, waited, peer_wait = self.reducer.take_timing() if self.reducer is not None else (0.0, 0.0, 0.0)
        self.sync_stats.end_step(comm + blocking_seconds, waited + blocking_seconds, peer_wait)

    # ------------------------------------------------------------------ the cost model's view of this run
    def cost_scheme(self) -> Scheme:
        """This run as the cost model (:mod:`lightning_dp.comm.cost`) sees it: the options that change what it
        moves, as set up (a node that could not share memory runs ``intra_node="ring"``)."""
        shared = self.transport is not None and self.transport.shared_memory
        return Scheme(self.strategy_name, "shm" if shared else "ring", self._running_compression(),
                      full_gradients=self.full_gradients)  # fmt: skip

    def _running_compression(self) -> str:
        """The codec that runs (``"none"`` where nothing crosses a network, see :meth:`_make_codec`)."""
        return self.codec.name if type(self.codec) is not Codec else "none"

    def _synchronized_buckets(self) -> list[GradientBucket]:
        """The gradient buckets this run synchronizes (set up by ``fit``)."""
        assert self.reducer is not None, "call it while fitting"
        return self.reducer.buckets

    def traffic(self) -> tuple[Wire, Wire]:
        """``(compressed, plain)``: the buckets as they travel between machines and as they are (cost model)."""
        buckets = self._synchronized_buckets()
        return self.codec.traffic(buckets), Codec().traffic(buckets)

    def predicted_step_bytes(self) -> tuple[float, float] | None:
        """``(sent, received)`` bytes this rank's counters (:attr:`sync_stats`) should show for a synchronized step
        (:func:`~lightning_dp.comm.cost.rank_traffic`, up to rounding to whole elements), where the model counts
        per rank: one machine or sockets everywhere, uncompressed; ``None`` elsewhere."""
        scheme = self.cost_scheme()
        if self.reducer is None or scheme.compression != "none" or scheme.staleness != 0 or scheme.num_servers:
            return None
        if scheme.intra_node == "shm" and self.num_nodes > 1:
            return None
        flags = sum(b.flags.numel() * b.flags.element_size() for b in self.reducer.buckets)
        server = getattr(self, "server_rank", 0)
        return rank_traffic(scheme, self.world_size, self.sync_stats.bucket_bytes, self.global_rank, flags, server)

    def measure_exchange_seconds(self, repeats: int = 3) -> float:
        """Seconds one synchronization takes (the gradient exchange of every bucket, and for the parameter servers
        the weight pull) when every rank starts it together: the cost of a step's communication with no slower
        peer to wait for. The fastest of ``repeats``. Collective: every rank calls it between steps; it leaves the
        bucket contents undefined (under ``ring_allreduce`` also ``param.grad``, a view into them) and the weights
        as the servers hold them; a compressing codec's state is restored afterwards."""
        assert self.reducer is not None, "call it while fitting"
        codec_state = self.codec.state_dict()
        best = fastest_run(self._synchronize, self.gradient_group, self.root_device, repeats)
        self.rank_loss.discard_saved()  # (a loss in the next step's exchange must not restore these)
        self.codec.load_state_dict(codec_state)
        self.sync_stats.reset()
        return best

    def _synchronize(self) -> None:
        """One synchronization without a step: every bucket's exchange, then the weights'."""
        assert self.reducer is not None
        for bucket in self.reducer.buckets:
            self._reduce_bucket(bucket)
        self._exchange_weights()

    def _exchange_weights(self) -> None:
        """The weight traffic of a step after the gradient exchange (the parameter servers' pull)."""

    def optimizer_state_bytes(self) -> int:
        """Bytes of optimizer state (tensors in ``optimizer.state``) this rank holds."""
        return sum(
            v.numel() * v.element_size()
            for optimizer in self._stepping_optimizers()
            for state in optimizer.state.values()
            for v in state.values()
            if isinstance(v, Tensor)
        )

    def _stepping_optimizers(self) -> list[torch.optim.Optimizer]:
        """The optimizers that run (and hold state) on this rank."""
        return [unwrap_optimizer(o) for o in self.optimizers]

    @override
    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        if sync_grads and self.reducer is not None and self._process_group_backend == "nccl":
            self.reducer.stop_overlap()  # its backward all-reduces on the default group (see _may_overlap_backward)
        return super().all_gather(tensor, group=group, sync_grads=sync_grads)

    # ------------------------------------------------------------------ checkpoints: the codec's state of every rank
    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Lightning's, plus every rank's codec state (see :mod:`.codec_state`) and the schedule of batch shares
        (``balance="throughput"``) for a full (not weights-only) checkpoint. Collective, as Lightning calls it on every
        rank."""
        if "optimizer_states" in checkpoint and type(self.codec) is not Codec:
            gathered = self.rank_loss.collective(self, functools.partial(gather_codec_states, self.codec))
            checkpoint = with_codec_states(checkpoint, self.codec, gathered)
        shares = self.batches.state_dict()
        if "optimizer_states" in checkpoint and shares is not None:
            checkpoint = {**checkpoint, CHECKPOINT_KEY: shares}
        super().save_checkpoint(checkpoint, filepath, storage_options)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        self._load_optimizer_states(checkpoint)
        self._load_codec_state(checkpoint)
        self.batches.load_state_dict(checkpoint.get(CHECKPOINT_KEY))

    # ------------------------------------------------------------------ the training batches (the balance option)
    @override
    def process_dataloader(self, dataloader: object) -> object:
        trainer = trainer_of(self.lightning_module)
        if trainer is None:
            return super().process_dataloader(dataloader)
        replaced = self.batches.training_loader(trainer, dataloader)
        if replaced is None:
            replaced = self.rank_loss.evaluation_loader(trainer, dataloader)
        return replaced if replaced is not None else super().process_dataloader(dataloader)

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        trainer = trainer_of(self.lightning_module)
        if trainer is not None:
            self.batches.on_train_batch_start(trainer, batch_idx)

    def _load_optimizer_states(self, checkpoint: Mapping[str, Any]) -> None:
        """Load the optimizers' states of a checkpoint (subclasses whose servers hold them differently)."""
        super().load_optimizer_state_dict(checkpoint)

    def _load_codec_state(self, checkpoint: Mapping[str, Any]) -> None:
        if type(self.codec) is Codec or self.rank_loss.newcomer:  # a new member's residuals start at zero
            return
        assert self.transport is not None and self.reducer is not None
        members = self.rank_loss.members  # (after a loss: the states saved are the survivors', in member order)
        place, size = (self.global_rank, self.world_size) if not members else (members.index(self.global_rank),
                                                                               len(members))  # fmt: skip
        problem = load_codec_state(checkpoint, self.codec, size, place)
        if any_rank(problem is not None, self.transport.ring, self.root_device):  # every rank starts afresh alike
            if problem is not None:
                warnings.warn(
                    f"strategy {self.strategy_name!r}: {problem}; compression={self.compression!r} starts afresh on "
                    "every rank (no residuals carried over), so this run does not continue the saved one exactly",
                    stacklevel=2,
                )
            self.codec = self._make_codec(self.transport, self.reducer.buckets)
            self.codec.bind(self.reducer.buckets, self.transport)

    def _close_gradient_sync(self) -> None:
        if self.reducer is not None:
            self.reducer.close()
            self.reducer = None
        if self.transport is not None:
            self.transport.close()
            self.transport = None

    @override
    def teardown(self) -> None:
        self._close_gradient_sync()
        self.rank_loss.close()
        for restore in self._restore_precision:
            restore()
        self._restore_precision = []
        super().teardown()  # DDPStrategy's: reverts SyncBatchNorm after fitting
