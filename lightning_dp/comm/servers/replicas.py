"""Chain replication of the servers' optimizer state, so that no state is lost with any single rank.

The servers' state is cut into shards by ``segments[b][r]`` (the range of bucket ``b`` that group rank ``r``
serves: N balanced shards for the sharded servers, everything on one rank for the central server). Each rank's
shard has a replica on its successor in the chain, :func:`chain_successor` (Li et al., "Scaling Distributed Machine
Learning with the Parameter Server", OSDI 2014, replicate a server's key range on its neighbour):

- at every step the owner forwards its shard's averaged gradient to the successor (:func:`post_forward`, one more
  message of the shard's size; :meth:`ShardReplica.post_receive` on the successor), and the successor steps its
  :class:`ShardReplica` with it, under the same hyperparameters and clipping, from the same weights, so the replica's
  state stays the owner's, bit for bit, without ever shipping state;
- when ranks are lost, the survivors assemble the full optimizer state from their own shards and the replicas of
  the lost ones (:func:`survivors_state`, :func:`gather_full_state`) and cut it again over themselves
  (:meth:`~.sharded_optimizer.ShardedOptimizer.load_state_dict` on the new layout), building new replicas the
  same way; when new ranks are admitted, the members assemble it from their own shards (a new rank holds nothing
  yet) and cut it again over the grown membership, the new ranks' shards and replicas included.

One replica per shard: two neighbours in the chain lost together take a shard with them
(:func:`check_recoverable` says so by name).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_dp.comm.buckets import GradientBucket, read_used
from lightning_dp.comm.servers.sharded_optimizer import Segment, ShardedOptimizer, ShardLayout

#: a rank's share of the state as :meth:`~.sharded_optimizer.ShardedOptimizer.local_state` gives it
LocalState = list[tuple[int, int, int, dict[str, Any]]]


def chain_successor(rank: int, size: int) -> int:
    """The group rank that holds the replica of group rank ``rank``'s shard (the next one, cyclically)."""
    return (rank + 1) % size


def chain_predecessor(rank: int, size: int) -> int:
    """The group rank whose shard group rank ``rank`` holds the replica of."""
    return (rank - 1) % size


class ReplicaLostError(RuntimeError):
    """A shard and its replica were lost together: its optimizer state is gone."""


def check_recoverable(lost: Iterable[int], size: int) -> None:
    """Raise :class:`ReplicaLostError` where a lost group rank's successor (its replica) is lost too."""
    gone = set(lost)
    if len(gone) >= size:
        raise ReplicaLostError(f"every one of the {size} ranks holding the servers' state is lost")
    both = sorted(r for r in gone if chain_successor(r, size) in gone)
    if both:
        pairs = ", ".join(f"rank {r} and its replica on rank {chain_successor(r, size)}" for r in both)
        raise ReplicaLostError(
            f"lost {pairs} at once: the servers' state of {'those shards' if len(both) > 1 else 'that shard'} had "
            "one replica each and is gone; restart the run from its last checkpoint"
        )


class ShardReplica:
    """The replica of group rank ``owner``'s shard of the state of ``optimizers`` (held by its chain successor): one
    :class:`~.sharded_optimizer.ShardedOptimizer` per optimizer, as the owner runs them.

    Its pieces live in storage of their own (:class:`~.sharded_optimizer.ShardLayout` with ``own_storage``): before
    each step they take the weights from the parameters (this rank holds every weight before the step) and the
    gradients from :attr:`gradients`, where the owner's forwarded shard arrives, or from ``param.grad``; the update
    then lands in the replica's storage only."""

    def __init__(
        self,
        optimizers: Sequence[torch.optim.Optimizer],
        buckets: Sequence[GradientBucket],
        segments: Sequence[Sequence[Segment]],
        owner: int,
        name: str = "a shard replica",
    ) -> None:
        self.owner = owner
        self.buckets = list(buckets)
        self.layout = ShardLayout(buckets, segments, owner, name, own_storage=True, read_params=False)
        #: one per optimizer, in order
        self.sharded = [ShardedOptimizer(optimizer, self.layout, owner=name) for optimizer in optimizers]
        #: the owner's averaged gradients of its shard, in the layout's storage order (bucket by bucket)
        self.gradients = torch.zeros_like(self.layout.storage)
        self._ranges: dict[int, tuple[int, int]] = {}
        offset = 0
        for bucket in buckets:
            start, end = segments[bucket.index][owner]
            self._ranges[bucket.index] = (offset, offset + max(0, end - start))
            offset += max(0, end - start)

    def incoming(self, bucket: GradientBucket) -> Tensor:
        """Where the owner's averaged gradients of ``bucket`` arrive (empty where it serves none of it)."""
        start, end = self._ranges[bucket.index]
        return self.gradients[start:end]

    def weights_of(self, bucket: GradientBucket) -> Tensor:
        """The replica's weights of the owner's segment of ``bucket`` (after :meth:`step`: the owner's new ones)."""
        start, end = self._ranges[bucket.index]
        return self.layout.storage[start:end]

    def post_receive(self, bucket: GradientBucket, group: dist.ProcessGroup | None = None) -> dist.Work | None:
        """Receive the owner's forwarded gradients of ``bucket`` (see :func:`post_forward`); ``None``: nothing to."""
        incoming = self.incoming(bucket)
        if not incoming.numel():
            return None
        return dist.irecv(incoming, group=group, group_src=self.owner)

    def take_gradients(self) -> None:
        """The weights before the step from the parameters, and each piece's gradient from :attr:`gradients`
        (``None`` where no rank used the parameter, as the owner has it)."""
        self.layout.read_storage()
        used = read_used(self.buckets)
        for piece in self.layout.pieces:
            if used[piece.bucket.index][piece.index_in_bucket]:
                at = piece.storage_start
                piece.tensor.grad = self.gradients[at : at + piece.end - piece.start].clone().view_as(piece.tensor)
            else:
                piece.tensor.grad = None

    def take_param_gradients(self) -> None:
        """The weights before the step from the parameters, and each piece's gradient from ``param.grad`` (where
        every rank holds the averaged gradients as the hooks left them, and the owner takes its pieces alike)."""
        self.layout.read_storage()
        for piece in self.layout.pieces:
            piece.take_param_gradient()

    def step(self, index: int = 0, clip: tuple[str, float] | None = None, squares: float = 0.0, **kwargs: Any) -> None:
        """The owner's update of its shard by optimizer ``index``, on the replica: the same clipping (``squares``: the
        sum over every shard, as the owner used it) and the optimizer's current hyperparameters."""
        self.sharded[index].apply_clip_(clip, squares)
        self.sharded[index].step(**kwargs)

    @property
    def weights(self) -> Tensor:
        """The replica's weights of the shard, in bucket order (after :meth:`step`: the owner's new weights)."""
        return self.layout.storage

    def local_state(self, index: int = 0) -> LocalState:
        """The replica's state of optimizer ``index``, as the owner's
        :meth:`~.sharded_optimizer.ShardedOptimizer.local_state` gives it."""
        return self.sharded[index].local_state()

    def load_state_dict(self, state_dict: dict[str, Any], index: int = 0) -> None:
        """Take the owner's slices of optimizer ``index``'s full (standard layout) state, as the owner does."""
        self.sharded[index].load_state_dict(state_dict)


def post_forward(
    bucket: GradientBucket, segments: Sequence[Sequence[Segment]], group: dist.ProcessGroup | None = None
) -> dist.Work | None:
    """Send this rank's averaged gradients of ``bucket`` (its own segment, after the push) to its chain successor;
    ``None`` where it serves none of the bucket or is alone."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    start, end = segments[bucket.index][rank]
    if size == 1 or end <= start:
        return None
    return dist.isend(bucket.buffer[start:end], group=group, group_dst=chain_successor(rank, size))


def survivors_state(
    own: ShardedOptimizer, replica: ShardReplica | None, lost: Iterable[int], index: int = 0
) -> LocalState:
    """What this surviving rank contributes to optimizer ``index``'s full state after the ranks ``lost`` (old group
    ranks): its own shard's state, and its replica's where the replica's owner is among them."""
    pieces = own.local_state()
    if replica is not None and replica.owner in set(lost):
        pieces += replica.local_state(index)
    return pieces


def gather_full_state(
    own: ShardedOptimizer, mine: LocalState, group: dist.ProcessGroup | None = None
) -> dict[str, Any]:
    """``own``'s optimizer's full state (torch's standard layout, in host memory) on every rank of ``group`` from each
    rank's pieces ``mine`` (a survivor's :func:`survivors_state`, a member's own shard after an admission, nothing
    from a new member; collective over ``group``)."""
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    own.merge_states(everyone)
    return own.state_dict()
