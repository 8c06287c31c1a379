"""An optimizer sharded over the ranks of a group: each rank runs the user's optimizer on its shard only.

The idea of torch's ``ZeroRedundancyOptimizer``, cut at element granularity: the gradient buckets are split into
N shards (e.g. :func:`~lightning_dp.comm.transports.balanced_shards`), and rank ``i`` holds the optimizer state of
shard ``i`` only. A :class:`ShardLayout` maps the shard onto the
parameters once at set-up; a :class:`ShardedOptimizer` runs one user optimizer's class and hyperparameters over
views of this rank's pieces (updates land in the parameters), clips by the global norm, and converts its state
to and from torch's standard, unsharded ``state_dict`` layout.

Exact only for element-wise optimizers (:data:`ELEMENTWISE_OPTIMIZERS`), whose update of an element depends only
on that element's gradient and state.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_dp.comm.buckets import GradientBucket, read_used
from lightning_dp.comm.errors import ConfigurationError, UnsupportedChangeError
from lightning_dp.comm.nonfinite import first_nonfinite
from lightning_dp.comm.transports.ring import Ring, ring_allreduce

#: optimizers whose update of an element depends only on that element's gradient and state, so running them
#: on an arbitrary slice of a tensor gives exactly the slice of the full update
ELEMENTWISE_OPTIMIZERS: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.RMSprop,
    torch.optim.Adagrad,
    torch.optim.Adadelta,
    torch.optim.Rprop,
    torch.optim.ASGD,
)

#: optimizer state entries that are one number per parameter, not one per element (ASGD's eta and mu, the step)
SCALAR_STATE_KEYS = ("step", "eta", "mu")

Segment = tuple[int, int]


def hyperparameters(group: Mapping[str, Any]) -> dict[str, Any]:
    """An optimizer parameter group's settings (lr, betas, ...), without its ``params``."""
    return {k: v for k, v in group.items() if k != "params"}


def check_shardable(optimizer: torch.optim.Optimizer) -> None:
    """Raise :class:`ConfigurationError` unless ``optimizer`` is exact on slices of tensors."""
    if type(optimizer) not in ELEMENTWISE_OPTIMIZERS:
        allowed = ", ".join(cls.__name__ for cls in ELEMENTWISE_OPTIMIZERS)
        raise ConfigurationError(
            f"cannot shard optimizer {type(optimizer).__name__}: it runs the optimizer on slices of tensors, which is "
            f"exact only for element-wise optimizers ({allowed})"
        )


@dataclass
class ShardPiece:
    """The elements ``[start, end)`` of the flattened ``param`` that this rank serves."""

    param: torch.nn.Parameter
    bucket: GradientBucket
    index_in_bucket: int
    start: int
    end: int
    bucket_start: int
    #: the optimizer-facing tensor: a view of the parameter's elements (updates land in the parameter), or of the
    #: layout's own storage (see :class:`ShardLayout`); shaped like the parameter when the piece is all of it
    tensor: Tensor
    #: where the piece starts in the layout's own storage (0 without one)
    storage_start: int = 0

    @property
    def whole(self) -> bool:
        """Whether the piece is the whole parameter."""
        return self.start == 0 and self.end == self.param.numel()

    def take_bucket_gradient(self, used: bool) -> None:
        """The averaged gradient from the bucket (``None`` when no rank ``used`` the parameter)."""
        end = self.bucket_start + self.end - self.start
        self.tensor.grad = self.bucket.buffer[self.bucket_start : end].clone().view_as(self.tensor) if used else None

    def take_param_gradient(self) -> None:
        """This piece of ``param.grad`` (as the gradient hooks left it)."""
        grad = self.param.grad
        if grad is None:
            self.tensor.grad = None
        else:
            self.tensor.grad = grad.detach().reshape(-1)[self.start : self.end].clone().view_as(self.tensor)

    def slice_state(self, key: str, value: Any) -> Any:
        """This piece of one entry of the parameter's full (unsharded) optimizer state."""
        param = self.param
        if (
            isinstance(value, Tensor)
            and value.shape == param.shape
            and (param.dim() > 0 or key not in SCALAR_STATE_KEYS)
        ):
            return value.reshape(-1)[self.start : self.end].clone().view(self.tensor.shape)
        return value.clone() if isinstance(value, Tensor) else value


class ShardLayout:
    """Which elements of which parameters this rank serves, built once from the buckets and their segments.

    ``segments[b][r]`` is the ``(start, end)`` element range of bucket ``b``'s gradient region that rank ``r``
    serves. ``owner`` names the user of the layout in error messages (e.g. ``"strategy 'sharded_ps'"``).

    With ``own_storage`` the pieces are not views of the parameters but of :attr:`storage`, one flat tensor of
    every served element in bucket order (a server's own copy of the weights, initialised from the parameters);
    a piece that is a whole parameter is shaped like it. ``read_params=False`` leaves the storage uninitialised
    (a server whose parameters are shapes only, on the ``meta`` device, and whose weights arrive by message).
    ``split_every``: pieces are also cut wherever their offset in the bucket's range crosses a multiple of it (a
    server stepping its range partition by partition, see :meth:`partition_of`).
    """

    def __init__(
        self,
        buckets: Sequence[GradientBucket],
        segments: Sequence[Sequence[Segment]],
        rank: int,
        owner: str = "a sharded optimizer",
        own_storage: bool = False,
        read_params: bool = True,
        split_every: int = 0,
    ) -> None:
        self.split_every = split_every
        self.pieces: list[ShardPiece] = []
        served = [(b, *segments[b.index][rank]) for b in buckets]
        numel = sum(end - start for _, start, end in served)
        dtype = buckets[0].buffer.dtype if buckets else torch.float32
        #: the served elements, in bucket order (with ``own_storage``; else empty)
        self.storage = torch.empty(numel if own_storage else 0, dtype=dtype)
        self._served = served if own_storage else []
        if read_params:
            self.read_storage()
        offset = 0
        for bucket, start, end in served:
            for i, (p, (lo, hi)) in enumerate(zip(bucket.params, bucket.slices)):
                if max(lo, start) < min(hi, end) and not p.is_contiguous():
                    raise ConfigurationError(f"{owner} needs contiguous parameters")
                for a, b in self._cuts(max(lo, start), min(hi, end), start):
                    at = offset + a - start
                    if own_storage:
                        view = self.storage[at : at + b - a]
                        view = view.view_as(p) if b - a == p.numel() else view
                    else:  # (a whole parameter as itself: an optimizer may read its shape)
                        view = p.detach() if b - a == p.numel() else p.detach().view(-1)[a - lo : b - lo]
                    self.pieces.append(ShardPiece(p, bucket, i, a - lo, b - lo, a, view, at))
            offset += end - start
        self._by_param: dict[int, list[ShardPiece]] = {}
        for piece in self.pieces:
            self._by_param.setdefault(id(piece.param), []).append(piece)

    def _cuts(self, a: int, b: int, start: int) -> list[Segment]:
        """``[a, b)`` (bucket elements; empty if ``b <= a``) cut at every multiple of :attr:`split_every` past
        ``start``."""
        if b <= a:
            return []
        if not self.split_every:
            return [(a, b)]
        every = self.split_every
        cuts = [a, *range(start + ((a - start) // every + 1) * every, b, every), b]
        return list(zip(cuts, cuts[1:]))

    def partition_of(self, piece: ShardPiece, start: int) -> int:
        """Which partition (of :attr:`split_every` elements) of its bucket's range, starting at bucket element
        ``start``, holds ``piece``."""
        return (piece.bucket_start - start) // self.split_every if self.split_every else 0

    def read_storage(self) -> None:
        """Copy the parameters' current values into :attr:`storage` (with ``own_storage``; else nothing to do)."""
        offset = 0
        for bucket, start, end in self._served:
            if end > start:
                bucket.read_params(start, end, self.storage[offset : offset + end - start])
                offset += end - start

    def pieces_of(self, params: Iterable[Tensor]) -> list[ShardPiece]:
        """This rank's pieces of ``params``, in their order."""
        return [piece for p in params for piece in self._by_param.get(id(p), [])]

    def take_bucket_gradients(self) -> None:
        """Every piece's averaged gradient from its bucket."""
        buckets = {id(piece.bucket): piece.bucket for piece in self.pieces}
        used = read_used(list(buckets.values()))
        for piece in self.pieces:
            piece.take_bucket_gradient(used[piece.bucket.index][piece.index_in_bucket])


class ShardedOptimizer:
    """``optimizer`` (the user's, whose ``step`` is never called) run on this rank's shard of its parameters.

    One shard group per parameter group of ``optimizer`` (it may hold no pieces here); learning-rate schedulers
    and ``add_param_group`` act on ``optimizer`` and are followed at each :meth:`step` and checkpoint. ``group``
    is the process group the shards are spread over (its rank ``r`` serves shard ``r``); ``owner`` names the user
    in error messages.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        layout: ShardLayout,
        group: dist.ProcessGroup | None = None,
        owner: str = "the sharded optimizer",
    ) -> None:
        if not all(piece.whole for piece in layout.pieces):  # whole parameters: any optimizer is exact
            check_shardable(optimizer)
        self.optimizer = optimizer
        self.owner = owner
        self.layout = layout
        self.group = group
        self._group_pieces = [layout.pieces_of(g["params"]) for g in optimizer.param_groups]
        accepted = inspect.signature(type(optimizer).__init__).parameters
        defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}
        self.shard = type(optimizer)(
            [self._shard_group(g, pieces) for g, pieces in zip(optimizer.param_groups, self._group_pieces)], **defaults
        )
        #: the parameters of each of ``optimizer``'s groups as the shard mirrors them
        self._mirrored = [[id(p) for p in g["params"]] for g in optimizer.param_groups]
        self._consolidated: dict[str, Any] | None = None
        params = self._params()
        self._device = params[0].device if params else torch.device("cpu")

    @staticmethod
    def _shard_group(group: Mapping[str, Any], pieces: list[ShardPiece]) -> dict[str, Any]:
        return {**hyperparameters(group), "params": [pc.tensor for pc in pieces]}

    @property
    def pieces(self) -> list[ShardPiece]:
        return [pc for pieces in self._group_pieces for pc in pieces]

    @property
    def serves_anything(self) -> bool:
        """Whether this rank holds any piece of the optimizer's parameters (else it never steps)."""
        return any(self._group_pieces)

    def follow_param_groups(self) -> None:
        """Mirror groups added with ``optimizer.add_param_group(...)``; a changed existing group is refused."""
        groups = self.optimizer.param_groups
        for k, (group, ids) in enumerate(zip(groups, self._mirrored)):
            if [id(p) for p in group["params"]] != ids:
                raise UnsupportedChangeError(
                    f"{self.owner}: the parameters of group {k} of {type(self.optimizer).__name__} changed after "
                    "set-up, which the sharded optimizer cannot follow; add new parameters with "
                    "optimizer.add_param_group(...) instead"
                )
        for group in groups[len(self._mirrored) :]:
            pieces = self.layout.pieces_of(group["params"])
            self.shard.add_param_group(self._shard_group(group, pieces))
            self._group_pieces.append(pieces)
            self._mirrored.append([id(p) for p in group["params"]])

    def take_param_gradients(self) -> None:
        """Every piece's gradient from ``param.grad`` (when the hooks may have edited the averaged gradients)."""
        for piece in self.pieces:
            piece.take_param_gradient()

    def gradients(self) -> list[tuple[Tensor, Tensor]]:
        """``(parameter, gradient piece)`` for every piece that has a gradient."""
        return [(pc.param, pc.tensor.grad) for pc in self.pieces if pc.tensor.grad is not None]

    def clip_grad_value_(self, clip_value: float) -> None:
        for _, grad in self.gradients():
            grad.clamp_(-clip_value, clip_value)

    def squared_norm(self) -> Tensor:
        """The sum of the squares of this rank's gradient pieces (float64, one element)."""
        # a dedicated server's template parameters are meta tensors; its pieces live on the CPU
        device = self._device if self._device.type != "meta" else torch.device("cpu")
        squares = torch.zeros(1, dtype=torch.float64, device=device)
        for _, grad in self.gradients():
            squares += grad.detach().double().pow(2).sum()
        return squares

    def has_nonfinite_gradient(self) -> bool:
        return first_nonfinite(self.gradients()) is not None

    def scale_to_norm_(self, max_norm: float, squares: Tensor) -> None:
        """Scale the pieces' gradients as ``torch.nn.utils.clip_grad_norm_`` does for a total 2-norm of
        ``sqrt(squares)`` (the sum over every shard)."""
        coefficient = torch.clamp(max_norm / (squares.sqrt() + 1e-6), max=1.0)
        for _, grad in self.gradients():
            grad.mul_(coefficient.to(grad.dtype))

    def clip_grad_norm_(self, max_norm: float) -> Tensor:
        """Scale the pieces' gradients so that the global 2-norm over all shards is at most ``max_norm`` (the same
        formula as ``torch.nn.utils.clip_grad_norm_``); collective over ``group``. Returns the total norm."""
        squares = self.squared_norm()
        ring_allreduce(squares, op="sum", ring=Ring(self.group))
        self.scale_to_norm_(max_norm, squares)
        return squares.sqrt()

    def apply_clip_(self, clip: tuple[str, float] | None, squares: float) -> None:
        """Lightning's clipping request: ``("norm", max)`` with ``squares`` the sum of squares over every shard, or
        ``("value", v)``; ``None`` clips nothing."""
        if clip is None:
            return
        kind, value = clip
        if kind == "value":
            self.clip_grad_value_(value)
        else:
            self.scale_to_norm_(value, torch.tensor(squares, dtype=torch.float64))

    def voted_step(
        self, clip: tuple[str, float] | None, vote: Callable[[float, bool], tuple[float, bool]], **kwargs: Any
    ) -> bool:
        """The servers' step: Lightning's clipping request ``clip`` (see :meth:`apply_clip_`) and a NaN/inf verdict
        agreed by every server through ``vote(squares, bad) -> (summed squares, any bad)`` (collective), then the
        update. On a bad verdict the pieces' gradients are dropped and nothing changes. Returns whether it stepped."""
        # sync: clipping by norm needs the sum of every shard's squares, which the vote adds up on the host
        squares = float(self.squared_norm()) if clip is not None and clip[0] == "norm" else 0.0
        total, bad = vote(squares, self.has_nonfinite_gradient())
        if bad:
            self.clear_gradients()
            return False
        self.apply_clip_(clip, total)
        self.step(**kwargs)
        return True

    def clear_gradients(self) -> None:
        for piece in self.pieces:
            piece.tensor.grad = None

    def step(
        self,
        scale: Mapping[str, float] | None = None,
        values: Sequence[Mapping[str, Any]] | None = None,
        **kwargs: Any,
    ) -> None:
        """One update of this rank's pieces with their gradients (then dropped), under ``optimizer``'s current
        hyperparameters, or ``values`` per parameter group where given (those of the step's workers), those named in
        ``scale`` multiplied by their factor (e.g. ``{"lr": 0.5}``)."""
        if not self.serves_anything:
            return
        self._follow_hyperparameters(scale, values)
        self.shard.step(**kwargs)
        self.clear_gradients()

    def step_pieces(self, pieces: Sequence[ShardPiece], **kwargs: Any) -> None:
        """:meth:`step` of ``pieces`` only (an element-wise optimizer's partition; their gradients then dropped): the
        shard's groups hold just those tensors for the call, so its cost follows the partition, not the share."""
        if not pieces:
            return
        self._follow_hyperparameters(None)
        chosen = {id(pc.tensor) for pc in pieces}
        held = [group["params"] for group in self.shard.param_groups]
        try:
            for group, tensors in zip(self.shard.param_groups, held):
                group["params"] = [t for t in tensors if id(t) in chosen]
            self.shard.step(**kwargs)
        finally:
            for group, tensors in zip(self.shard.param_groups, held):
                group["params"] = tensors
        for piece in pieces:
            piece.tensor.grad = None

    def _follow_hyperparameters(
        self, scale: Mapping[str, float] | None, values: Sequence[Mapping[str, Any]] | None = None
    ) -> None:
        for index, (front_group, shard_group) in enumerate(zip(self.optimizer.param_groups, self.shard.param_groups)):
            shard_group.update(hyperparameters(front_group))
            if values is not None:
                shard_group.update(values[index])
            for key, factor in (scale or {}).items():
                if key in shard_group and factor != 1.0:
                    shard_group[key] = shard_group[key] * factor

    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds."""
        return sum(v.numel() * v.element_size() for s in self.shard.state.values() for v in s.values()
                   if isinstance(v, Tensor))  # fmt: skip

    # ------------------------------------------------------------------ the standard torch layout
    def _params(self) -> list[Tensor]:
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather every rank's state into the full, unsharded ``state_dict`` on group rank ``to`` (collective: every
        rank of ``group`` calls it); :meth:`state_dict` returns it there."""
        local = self.local_state()
        rank, size = dist.get_rank(self.group), dist.get_world_size(self.group)
        gathered: list | None = [None] * size if rank == to else None
        dist.gather_object(local, gathered, group=self.group, group_dst=to)
        if gathered is None:
            self._consolidated = None
            return
        self.merge_states(gathered)

    def local_state(self) -> list[tuple[int, int, int, dict[str, Any]]]:
        """This rank's pieces of the state: ``(parameter index in the optimizer, start, end, state)`` each, on CPU."""
        self.follow_param_groups()
        index_of = {id(p): k for k, p in enumerate(self._params())}
        shard_tensors = [t for g in self.shard.param_groups for t in g["params"]]
        return [(index_of[id(pc.param)], pc.start, pc.end, _to_cpu(self.shard.state[t]))
                for pc, t in zip(self.pieces, shard_tensors) if t in self.shard.state]  # fmt: skip

    def merge_states(self, gathered: Iterable[list[tuple[int, int, int, dict[str, Any]]]]) -> None:
        """Assemble the full ``state_dict`` (returned by :meth:`state_dict`) in host memory from every rank's
        :meth:`local_state` (loading it puts each rank's slices on its parameters' device)."""
        self.follow_param_groups()
        params = self._params()
        state: dict[int, dict[str, Any]] = {}
        for rank_pieces in gathered:
            for k, start, end, piece_state in rank_pieces:
                full = state.setdefault(k, {})
                for key, value in piece_state.items():
                    if isinstance(value, Tensor) and value.dim() == 1 and value.numel() == end - start:
                        if key not in full:
                            full[key] = torch.zeros(params[k].numel(), dtype=value.dtype)
                        full[key][start:end] = value
                    else:
                        full.setdefault(key, value)
        for k, full in state.items():  # in host memory: on a GPU the whole state would defeat the sharding
            for key, value in full.items():
                if isinstance(value, Tensor) and value.dim() == 1 and value.numel() == params[k].numel():
                    full[key] = value.view_as(params[k])
        self._consolidated = {
            "state": dict(sorted(state.items())),
            "param_groups": self.optimizer.state_dict()["param_groups"],
        }

    def state_dict(self) -> dict[str, Any]:
        """The full state gathered by the last :meth:`consolidate_state_dict` (on the rank it was gathered to)."""
        if self._consolidated is None:
            raise RuntimeError(
                "call consolidate_state_dict() on every rank first; state_dict() answers on its `to` rank"
            )
        return self._consolidated

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Take this rank's slices of a full (standard layout) optimizer state; the user's optimizer takes the
        hyperparameters. Every rank passes the same full state."""
        self.follow_param_groups()
        saved_groups = state_dict["param_groups"]
        if len(self.optimizer.param_groups) != len(saved_groups):
            raise ConfigurationError(
                f"the checkpoint's {type(self.optimizer).__name__} state has {len(saved_groups)} parameter groups, the "
                f"optimizer {len(self.optimizer.param_groups)}: add the same groups before resuming"
            )
        for group, saved_group in zip(self.optimizer.param_groups, saved_groups):
            group.update(hyperparameters(saved_group))
        index_of = {id(p): k for k, p in enumerate(self._params())}
        shard_state: dict[int, dict[str, Any]] = {}
        shard_groups = []
        shard_index = 0
        for pieces, saved_group in zip(self._group_pieces, saved_groups):
            indices = []
            for pc in pieces:
                full = state_dict["state"].get(index_of[id(pc.param)])
                if full is not None:
                    shard_state[shard_index] = {key: pc.slice_state(key, value) for key, value in full.items()}
                indices.append(shard_index)
                shard_index += 1
            shard_groups.append({**hyperparameters(saved_group), "params": indices})
        self.shard.load_state_dict({"state": shard_state, "param_groups": shard_groups})


def _to_cpu(piece_state: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v.detach().cpu().clone() if isinstance(v, Tensor) else v for k, v in piece_state.items()}
