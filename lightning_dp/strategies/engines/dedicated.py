"""``num_servers > 0``: dedicated server processes hold (part of) the weights and the optimizer.

:class:`DedicatedEngine` starts the servers on this machine (trainer 0, unless they are started with ``python -m
lightning_dp.server`` elsewhere), joins them in a :class:`~lightning_dp.comm.servers.MemberGroup`, runs the
optimizer step (hooks, clipping and the NaN/inf vote exactly as the co-located servers do) and gathers the servers'
optimizer state for checkpoints. Every collective of Lightning's stays among the trainers.
"""

from __future__ import annotations

import dataclasses
import pickle
import subprocess
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.trainer.states import TrainerStatus
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_dp._lightning_compat import after_closure, replace_clipping, unwrap_optimizer
from lightning_dp.comm.buckets import BucketReducer, GradientBucket
from lightning_dp.comm.cost import Scheme
from lightning_dp.comm.errors import ConfigurationError, NonFiniteGradientError, UnsupportedChangeError
from lightning_dp.comm.servers import (
    Control,
    DedicatedServerTransport,
    MemberGroup,
    ServerPlan,
    check_importable,
    member_shares,
    optimizer_spec,
    run_store,
)
from lightning_dp.comm.servers.launch import start_local_servers, stop_local_servers
from lightning_dp.comm.servers.sharded_optimizer import (
    ELEMENTWISE_OPTIMIZERS,
    ShardedOptimizer,
    ShardLayout,
    hyperparameters,
)
from lightning_dp.comm.transports.shards import any_rank
from lightning_dp.strategies.base import DataParallelStrategy
from lightning_dp.strategies.engines.base import StepEngine

#: seconds trainer 0 waits for its local servers to exit after telling them to stop, before killing them
STOP_GRACE_SECONDS = 30.0


class DedicatedEngine(StepEngine):
    """A fit's ``num_servers`` dedicated servers, seen from a trainer (see the module docstring); trainer 0 starts
    them where ``start_servers``. With ``trainers_serve`` the trainers serve a share too (the optimal split),
    otherwise only the servers do: each an equal part of every bucket (element-wise optimizers), else a set of whole
    parameters."""

    def __init__(
        self, strategy: DataParallelStrategy, num_servers: int, start_servers: bool, trainers_serve: bool
    ) -> None:
        super().__init__(strategy)
        self.num_servers = num_servers
        self.start_servers = start_servers
        self.trainers_serve = trainers_serve
        self.run_key = ""
        self.processes: list[subprocess.Popen] = []
        #: trainer 0 with ``start_servers``: the exit code of each server it started, by index, once closed
        self.exit_codes: dict[int, int] = {}
        #: trainer 0 with ``start_servers``: what it started its servers with (``start_local_servers``' arguments)
        self.local_servers: tuple[str, int, int, str, float, str] | None = None
        self.transport: DedicatedServerTransport | None = None
        self.layout: ShardLayout | None = None
        self.optimizers: list[ShardedOptimizer] = []
        #: whether this fit's servers are gone from this trainer's view (before the first fit: none are there)
        self.closed = True
        #: whether the servers were told the run is over (:meth:`on_train_end`)
        self.stopped = False
        #: the full optimizer states gathered at the end of training, for checkpoints saved after the servers stopped
        self.final_states: list[dict] | None = None
        self._clip: tuple[str, float] | None = None
        self._groups: list[int] = []
        #: whether the servers update each bucket as it arrives during backward (see :meth:`_eager_possible`)
        self.eager = False
        self._static_clip: tuple[str, float] | None = None
        self._restore_clipping: Callable[[], None] | None = None
        #: whether each server holds whole parameters (optimizers that are not element-wise, trainers not serving)
        self.whole = False
        #: the servers whose exit is no failure of this run's (lost, and gone on without)
        self.expected_exits: set[int] = set()

    @property
    def is_trainer_zero(self) -> bool:
        """Whether this trainer is member 0: it starts the servers (``start_servers``) and sends the control
        messages."""
        return self.member_rank == 0

    @property
    def member_rank(self) -> int:
        """This trainer's rank in the member group."""
        return self.strategy.global_rank

    # ------------------------------------------------------------------ set-up
    def check_optimizers(self, optimizers: list[torch.optim.Optimizer]) -> None:
        owner = f"strategy {self.name!r} with num_servers={self.num_servers}"
        for optimizer in optimizers:
            check_importable(type(optimizer), owner)
            if not self.trainers_serve and self.num_servers > 1 and not isinstance(optimizer, ELEMENTWISE_OPTIMIZERS):
                if type(optimizer).__module__.split(".")[0] != "torch":
                    raise ConfigurationError(
                        f"{owner}: each server runs {type(optimizer).__name__} on its own parameters, which is exact "
                        "only for optimizers that update every parameter on its own (the torch.optim ones); use "
                        "num_servers=1 for this optimizer"
                    )

    def cost_scheme(self, scheme: Scheme) -> Scheme:
        return dataclasses.replace(scheme, intra_node="ring")

    def setup_gradient_sync(self) -> None:
        """Buckets as usual, travelling to the servers: start (trainer 0, ``start_servers``) and join the servers,
        hand them the plan and the weights."""
        strategy = self.strategy
        assert strategy.model is not None
        self.run_key = next_run_key(strategy.job_scope)
        self.processes, self.transport, self.layout, self.optimizers = [], None, None, []
        self.closed, self.stopped, self.final_states = False, False, None
        self.expected_exits = set()
        strategy.reducer = reducer = strategy.new_reducer()
        if strategy.intra_node == "shm" and strategy.ranks_on_this_node > 1:
            rank_zero_info(f"{self.name}: with num_servers={self.num_servers} buckets travel through sockets "
                           "(intra_node='shm' applies to num_servers=0)")  # fmt: skip
        env = strategy.cluster_environment
        assert env is not None and strategy.lightning_module is not None
        timeout = strategy.timeout
        n, k = strategy.world_size, self.num_servers
        dtypes = {b.buffer.dtype for b in reducer.buckets}
        if len(dtypes) > 1:
            raise ConfigurationError(
                f"strategy {self.name!r} with num_servers={k} needs every trainable parameter in one dtype, got "
                f"{sorted(str(d) for d in dtypes)}"
            )
        scope = strategy.job_scope or EXTERNAL_SCOPE
        if self.is_trainer_zero and self.start_servers:
            self.local_servers = (env.main_address, env.main_port, k, self.run_key, timeout.total_seconds(), scope)
            self.processes = start_local_servers(*self.local_servers)
        # where another party created the default group no record names the scope: servers started by hand need one
        publish = strategy.job_scope is None and self.is_trainer_zero and not self.start_servers
        store = run_store(env.main_address, env.main_port, self.run_key, timeout, scope=scope, publish=publish)
        if self.is_trainer_zero:
            store.set("num_trainers", str(n))
            store.set("num_servers", str(k))
        started = time.perf_counter()
        members = self._join(store, n, k)
        shares = member_shares(n, k, trainers_serve=self.trainers_serve)
        optimizers = [unwrap_optimizer(o) for o in strategy.optimizers]
        # element-wise optimizers are exact on any slice: every bucket is cut over the servers, a large tensor too
        self.whole = not self.trainers_serve and not all(type(o) in ELEMENTWISE_OPTIMIZERS for o in optimizers)
        transport = self._transport_type(members, shares, self.whole, strategy.gradient_group, strategy.sync_stats,
                                         timeout)  # fmt: skip
        transport.bind(reducer.buckets)
        self.transport = strategy.transport = transport
        if self.is_trainer_zero:
            store.set("plan", pickle.dumps(self._plan(reducer, optimizers)))  # type: ignore[arg-type]  # bytes are fine
        self._joined(store)
        self._shard_optimizers()
        self.eager = self._eager_possible(optimizers)
        self.send_weights(reducer.buckets)
        rank_zero_info(
            f"{self.name}: {n} trainers and {k} dedicated servers (joined in {time.perf_counter() - started:.1f} "
            f"s); each trainer serves {shares[0]:.1%} of the gradients, each server {shares[-1]:.1%}"
        )
        strategy.mark_synchronized(reducer.params)
        strategy.sync_stats.bucket_bytes = sum(b.nbytes for b in reducer.buckets)
        self._restore_clipping = replace_clipping(strategy.precision_plugin, self._clip_request("norm"),
                                                  self._clip_request("value"))  # fmt: skip

    def _shard_optimizers(self) -> None:
        """This trainer's part of the servers' layout (cut as :attr:`transport` cuts the buckets) and its sharded
        optimizers."""
        strategy = self.strategy
        assert strategy.reducer is not None and self.transport is not None
        owner = f"strategy {self.name!r}"
        self.layout = ShardLayout(strategy.reducer.buckets, self.transport.segments, self.member_rank, owner)
        optimizers = [unwrap_optimizer(o) for o in strategy.optimizers]
        self.optimizers = [ShardedOptimizer(o, self.layout, strategy.gradient_group, owner) for o in optimizers]
        self._groups = [len(o.param_groups) for o in optimizers]

    #: the trainers' side of the servers
    _transport_type: type[DedicatedServerTransport] = DedicatedServerTransport

    def _join(self, store: dist.Store, num_trainers: int, num_servers: int) -> MemberGroup:
        """This trainer's member group with the servers, on the run's ``store``."""
        return MemberGroup(store, self.member_rank, num_trainers, num_servers, self.strategy.timeout)

    def _joined(self, store: dist.Store) -> None:
        """Every member joined and the plan is in the run's ``store``."""

    def _eager_possible(self, optimizers: list[torch.optim.Optimizer]) -> bool:
        """Whether nothing between backward and the step can change the update, so the servers may apply it bucket
        by bucket as the gradients arrive, overlapping the pull with the push: automatic optimization of one
        optimizer, nothing reading gradients before the step, no clipping by norm (a global quantity)."""
        strategy = self.strategy
        assert strategy.lightning_module is not None
        trainer = strategy.lightning_module.trainer
        clip_val = trainer.gradient_clip_val or 0.0
        algorithm = str(getattr(trainer.gradient_clip_algorithm, "value", trainer.gradient_clip_algorithm) or "norm")
        if clip_val > 0 and algorithm == "norm":
            return False
        self._static_clip = ("value", float(clip_val)) if clip_val > 0 else None
        # stepping bucket by bucket is one step only for optimizers that update each element on its own
        elementwise = len(optimizers) == 1 and type(optimizers[0]) in ELEMENTWISE_OPTIMIZERS
        return strategy.lightning_module.automatic_optimization and not strategy.full_gradients and elementwise

    def _plan(self, reducer: BucketReducer, optimizers: list[torch.optim.Optimizer]) -> ServerPlan:
        params = list(reducer.params)
        index_of = {id(p): i for i, p in enumerate(params)}
        for optimizer in optimizers:  # parameters an optimizer holds but nothing synchronizes (frozen ones)
            for group in optimizer.param_groups:
                for p in group["params"]:
                    if id(p) not in index_of:
                        index_of[id(p)] = len(params)
                        params.append(p)
        assert self.transport is not None
        return ServerPlan(
            shapes=[tuple(p.shape) for p in params],
            dtype=reducer.buckets[0].buffer.dtype if reducer.buckets else torch.float32,
            buckets=[[index_of[id(p)] for p in b.params] for b in reducer.buckets],
            segments=self.transport.segments,
            optimizers=[optimizer_spec(o, index_of) for o in optimizers],
            full_gradients=self.strategy.full_gradients,
            owner=f"strategy {self.strategy.strategy_name!r}",
        )

    def send_weights(self, buckets: list[GradientBucket]) -> None:
        """Every server takes trainer 0's current weights (the trainers hold identical ones)."""
        assert self.transport is not None
        if self.is_trainer_zero:
            self.transport.control(Control.SET_WEIGHTS)
            self.transport.send_weights(buckets)

    # ------------------------------------------------------------------ the step
    def _clip_request(self, kind: str) -> Callable[[torch.optim.Optimizer, float], None]:
        """A precision plugin's ``clip_grad_by_norm`` / ``clip_grad_by_value``: the servers clip their shares
        (unless every trainer holds the averaged gradients: then Lightning's own clipping runs on them)."""
        plugin = self.strategy.precision_plugin
        lightning_clip = getattr(type(plugin), f"clip_grad_by_{kind}")

        def clip(optimizer: torch.optim.Optimizer, value: float) -> None:
            if self.strategy.full_gradients:
                lightning_clip(plugin, optimizer, value)
            else:
                self._clip = (kind, float(value))

        return clip

    def _optimizer_index(self, optimizer: torch.optim.Optimizer) -> int:
        """``optimizer``'s index among the strategy's, once its parameters and groups are known unchanged."""
        strategy = self.strategy
        strategy.check_trainable_unchanged(optimizer)
        index = [unwrap_optimizer(o) for o in strategy.optimizers].index(optimizer)
        if len(optimizer.param_groups) != self._groups[index]:
            raise UnsupportedChangeError(
                f"strategy {self.name!r} with num_servers={self.num_servers}: {type(optimizer).__name__} gained "
                "parameter groups after set-up, which the server processes cannot follow; add every group before fit()"
            )
        return index

    def step(self, optimizer: torch.optim.Optimizer, closure: Callable[[], Any], model: Any, **kwargs: Any) -> Any:
        """One optimizer step with the servers (see :mod:`lightning_dp.comm.servers`)."""
        strategy = self.strategy
        assert self.transport is not None and self.layout is not None and strategy.reducer is not None
        index = self._optimizer_index(optimizer)
        if self.eager:
            control = {"hyperparameters": [hyperparameters(g) for g in optimizer.param_groups],
                       "clip": self._static_clip, "kwargs": kwargs}  # fmt: skip
            return self._eager_step(optimizer, closure, model, control)
        sharded = self.optimizers[index]
        result = closure()
        fresh = strategy.reducer.consume()
        if fresh and not strategy.full_gradients:  # once per synchronization, for every optimizer's pieces
            self.layout.take_bucket_gradients()
        self._clip = None
        after_closure(strategy.precision_plugin, model, optimizer)  # on_before_optimizer_step hooks, clipping
        buckets = strategy.buckets_of(optimizer)
        if strategy.full_gradients:
            sharded.take_param_gradients()
        if self.is_trainer_zero:  # the hyperparameters as the step will use them (after every hook)
            control = {"hyperparameters": [hyperparameters(g) for g in optimizer.param_groups], "clip": self._clip,
                       "kwargs": kwargs}  # fmt: skip
            self.transport.control(Control.STEP, index, control)
            if strategy.full_gradients:
                self.transport.send_edited(buckets)
        if not sharded.voted_step(None if strategy.full_gradients else self._clip, self.transport.vote, **kwargs):
            strategy.raise_nonfinite(None)
        start = time.perf_counter()
        self.pull(buckets)
        strategy.end_step(blocking_seconds=time.perf_counter() - start)
        return result

    def _eager_step(
        self, optimizer: torch.optim.Optimizer, closure: Callable[[], Any], model: Any, control: dict[str, Any]
    ) -> Any:
        """The servers step each bucket during backward (armed); the trainers step their own shares after it."""
        strategy = self.strategy
        assert self.transport is not None and self.layout is not None and strategy.reducer is not None
        sharded = self.optimizers[0]
        self.transport.arm(control)
        try:
            result = closure()
        finally:
            self.transport.disarm()
        waited = time.perf_counter()
        bad_servers = self.transport.finish_eager()  # the servers' shares: what backward left to wait for
        waited = time.perf_counter() - waited
        if strategy.reducer.consume():
            self.layout.take_bucket_gradients()
        self._clip = None
        # only hooks of callbacks declaring reads_gradients = False run here; clipping is recorded
        after_closure(strategy.precision_plugin, model, optimizer)
        if self._clip != self._static_clip:
            raise UnsupportedChangeError(
                f"strategy {self.name!r}: gradient clipping changed during fit ({self._static_clip} at set-up, "
                f"{self._clip} now), after the servers had applied the set-up's"
            )
        if [hyperparameters(g) for g in optimizer.param_groups] != control["hyperparameters"]:
            raise UnsupportedChangeError(
                f"strategy {self.name!r} with num_servers={self.num_servers}: the optimizer's hyperparameters "
                "(e.g. the learning rate) changed during the step's forward, backward or in a hook of a callback "
                "declaring reads_gradients = False, after the servers had applied them to the gradients as they "
                "arrived. Change them before the step starts (an LR scheduler, or LightningModule.optimizer_step), "
                "or in on_before_optimizer_step of a module or callback without reads_gradients = False, which makes "
                "the servers wait for the hooks"
            )
        own_bad, ring = False, self.transport.ring

        def vote(squares: float, bad: bool) -> tuple[float, bool]:  # clipping by value only: no squares to sum
            nonlocal own_bad
            own_bad = bad
            return squares, any_rank(bad, ring, strategy.root_device) or bool(bad_servers)

        if not sharded.voted_step(self._clip, vote, **control["kwargs"]):
            seen = ", ".join([self.transport.members.name(m) for m in bad_servers] + (["a trainer"] if own_bad else []))
            assert strategy.lightning_module is not None
            raise NonFiniteGradientError(
                f"non-finite (NaN or infinite) averaged gradient at global step "
                f"{strategy.lightning_module.global_step} (seen by {seen}); every trainer stops here with its "
                "weights as before the step, all finite. The servers update each share as its gradients arrive "
                "(num_servers > 0 without clipping by norm), so the other shares on the servers took this step: "
                "resume from a checkpoint, not from this state"
            )
        start = time.perf_counter()
        buckets = strategy.buckets_of(optimizer)
        for bucket in buckets:  # the servers' shares arrived during backward; the trainers' now
            bucket.pack_params(*self.transport.owned(bucket))
        self.transport.share_weights_all(buckets, from_servers=False)
        for bucket in buckets:
            bucket.unpack_params()
        strategy.end_step(blocking_seconds=waited + time.perf_counter() - start)
        return result

    def pull(self, buckets: list[GradientBucket]) -> None:
        """Every trainer receives the new weights of ``buckets`` from their owners."""
        assert self.transport is not None
        for bucket in buckets:
            bucket.pack_params(*self.transport.owned(bucket))
        self.transport.share_weights_all(buckets)
        for bucket in buckets:
            bucket.unpack_params()

    def exchange_weights(self) -> None:
        assert self.transport is not None and self.strategy.reducer is not None
        if self.is_trainer_zero:
            self.transport.control(Control.PULL)
        self.pull(self.strategy.reducer.buckets)

    # ------------------------------------------------------------------ checkpoints
    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict:
        """The full optimizer state on trainer 0, from every trainer's and server's share (collective)."""
        strategy = self.strategy
        index = [unwrap_optimizer(o) for o in strategy.optimizers].index(optimizer)
        sharded = self.optimizers[index]
        if self.closed or self.stopped:
            if self.final_states is None:
                raise RuntimeError(f"strategy {self.name!r}: the servers stopped before training ended; their "
                                   "optimizer state is lost")  # fmt: skip
            return self.final_states[index]
        assert strategy.lightning_module is not None and self.transport is not None
        if strategy.lightning_module.trainer.state.status == TrainerStatus.INTERRUPTED:
            rank_zero_warn(
                f"strategy {self.name!r}: a checkpoint written while the run fails holds no optimizer state "
                "(it lives on the servers and cannot be gathered now); its weights are trainer 0's"
            )
            return {"state": {}, "param_groups": optimizer.state_dict()["param_groups"]}
        gathered: list | None = [None] * strategy.world_size if self.is_trainer_zero else None
        dist.gather_object(sharded.local_state(), gathered, group=strategy.gradient_group, group_dst=0)
        if gathered is None:
            return {}
        sharded.merge_states(gathered + self.transport.server_states(index))
        return sharded.state_dict()

    def load_optimizer_states(self, checkpoint: Mapping[str, Any]) -> None:
        assert self.transport is not None
        for index, (sharded, saved) in enumerate(zip(self.optimizers, checkpoint["optimizer_states"])):
            sharded.load_state_dict(saved)
            if self.is_trainer_zero:
                self.transport.control(Control.LOAD, index, saved)

    def stepping_optimizers(self) -> list[torch.optim.Optimizer]:
        return [s.shard for s in self.optimizers if s.serves_anything]

    def on_train_start(self) -> None:
        if not self.closed:
            assert self.strategy.reducer is not None
            self.send_weights(self.strategy.reducer.buckets)

    def on_train_end(self) -> None:
        """Gather the optimizer states while the servers still run, for checkpoints saved after ``fit``, then stop
        the servers; every trainer leaves once every server knows (collective)."""
        if self.closed:
            return
        self.final_states = [self.optimizer_state(unwrap_optimizer(o)) for o in self.strategy.optimizers]
        assert self.transport is not None
        if self.is_trainer_zero:
            self.transport.stop_servers()
        dist.barrier(group=self.strategy.gradient_group)
        self.stopped = True

    # ------------------------------------------------------------------ the end
    def on_exception(self, exception: BaseException) -> None:
        """Trainer 0 tells the servers the run failed (they exit non-zero with the reason)."""
        self._abort(f"{type(exception).__name__}: {exception}")

    def _abort(self, reason: str) -> None:
        if self.closed or not self.is_trainer_zero:
            return
        if self.transport is not None:
            try:
                self.transport.control(Control.ABORT, payload=reason)
            except Exception:  # noqa: BLE001, S110 - a server that is gone needs no message
                pass
        else:  # set-up failed before the servers joined: nobody will tell them
            for process in self.processes:
                process.kill()
        self.close(stop=False)

    def close_gradient_sync(self) -> None:
        if self._restore_clipping is not None:
            self._restore_clipping()
            self._restore_clipping = None
        self.close()
        self.strategy.transport = None  # closed with the servers

    def close(self, stop: bool = True) -> None:
        """Stop the servers (trainer 0) and leave the group; local servers are waited for, then killed."""
        if self.closed:
            return
        self.closed = True
        if self.transport is not None:
            if stop and self.is_trainer_zero and not self.stopped:
                try:
                    self.transport.stop_servers()
                except Exception:  # noqa: BLE001, S110 - a server that is gone needs no message
                    pass
        codes = stop_local_servers(self.processes, STOP_GRACE_SECONDS if stop else 5.0)
        self.exit_codes = dict(enumerate(codes))
        if self.transport is not None:
            self.transport.close()
        failed = [f"server {i} (exit code {c})" for i, c in enumerate(codes) if c != 0 and i not in self.expected_exits]
        if failed and stop:
            rank_zero_warn(f"strategy {self.strategy.strategy_name!r}: {', '.join(failed)} did not stop cleanly")
        self.processes = []


#: the scope of the servers' keys where another party created the trainers' default group (no job record)
EXTERNAL_SCOPE = "lightning_dp/external"


def next_run_key(scope: str | None) -> str:
    """A key for the next fit with dedicated servers in the job ``scope`` (``0`` for the first, as the CLI
    expects): counted per job, so that the ranks of a sweep's later job, new processes, agree with the sweep's own."""
    key = _FITS.get(scope, 0)
    _FITS[scope] = key + 1
    return str(key)


_FITS: dict[str | None, int] = {}


def follow_run_key(scope: str | None, key: str) -> None:
    """This process joined the fit with run key ``key`` of the job ``scope`` (a new trainer): its next fit's key
    follows the members'."""
    _FITS[scope] = int(key) + 1
