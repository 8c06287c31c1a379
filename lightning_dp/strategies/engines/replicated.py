"""The servers on the trainers under ``on_rank_loss="continue"``: every shard's state has a replica (the central
server runs as one shard holding everything)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_dp._lightning_compat import unwrap_optimizer
from lightning_dp.comm.buckets import GradientBucket
from lightning_dp.comm.errors import ConfigurationError
from lightning_dp.comm.nonfinite import first_nonfinite
from lightning_dp.comm.servers.replicas import (
    ShardReplica,
    chain_predecessor,
    chain_successor,
    check_recoverable,
    gather_full_state,
    post_forward,
    survivors_state,
)
from lightning_dp.comm.servers.sharded_optimizer import Segment
from lightning_dp.comm.transports.shards import sum_everywhere
from lightning_dp.strategies.base import DataParallelStrategy
from lightning_dp.strategies.engines.synchronous import ShardedServerEngine
from lightning_dp.strategies.rank_loss import EXCHANGE, PULL


class ReplicatedShardedEngine(ShardedServerEngine):
    """:class:`ShardedServerEngine` with each rank's shard of the optimizer state replicated on the next rank
    (:mod:`lightning_dp.comm.servers.replicas`), so that the survivors of a loss lose no state; the transport's
    segments say who serves what (N balanced shards, or one rank serving everything: the central server).

    A step's sync points (see :mod:`lightning_dp.strategies.rank_loss`): the exchange (the push; each owner forwards
    its averaged shard to its replica; then one value round among all ranks, so that the exchange completes on a rank
    only once every rank holds its shard's and its replica's gradients), the clipping norm and the NaN/inf vote
    (collectives), the update of every shard and replica (local), and the weight pull (at the end of the step, sealed
    by one value round as the exchange is, since under the central server a worker hears from the server only).
    After a loss:

    - before any survivor completed the exchange: the survivors cut the state again over themselves, from their
      shards and the lost ranks' replicas, and exchange their gradients again over the new shards;
    - after: the step goes on as laid out, each lost shard served by its replica (its share of the norm and of the
      vote, its update, its weights in the pull, sent over the survivors), and the state is cut again once the pull
      completes.

    One replica per shard: two neighbouring ranks lost together end the run with
    :class:`~lightning_dp.comm.servers.replicas.ReplicaLostError`.
    """

    def __init__(self, strategy: DataParallelStrategy) -> None:
        super().__init__(strategy)
        #: this rank's replica of its predecessor's shard (``None`` when alone)
        self.replica: ShardReplica | None = None
        #: the global rank of each rank of the group the shards were cut over
        self.layout_members: tuple[int, ...] = ()
        #: ``segments[b][r]`` of the current cut
        self.segments: list[list[Segment]] = []
        #: global ranks lost since the shards were cut
        self.lost: set[int] = set()
        #: whether this rank stands between a step's exchange and its pull
        self.mid_step = False
        self._forwards: list[Any] = []
        #: every optimizer's full state, held on every rank from a cut (after a change of membership) until the next
        #: update
        self._full_states: list[dict[str, Any]] | None = None

    # ------------------------------------------------------------------ set-up
    def check_devices(self, devices: list[torch.device]) -> None:
        if any(device.type != "cpu" for device in devices):
            raise ConfigurationError(
                f"strategy {self.name!r}: on_rank_loss='continue' runs the servers on CPU devices only for now (a "
                f"replica's copy of its shard and the forward of the averaged gradients live in host memory); got "
                f"devices {[str(d) for d in devices]}"
            )

    def close_gradient_sync(self) -> None:
        self._full_states = None  # (the fit's end: no full state kept on every rank past it)
        super().close_gradient_sync()

    # ------------------------------------------------------------------ the layout and its replica
    def build_layout(self) -> None:
        super().build_layout()
        self._full_states = None
        self.lost.clear()
        self.mid_step = False
        strategy = self.strategy
        transport, group = strategy.transport, strategy.gradient_group
        assert transport is not None and strategy.reducer is not None and group is not None
        self.segments = [list(s) for s in transport.segments]  # type: ignore[attr-defined]
        self.layout_members = tuple(dist.get_global_rank(group, r) for r in range(transport.size))
        self.replica = None
        if transport.size > 1:
            owner = chain_predecessor(transport.rank, transport.size)
            name = f"strategy {self.name!r}: the replica of rank {self.layout_members[owner]}'s shard"
            optimizers = [unwrap_optimizer(o) for o in strategy.optimizers]
            self.replica = ShardReplica(optimizers, strategy.reducer.buckets, self.segments, owner, name)
        self._forwards = []

    def _recut(self) -> None:
        """Cut the state again over the ranks of the current gradient group (collective over them; every one between
        two steps): from the full state they held since the last cut where one of them does (no update since), else
        from the members' shards and the lost ranks' replicas (a new member holds nothing yet). Every rank then
        holds the full state until the next update."""
        strategy = self.strategy
        group = strategy.gradient_group
        newcomer = strategy.rank_loss.newcomer
        cuts: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(cuts, (None if newcomer else self.layout_members, self._full_states is not None),
                               group=group)  # fmt: skip
        holders = [k for k, (_, full) in enumerate(cuts) if full]
        if holders:  # (a loss or a new member's death right after a cut: its state is still every shard's)
            held: list[Any] = [self._full_states]
            dist.broadcast_object_list(held, group=group, group_src=holders[0])
            # (the hyperparameters in force now: a scheduler may have changed them since that cut)
            self._cut([{"state": state["state"], "param_groups": sharded.optimizer.state_dict()["param_groups"]}
                       for sharded, state in zip(self.sharded_optimizers, held[0], strict=True)])  # fmt: skip
            return
        members_cuts = {cut for cut, _ in cuts if cut is not None}
        if len(members_cuts) > 1:
            raise RuntimeError(
                f"strategy {self.name!r}: the membership changed while the ranks cut the servers' state again, and "
                "they hold different cuts now: the run cannot go on exactly; restart it from its last checkpoint"
            )
        old = members_cuts.pop()  # (a new member's own lay-out, alone, is no cut of the job's)
        lost = [old.index(rank) for rank in sorted(self.lost)]
        check_recoverable(lost, len(old))
        states = [gather_full_state(sharded, [] if newcomer else survivors_state(sharded, self.replica, lost, k),
                                    group) for k, sharded in enumerate(self.sharded_optimizers)]  # fmt: skip
        self._cut(states)

    def _cut(self, states: list[dict[str, Any]]) -> None:
        """Lay the shards out over the current gradient group and load each optimizer's full state ``states`` into
        this rank's shard and replica; the full states stay held until the next update."""
        self.strategy.rebuild_transport()
        self.build_layout()
        for k, (sharded, state) in enumerate(zip(self.sharded_optimizers, states, strict=True)):
            sharded.load_state_dict(state)
            if self.replica is not None:
                self.replica.load_state_dict(state, k)
        self._full_states = states

    # ------------------------------------------------------------------ the strategy's side of a loss
    @property
    def exchange_outcome_travels(self) -> bool:
        return False

    def rebuild_exchange(self) -> None:
        self.strategy.rebuild_groups()  # the transport waits for the new cut (between two steps)

    def after_recovery(self, lost: list[int]) -> None:
        """Between two steps every change of membership (a loss, an admission, one refused) cuts the state again over
        the new group, the new members included; within a step the step goes on with the lost shards served by their
        replicas, and the cut follows the pull."""
        self._forwards = []
        if self.strategy.reducer is None:  # between two fits: the next one cuts its state afresh
            return
        self.lost |= {rank for rank in lost if rank in self.layout_members}
        if self.mid_step:
            if self.lost:
                check_recoverable([self.layout_members.index(rank) for rank in self.lost], len(self.layout_members))
            return
        self._recut()

    def after_admission(self, joined: list[int]) -> bool:
        """The state was cut over the grown membership at the admission (:meth:`after_recovery`): every rank, the
        new ones included, holds the full states until the next update, and :meth:`optimizer_state` answers from
        them without a collective (the handover's checkpoint, which only the members build)."""
        return self._full_states is not None

    def point_completed(self, kind: str) -> None:
        if kind == EXCHANGE:
            self.mid_step = True
        elif kind == PULL:
            self.mid_step = False

    @property
    def _serving_lost(self) -> bool:
        """Whether this rank serves a lost rank's shard in this step (it holds that shard's replica)."""
        replica = self.replica
        return replica is not None and self.layout_members[replica.owner] in self.lost

    # ------------------------------------------------------------------ the exchange
    def after_reduce(self, bucket: GradientBucket) -> None:
        if self.strategy.full_gradients:  # every rank holds the averaged gradients: the replica reads param.grad
            return
        group = self.strategy.gradient_group
        self._forwards += [post_forward(bucket, self.segments, group)]
        if self.replica is not None:
            self._forwards += [self.replica.post_receive(bucket, group)]

    def seal_exchange(self) -> None:
        forwards, self._forwards = self._forwards, []
        for work in forwards:
            if work is not None:
                work.wait()
        sum_everywhere(torch.zeros(1), self.strategy.gradient_group)

    # ------------------------------------------------------------------ the step
    def gradients_before_hooks(self, optimizer: torch.optim.Optimizer) -> None:
        strategy = self.strategy
        assert strategy.reducer is not None and self.layout is not None
        self._sharded(optimizer).follow_param_groups()
        if self.replica is not None:
            self._replica_sharded(optimizer).follow_param_groups()
        if not strategy.full_gradients and strategy.reducer.consume():
            self.layout.take_bucket_gradients()
            if self.replica is not None:
                self.replica.take_gradients()

    def gradients_after_hooks(self, optimizer: torch.optim.Optimizer) -> None:
        super().gradients_after_hooks(optimizer)
        if self.strategy.full_gradients and self.replica is not None:
            self.replica.take_param_gradients()

    def _replica_sharded(self, optimizer: torch.optim.Optimizer) -> Any:
        assert self.replica is not None
        return self.replica.sharded[self.sharded_optimizers.index(self._sharded(optimizer))]

    def server_gradients(self, optimizer: torch.optim.Optimizer) -> list[tuple[Tensor, Tensor]]:
        served = self._sharded(optimizer).gradients()
        return served + self._replica_sharded(optimizer).gradients() if self._serving_lost else served

    def check_server_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        strategy = self.strategy

        def vote(group: dist.ProcessGroup | None) -> bool:
            # (counted at each attempt: after a loss this rank may serve the lost rank's shard too)
            flag = torch.tensor([0.0 if first_nonfinite(self.server_gradients(optimizer)) is None else 1.0])
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
            return bool(flag.item() > 0)

        if strategy.rank_loss.collective(strategy, vote):
            strategy.raise_nonfinite(first_nonfinite(self.server_gradients(optimizer)))

    def _clip_grad_by_value(self, optimizer: torch.optim.Optimizer, clip_val: float) -> None:
        super()._clip_grad_by_value(optimizer, clip_val)
        if not self.strategy.full_gradients and self.replica is not None:
            self._replica_sharded(unwrap_optimizer(optimizer)).clip_grad_value_(clip_val)

    def _clip_grad_by_norm(self, optimizer: torch.optim.Optimizer, clip_val: float) -> None:
        strategy = self.strategy
        if strategy.full_gradients:  # param.grad holds the averaged gradients everywhere: Lightning's own, locally
            super()._clip_grad_by_norm(optimizer, clip_val)
            return
        optimizer = unwrap_optimizer(optimizer)
        sharded = self._sharded(optimizer)
        replica = self._replica_sharded(optimizer) if self.replica is not None else None

        def total(group: dist.ProcessGroup | None) -> float:
            # (counted at each attempt: after a loss this rank may serve the lost rank's shard too)
            squares = float(sharded.squared_norm())
            if self._serving_lost and replica is not None:
                squares += float(replica.squared_norm())
            summed = torch.tensor([squares], dtype=torch.float64)
            dist.all_reduce(summed, group=group)
            return float(summed.item())

        everything = torch.tensor(strategy.rank_loss.collective(strategy, total), dtype=torch.float64)
        sharded.scale_to_norm_(clip_val, everything)
        if replica is not None:
            replica.scale_to_norm_(clip_val, everything)

    def stepping_optimizers(self) -> list[torch.optim.Optimizer]:
        replicas = [sharded.shard for sharded in self.replica.sharded] if self.replica is not None else []
        return super().stepping_optimizers() + [s for s in replicas if any(g["params"] for g in s.param_groups)]

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict:
        if self._full_states is None:
            return super().optimizer_state(optimizer)
        # (the hyperparameters as they are now: a scheduler may have changed them since)
        state = self._full_states[self.sharded_optimizers.index(self._sharded(optimizer))]
        return {"state": state["state"], "param_groups": optimizer.state_dict()["param_groups"]}

    def load_optimizer_states(self, checkpoint: Mapping[str, Any]) -> None:
        super().load_optimizer_states(checkpoint)
        if self.replica is not None:  # the replica holds its owner's slices, as the owner does
            for k, saved in enumerate(checkpoint["optimizer_states"]):
                self.replica.load_state_dict(saved, k)

    def server_update(self, optimizer: torch.optim.Optimizer, **kwargs: Any) -> None:
        self._full_states = None
        super().server_update(optimizer, **kwargs)
        if self.replica is not None:
            self._replica_sharded(optimizer).step(**kwargs)

    def pull_weights(self, optimizer: torch.optim.Optimizer) -> None:
        strategy = self.strategy
        buckets = strategy.buckets_of(optimizer)

        def pull() -> None:
            if self.lost:
                self._pull_over_survivors(buckets)
            else:
                super(ReplicatedShardedEngine, self).pull_weights(optimizer)
            # no rank completes the pull before every rank has its weights (a worker hears from its server only)
            sum_everywhere(torch.zeros(1), strategy.gradient_group)

        strategy.rank_loss.weight_pull(strategy, pull)
        if self.lost:  # every survivor holds the step's weights: the shards are cut again over them
            strategy.rank_loss.after_point(strategy, PULL, self._recut)

    def _pull_over_survivors(self, buckets: list[GradientBucket]) -> None:
        """The pull of a step the shards were cut for before a loss: every shard's new weights from its owner, or
        from its replica where the owner was lost, over the survivors' group."""
        strategy = self.strategy
        group, me, old = strategy.gradient_group, strategy.global_rank, self.layout_members
        assert group is not None
        for bucket in buckets:
            for owner, (start, end) in enumerate(self.segments[bucket.index]):
                if end <= start:
                    continue
                source = old[owner] if old[owner] not in self.lost else old[chain_successor(owner, len(old))]
                if source == me and old[owner] == me:
                    bucket.pack_params(start, end)
                elif source == me:
                    assert self.replica is not None and self.replica.owner == owner
                    bucket.buffer[start:end].copy_(self.replica.weights_of(bucket))
                dist.broadcast(bucket.buffer[start:end], group=group, group_src=dist.get_group_rank(group, source))
            bucket.unpack_params()
