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
        self, members: MemberGroup, plan: ServerPlan, on_lost: Callable[[BaseException], None] | None = None
    ) -> None:
        self.members, self.plan = members, plan
        #: called (on the receiving thread) when a trainer is lost before trainer 0 said stop; by default the error
        #: waits for the serving loop
        self.on_lost = on_lost
        self.stopping = False
        me = members.rank
        params = [torch.nn.Parameter(torch.empty(shape, dtype=plan.dtype, device="meta")) for shape in plan.shapes]
        self.buckets = [GradientBucket(b, [params[i] for i in indices]) for b, indices in enumerate(plan.buckets)]
        owner = f"{members.name(me)} ({plan.owner})"
        self.layout = ShardLayout(self.buckets, plan.segments, me, owner, own_storage=True, read_params=False)
        self.optimizers = [ShardedOptimizer(self._template(spec, params), self.layout, None, owner)
                           for spec in plan.optimizers]  # fmt: skip
        self.served = [b.index for b in self.buckets if plan.segments[b.index][me][1] > plan.segments[b.index][me][0]]
        self.offset: dict[int, int] = {}
        offset = 0
        for b in self.buckets:
            self.offset[b.index] = offset
            start, end = plan.segments[b.index][me]
            offset += end - start
        self.gradients = torch.zeros_like(self.layout.storage)
        self.flags = {b: torch.zeros(len(plan.buckets[b]), dtype=plan.dtype) for b in self.served}
        self._scratch = {b: [torch.empty(self._numel(b), dtype=plan.dtype) for _ in members.trainers]
                         for b in self.served}  # fmt: skip
        self._flag_scratch = {b: [torch.empty_like(self.flags[b]) for _ in members.trainers] for b in self.served}
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
        start, end = self.plan.segments[b][self.members.rank]
        return end - start

    def _share_of(self, b: int) -> slice:
        return slice(self.offset[b], self.offset[b] + self._numel(b))

    # ------------------------------------------------------------------ gradients, on a thread of their own
    def _receive_syncs(self) -> None:
        members = self.members
        try:
            while True:
                eager = members.recv_object(0, tag=Tag.GRADIENTS)  # trainer 0 starts every synchronization
                if eager is not None:
                    self._apply_hyperparameters(eager)
                arriving = {b: [(members.irecv(tensor, t, Tag.GRADIENTS), t) for t in members.trainers
                                for tensor in (self._scratch[b][t], self._flag_scratch[b][t])]
                            for b in self.served}  # fmt: skip
                sending: list[tuple[dist.Work | None, int]] = []
                for b in self.served:
                    for work, t in arriving[b]:
                        members.wait(work, t, "receive gradients from")
                    _average_in_rank_order(self._scratch[b], members.num_trainers, self.gradients[self._share_of(b)])
                    self.flags[b].zero_()
                    for their_flags in self._flag_scratch[b]:
                        self.flags[b].add_(their_flags)
                    if self.plan.full_gradients:
                        sending += self._send_to_trainers(b, Tag.AVERAGED, self.gradients, self._first_owner(b))
                    if eager is not None:
                        sending += self._step_bucket(b, eager)
                for work, t in sending:
                    members.wait(work, t, "send to")
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

    def _step_bucket(self, b: int, control: dict[str, Any]) -> list[tuple[dist.Work | None, int]]:
        """An armed synchronization: update this server's share of bucket ``b`` now and start sending it to every
        trainer, after a status (1: a non-finite gradient, the share left as it was); the sends' works."""
        sharded = self.optimizers[0]
        pieces = [pc for pc in sharded.pieces if pc.bucket.index == b]
        self._take_gradients(pieces)
        bad = first_nonfinite([(pc.param, pc.tensor.grad) for pc in pieces if pc.tensor.grad is not None]) is not None
        if bad:
            for piece in pieces:
                piece.tensor.grad = None  # this bucket's pieces only: the others step with their own buckets
        else:
            clip = control["clip"]
            if clip is not None:  # by value only: an armed step never clips by norm
                for piece in pieces:
                    if piece.tensor.grad is not None:
                        piece.tensor.grad.clamp_(-clip[1], clip[1])
            sharded.step(**control["kwargs"])
            if b == self.served[-1]:
                self.steps += 1
        status = torch.tensor([1.0 if bad else 0.0], dtype=torch.float64)
        works = []
        for trainer in self.members.trainers:
            works.append((self.members.isend(status, trainer, Tag.WEIGHTS), trainer))
            works.append((self.members.isend(self.layout.storage[self._share_of(b)], trainer, Tag.WEIGHTS), trainer))
        return works

    def _first_owner(self, b: int) -> bool:
        return next(m for m, (s, e) in enumerate(self.plan.segments[b]) if e > s) == self.members.rank

    def _send_to_trainers(
        self, b: int, tag: int, source: Tensor, with_flags: bool = False
    ) -> list[tuple[dist.Work | None, int]]:
        """Start sending this server's share of bucket ``b`` (of ``source``) to every trainer; the works."""
        tensors = [source[self._share_of(b)]] + ([self.flags[b]] if with_flags else [])
        return [(self.members.isend(t, trainer, tag), trainer) for trainer in self.members.trainers for t in tensors]

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
