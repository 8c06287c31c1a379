"""A dedicated server process's share: its weights and optimizer state, fed by every trainer."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_dp.comm.buckets import GradientBucket
from lightning_dp.comm.nonfinite import first_nonfinite
from lightning_dp.comm.servers.members import MemberGroup, Tag
from lightning_dp.comm.servers.plan import Control, OptimizerSpec, ServerPlan, buckets_of
from lightning_dp.comm.servers.sharded_optimizer import (
    ELEMENTWISE_OPTIMIZERS,
    ShardedOptimizer,
    ShardLayout,
    ShardPiece,
)
from lightning_dp.comm.transports.shards import _average_in_rank_order


class DedicatedServer:
    """One server process's share: its own copy of its weights and the optimizer state over them, fed by the
    trainers (see the module docstring). :meth:`run` serves until trainer 0 says stop; a lost trainer ends it with
    :class:`~lightning_dp.comm.errors.PeerUnreachableError` naming the trainer."""

    def __init__(
        self,
        members: MemberGroup,
        plan: ServerPlan,
        on_lost: Callable[[BaseException], None] | None = None,
        member_index: int | None = None,
    ) -> None:
        self.members, self.plan = members, plan
        #: called (on the receiving thread) when a trainer is lost before trainer 0 said stop; by default the error
        #: waits for the serving loop
        self.on_lost = on_lost
        self.stopping = False
        #: this share's place in the plan's segments (the member rank of its server when the run started; another
        #: server's for a replica of that server's share)
        self.member_index = me = members.rank if member_index is None else member_index
        params = [torch.nn.Parameter(torch.empty(shape, dtype=plan.dtype, device="meta")) for shape in plan.shapes]
        self.buckets = [GradientBucket(b, [params[i] for i in indices]) for b, indices in enumerate(plan.buckets)]
        owner = f"{members.name(me)} ({plan.owner})"
        #: elements per partition: the pieces of one message (see :meth:`MemberGroup.piece_numel`); each is summed,
        #: stepped and sent back as soon as every trainer's copy of it is in. Optimizers that are not element-wise
        #: step whole parameters, never during backward (see DedicatedEngine._eager_possible): no partitions
        self.partition = members.piece_numel(torch.empty(0, dtype=plan.dtype))
        elementwise = all(spec.cls in ELEMENTWISE_OPTIMIZERS for spec in plan.optimizers)
        self.layout = ShardLayout(self.buckets, plan.segments, me, owner, own_storage=True, read_params=False,
                                  split_every=self.partition if elementwise else 0)  # fmt: skip
        self.optimizers = [ShardedOptimizer(self._template(spec, params), self.layout, None, owner)
                           for spec in plan.optimizers]  # fmt: skip
        #: the first optimizer's pieces in each (bucket, partition): what an armed synchronization steps at once
        self._partition_pieces: dict[tuple[int, int], list[ShardPiece]] = {}
        for piece in self.optimizers[0].pieces if self.optimizers else []:
            index = piece.bucket.index
            key = (index, self.layout.partition_of(piece, plan.segments[index][me][0]))
            self._partition_pieces.setdefault(key, []).append(piece)
        self.served = [b.index for b in self.buckets if plan.segments[b.index][me][1] > plan.segments[b.index][me][0]]
        self.offset: dict[int, int] = {}
        offset = 0
        for b in self.buckets:
            self.offset[b.index] = offset
            start, end = plan.segments[b.index][me]
            offset += end - start
        self.gradients = torch.zeros_like(self.layout.storage)
        self.flags = {b: torch.zeros(len(plan.buckets[b]), dtype=plan.dtype) for b in self.served}
        #: per served bucket, each trainer's contribution as it arrives (allocated where gradients are received: not
        #: for a replica of another server's share)
        self._scratch: dict[int, list[Tensor]] = {}
        self._flag_scratch: dict[int, list[Tensor]] = {}
        self._synced = 0
        self._consumed = 0
        self._sync_error: BaseException | None = None
        self._cond = threading.Condition()
        self.steps = 0

    @staticmethod
    def _template(spec: OptimizerSpec, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        import inspect

        accepted = inspect.signature(spec.cls.__init__).parameters
        defaults = {k: v for k, v in spec.defaults.items() if k in accepted}
        return spec.cls([{**hyper, "params": [params[i] for i in indices]} for indices, hyper in spec.groups],
                        **defaults)  # fmt: skip

    def _numel(self, b: int) -> int:
        start, end = self.plan.segments[b][self.member_index]
        return end - start

    def _share_of(self, b: int) -> slice:
        return slice(self.offset[b], self.offset[b] + self._numel(b))

    # ------------------------------------------------------------------ gradients, on a thread of their own
    def _receive_syncs(self) -> None:
        members, dtype = self.members, self.plan.dtype
        self._scratch = {b: [torch.empty(self._numel(b), dtype=dtype) for _ in members.trainers] for b in self.served}
        self._flag_scratch = {b: [torch.empty_like(self.flags[b]) for _ in members.trainers] for b in self.served}
        try:
            while True:
                eager = members.recv_object(0, tag=Tag.GRADIENTS)  # trainer 0 starts every synchronization
                if eager is not None:
                    self._apply_hyperparameters(eager)
                # each trainer's flags first (they say which parameters the partitions' steps update), then its
                # gradients, in pieces
                arriving = {b: [(members.irecv(self._flag_scratch[b][t], t, Tag.GRADIENTS),
                                 members.irecv(self._scratch[b][t], t, Tag.GRADIENTS), t) for t in members.trainers]
                            for b in self.served}  # fmt: skip
                sending: list[tuple[dist.Work | None, int]] = []
                stepped = eager is not None  # every partition of every served bucket, all finite
                for b in self.served:
                    self.flags[b].zero_()
                    for (flags_work, _, t), their_flags in zip(arriving[b], self._flag_scratch[b]):
                        members.wait(flags_work, t, "receive gradients from")
                        self.flags[b].add_(their_flags)
                    bad = False
                    gradients = self.gradients[self._share_of(b)]
                    for k, lo in enumerate(range(0, self._numel(b), self.partition)):
                        hi = min(lo + self.partition, self._numel(b))
                        for _, grads_work, t in arriving[b]:
                            piece = grads_work.works[k] if grads_work is not None else None
                            members.wait(piece, t, "receive gradients from")
                        parts = [scratch[lo:hi] for scratch in self._scratch[b]]
                        _average_in_rank_order(parts, members.num_trainers, gradients[lo:hi])
                        if eager is not None:
                            bad = self._step_partition(b, k, eager) or bad
                            sending += self._send_to_trainers(b, Tag.WEIGHTS, self.layout.storage, piece=k)
                    if self.plan.full_gradients:
                        sending += self._send_to_trainers(b, Tag.AVERAGED, self.gradients, self._first_owner(b))
                    if eager is not None:  # after the weights: 1 where a partition was not finite (left as it was)
                        status = torch.tensor([1.0 if bad else 0.0], dtype=torch.float64)
                        sending += [(members.isend(status, t, Tag.WEIGHTS), t) for t in members.trainers]
                        stepped = stepped and not bad
                for work, t in sending:
                    members.wait(work, t, "send to")
                if stepped:
                    self.steps += 1
                with self._cond:
                    self._synced += 1
                    if eager is not None:
                        self._consumed = self._synced
                    self._cond.notify_all()
        except BaseException as error:  # noqa: BLE001 - reported by the serving loop when it needs the gradients
            with self._cond:
                self._sync_error = error
                self._cond.notify_all()
            if not self.stopping and self.on_lost is not None:
                self.on_lost(error)

    def _apply_hyperparameters(self, control: dict[str, Any]) -> None:
        sharded = self.optimizers[0]
        for group, hyper in zip(sharded.optimizer.param_groups, control["hyperparameters"]):
            group.update(hyper)

    def _step_partition(self, b: int, k: int, control: dict[str, Any]) -> bool:
        """An armed synchronization: update this server's partition ``k`` of bucket ``b`` now, unless its gradient is
        not finite (then left as it was; returns True)."""
        sharded = self.optimizers[0]
        pieces = self._partition_pieces.get((b, k), [])
        self._take_gradients(pieces)
        grads = [(pc.param, pc.tensor.grad) for pc in pieces if pc.tensor.grad is not None]
        if first_nonfinite(grads) is not None:
            for piece in pieces:
                piece.tensor.grad = None  # this partition's pieces only: the others step on their own
            return True
        clip = control["clip"]
        if clip is not None:  # by value only: an armed step never clips by norm
            for piece in pieces:
                if piece.tensor.grad is not None:
                    piece.tensor.grad.clamp_(-clip[1], clip[1])
        sharded.step_pieces(pieces, **control["kwargs"])
        return False

    def _first_owner(self, b: int) -> bool:
        return next(m for m, (s, e) in enumerate(self.plan.segments[b]) if e > s) == self.member_index

    def _send_to_trainers(
        self, b: int, tag: int, source: Tensor, with_flags: bool = False, piece: int | None = None
    ) -> list[tuple[dist.Work | None, int]]:
        """Start sending this server's share of bucket ``b`` (of ``source``; only partition ``piece`` of it, if
        given: one piece of the message the trainers receive whole) to every trainer; the works."""
        share = source[self._share_of(b)]
        first = 0
        if piece is not None:
            first, share = piece, share[piece * self.partition : (piece + 1) * self.partition]
        tensors = [share] + ([self.flags[b]] if with_flags else [])
        return [(self.members.isend(t, trainer, tag, first), trainer) for trainer in self.members.trainers
                for t in tensors]  # fmt: skip

    def _send_and_wait(self, b: int, tag: int, source: Tensor) -> None:
        for work, trainer in self._send_to_trainers(b, tag, source):
            self.members.wait(work, trainer, "send to")

    def _wait_syncs(self, syncs: int) -> None:
        with self._cond:
            while self._synced < syncs and self._sync_error is None:
                self._cond.wait()
            if self._synced < syncs and self._sync_error is not None:
                raise self._sync_error

    # ------------------------------------------------------------------ the serving loop
    def run(self) -> None:
        """Serve until trainer 0 sends ``STOP`` (returns) or ``ABORT`` (raises), or a trainer is lost (raises)."""
        threading.Thread(target=self._receive_syncs, daemon=True, name="lddp-server-gradients").start()
        header = torch.zeros(3, dtype=torch.int64)
        while True:
            self.members.wait(self.members.irecv(header, 0, Tag.CONTROL), 0, "receive the next control message from")
            kind, index, syncs = (int(v) for v in header.tolist())
            if kind == Control.STOP:  # acknowledged: the trainers leave only once every server knows the run is over
                self.stopping = True
                self.members.send_object("stopped", 0)
                return
            if kind == Control.ABORT:
                reason = self.members.recv_object(0)
                raise RuntimeError(f"trainer 0 stopped the run: {reason}")
            if kind == Control.STEP:
                self._step(index, syncs, self.members.recv_object(0))
            elif kind == Control.PULL:  # a timed exchange: its gradients are nobody's step
                self._wait_syncs(syncs)
                self._consumed = max(self._consumed, syncs)
                for b in self.served:
                    self._send_and_wait(b, Tag.WEIGHTS, self.layout.storage)
            elif kind == Control.SET_WEIGHTS:
                works = [(self.members.irecv(self.layout.storage[self._share_of(b)], 0, Tag.WEIGHTS), b)
                         for b in self.served]  # fmt: skip
                for work, _ in works:
                    self.members.wait(work, 0, "receive the weights from")
            elif kind == Control.STATE:
                self.members.send_object(self.optimizers[index].local_state(), 0)
            elif kind == Control.LOAD:
                self.optimizers[index].load_state_dict(self.members.recv_object(0))

    def _step(self, index: int, syncs: int, control: dict[str, Any]) -> None:
        sharded = self.optimizers[index]
        spec = self.plan.optimizers[index]
        mine = [b for b in buckets_of(spec.groups, self.plan.buckets) if b in self.served]
        for group, hyper in zip(sharded.optimizer.param_groups, control["hyperparameters"]):
            group.update(hyper)
        if syncs > self._consumed:  # a synchronization since the last step: every optimizer's pieces take it
            self._wait_syncs(syncs)
            self._consumed = syncs
            if not self.plan.full_gradients:
                self._take_gradients(self.layout.pieces)
        if self.plan.full_gradients:  # the gradients as the trainers' hooks left them, from trainer 0
            works = []
            for b in mine:
                for tensor in (self.gradients[self._share_of(b)], self.flags[b]):
                    works.append(self.members.irecv(tensor, 0, Tag.EDITED))
            for work in works:
                self.members.wait(work, 0, "receive gradients from")
            self._take_gradients(sharded.pieces)
        clip = None if self.plan.full_gradients else control["clip"]
        if not sharded.voted_step(clip, self.members.vote, **control["kwargs"]):
            return
        self.steps += 1
        for b in mine:
            self._send_and_wait(b, Tag.WEIGHTS, self.layout.storage)

    def _take_gradients(self, pieces: Sequence[ShardPiece]) -> None:
        for piece in pieces:
            if piece.bucket.index in self.flags:
                used = bool(self.flags[piece.bucket.index][piece.index_in_bucket] != 0)
                n = piece.tensor.numel()
                grad = self.gradients[piece.storage_start : piece.storage_start + n].view_as(piece.tensor)
                piece.tensor.grad = grad.clone() if used else None
