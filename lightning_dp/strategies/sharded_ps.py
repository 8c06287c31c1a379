"""``sharded_ps``: every rank serves 1/N of the parameters and holds 1/N of the optimizer state."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Mapping, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_dp.comm.buckets import GradientBucket
from lightning_dp.comm.parameter_server import pull_shards, push_shards, shard_segments
from lightning_dp.comm.ring import Ring, ring_allreduce
from lightning_dp.strategies.base import ParameterServerBase, _unwrap, hyperparameters
from typing_extensions import override

#: optimizers whose update of an element depends only on that element's gradient and state, so running them
#: on an arbitrary slice of a tensor gives exactly the slice of the full update
ELEMENTWISE_OPTIMIZERS = (
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


@dataclass
class ShardPiece:
    """The elements ``[start, end)`` of the flattened ``param`` that this rank serves."""

    param: torch.nn.Parameter
    bucket: GradientBucket
    index_in_bucket: int
    start: int
    end: int
    bucket_start: int
    #: the optimizer-facing tensor: a view of the parameter's elements (updates land in the parameter)
    tensor: Tensor


class ShardedParameterServerStrategy(ParameterServerBase):
    """Parameter server sharded over all ranks.

    The gradient buckets, laid end to end, are cut into N shards of equal bytes at element granularity, so
    one huge tensor cannot unbalance them; rank ``i`` serves shard ``i``. During backward every rank pushes
    shard ``i`` of each finished bucket to rank ``i``, which averages it. At the step, rank ``i`` runs the
    user's optimizer on its shard only (an optimizer of the same class and hyperparameters over views of the
    parameters, so its state is 1/N of the total), then every rank sends its updated shard to all others.
    Each rank moves ``2 (N - 1) / N S`` bytes per step, like the ring.

    Gradient clipping by norm uses the global norm, summed across shards. Only element-wise optimizers
    (``ELEMENTWISE_OPTIMIZERS``) can run on slices of tensors; others are refused at set-up.

    Args: see :class:`~lightning_dp.strategies.base.DataParallelStrategy`.
    """

    strategy_name = "sharded_ps"

    def _check_optimizers(self) -> None:
        super()._check_optimizers()
        for optimizer in map(_unwrap, self.optimizers):
            if type(optimizer) not in ELEMENTWISE_OPTIMIZERS:
                allowed = ", ".join(cls.__name__ for cls in ELEMENTWISE_OPTIMIZERS)
                raise ValueError(
                    f"strategy {self.strategy_name!r} cannot shard optimizer {type(optimizer).__name__}: it runs the "
                    f"optimizer on slices of tensors, which is exact only for element-wise optimizers ({allowed}). "
                    "Use strategy='parameter_server' or 'ring_allreduce' for this optimizer."
                )

    def _setup_gradient_sync(self) -> None:
        super()._setup_gradient_sync()
        assert self.reducer is not None
        self._ring = Ring(self.gradient_group)
        rank, size = self._ring.rank, self._ring.size
        buckets = self.reducer.buckets
        self.segments = shard_segments(
            [b.grad_numel for b in buckets], [b.buffer.element_size() for b in buckets], size
        )
        self.pieces: list[ShardPiece] = []
        for bucket, segments in zip(buckets, self.segments):
            start, end = segments[rank]
            for i, (p, (lo, hi)) in enumerate(zip(bucket.params, bucket.slices)):
                a, b = max(lo, start), min(hi, end)
                if a < b:
                    if not p.is_contiguous():
                        raise ValueError(f"strategy {self.strategy_name!r} needs contiguous parameters")
                    view = p.detach().view(-1)[a - lo : b - lo]
                    self.pieces.append(ShardPiece(p, bucket, i, a - lo, b - lo, a, view))
        self._shard_optimizers = [self._make_shard_optimizer(_unwrap(o)) for o in self.optimizers]
        #: the parameters of each optimizer's groups as the shard optimizers mirror them
        self._mirrored_groups = [[[id(p) for p in g["params"]] for g in _unwrap(o).param_groups] for o in self.optimizers]
        self._patch_gradient_clipping()

    def _pieces_of(self, optimizer: torch.optim.Optimizer) -> list[list[ShardPiece]]:
        """This rank's pieces of each of ``optimizer``'s parameter groups."""
        by_param: dict[int, list[ShardPiece]] = {}
        for piece in self.pieces:
            by_param.setdefault(id(piece.param), []).append(piece)
        return [[pc for p in group["params"] for pc in by_param.get(id(p), [])] for group in optimizer.param_groups]

    def _make_shard_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """The user's optimizer class and hyperparameters over this rank's pieces, one group per front group (a
        group may be empty here)."""
        shard_groups = [
            {**hyperparameters(group), "params": [pc.tensor for pc in pieces]}
            for group, pieces in zip(optimizer.param_groups, self._pieces_of(optimizer))
        ]
        accepted = inspect.signature(type(optimizer).__init__).parameters
        defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}
        return type(optimizer)(shard_groups, **defaults)

    def _optimizer_index(self, optimizer: torch.optim.Optimizer) -> int:
        for index, front in enumerate(self.optimizers):
            if _unwrap(front) is optimizer:
                return index
        raise KeyError("optimizer is not one of the strategy's optimizers")

    def _shard_optimizer_for(self, optimizer: torch.optim.Optimizer) -> Optional[torch.optim.Optimizer]:
        shard = self._shard_optimizers[self._optimizer_index(optimizer)]
        return shard if any(g["params"] for g in shard.param_groups) else None

    def _add_new_param_groups(self, optimizer: torch.optim.Optimizer) -> None:
        """Follow ``optimizer.add_param_group(...)`` during fit: the shard optimizer gains this rank's pieces of the
        new groups. Changing the parameters of an existing group is refused."""
        index = self._optimizer_index(optimizer)
        mirrored, groups = self._mirrored_groups[index], optimizer.param_groups
        for k, (group, ids) in enumerate(zip(groups, mirrored)):
            if [id(p) for p in group["params"]] != ids:
                raise RuntimeError(
                    f"strategy {self.strategy_name!r}: the parameters of group {k} of {type(optimizer).__name__} "
                    "changed after set-up, which the sharded optimizer cannot follow; add new parameters with "
                    "optimizer.add_param_group(...) instead"
                )
        shard = self._shard_optimizers[index]
        for group, pieces in zip(groups[len(mirrored) :], self._pieces_of(optimizer)[len(mirrored) :]):
            shard.add_param_group({**hyperparameters(group), "params": [pc.tensor for pc in pieces]})
            mirrored.append([id(p) for p in group["params"]])

    # ------------------------------------------------------------------ communication
    def _reduce_bucket(self, bucket: GradientBucket) -> None:
        gradients, segments = bucket.buffer[: bucket.grad_numel], self.segments[bucket.index]
        push_shards(gradients, segments, self.gradient_group, self.comm_stats)
        # every server needs to know which of its parameters some rank used: sum the flags everywhere (one small
        # extra message per bucket, P flags)
        ring_allreduce(bucket.flags, op="sum", stats=self.comm_stats, ring=self._ring)
        if self.full_gradients:  # every server sends its averaged shard to all, for every rank's hooks
            pull_shards(gradients, segments, self.gradient_group, self.comm_stats)

    @override
    def _gradients_before_hooks(self, optimizer: torch.optim.Optimizer) -> None:
        # once per synchronization, for every optimizer's pieces: the pull after this step overwrites the buckets,
        # and a step without a backward (nothing fresh) keeps no gradient
        assert self.reducer is not None
        self._add_new_param_groups(optimizer)
        if self.full_gradients or not self.reducer.fresh:
            return
        for pc in self.pieces:
            used = bool(pc.bucket.flags[pc.index_in_bucket] != 0)
            pc.tensor.grad = pc.bucket.buffer[pc.bucket_start : pc.bucket_start + pc.end - pc.start].clone() if used else None
        self.reducer.fresh = False

    @override
    def _gradients_after_hooks(self, optimizer: torch.optim.Optimizer) -> None:
        # every rank holds the averaged gradients in param.grad, as edited by the hooks and clipped
        if not self.full_gradients:
            return
        for pieces in self._pieces_of(optimizer):
            for pc in pieces:
                grad = pc.param.grad
                pc.tensor.grad = None if grad is None else grad.detach().reshape(-1)[pc.start : pc.end].clone()

    def _server_gradients(self, optimizer: torch.optim.Optimizer) -> list:
        return [(pc.param, pc.tensor.grad) for pieces in self._pieces_of(optimizer) for pc in pieces
                if pc.tensor.grad is not None]  # fmt: skip

    def _server_update(self, optimizer: torch.optim.Optimizer, **kwargs: Any) -> None:
        shard = self._shard_optimizer_for(optimizer)
        if shard is None:
            return
        for front_group, shard_group in zip(optimizer.param_groups, shard.param_groups):
            shard_group.update(hyperparameters(front_group))  # LR schedulers act on the front
        shard.step(**kwargs)
        for group in shard.param_groups:
            for t in group["params"]:
                t.grad = None

    def _pull(self, optimizer: torch.optim.Optimizer) -> None:
        assert self.reducer is not None
        rank = self._ring.rank
        for bucket in self._buckets_of(optimizer):
            segments = self.segments[bucket.index]
            bucket.pack_params(*segments[rank])
            pull_shards(bucket.buffer[: bucket.grad_numel], segments, self.gradient_group, self.comm_stats)
            bucket.unpack_params()

    # ------------------------------------------------------------------ gradient clipping across shards
    def _patch_gradient_clipping(self) -> None:
        plugin = self.precision_plugin
        plugin.clip_grad_by_norm = self._clip_grad_by_norm  # type: ignore[method-assign]
        plugin.clip_grad_by_value = self._clip_grad_by_value  # type: ignore[method-assign]

    def _shard_grads(self, optimizer: torch.optim.Optimizer) -> list[Tensor]:
        return [pc.tensor.grad for pieces in self._pieces_of(optimizer) for pc in pieces if pc.tensor.grad is not None]

    def _clip_grad_by_value(self, optimizer: torch.optim.Optimizer, clip_val: float) -> None:
        if self.full_gradients:  # param.grad holds the averaged gradients everywhere: clip them as Lightning does
            type(self.precision_plugin).clip_grad_by_value(self.precision_plugin, optimizer, clip_val)
            return
        for grad in self._shard_grads(_unwrap(optimizer)):
            grad.clamp_(-clip_val, clip_val)

    def _clip_grad_by_norm(self, optimizer: torch.optim.Optimizer, clip_val: float) -> None:
        if self.full_gradients:
            type(self.precision_plugin).clip_grad_by_norm(self.precision_plugin, optimizer, clip_val)
            return
        grads = self._shard_grads(_unwrap(optimizer))
        device = self.root_device
        squares = torch.zeros(1, dtype=torch.float64, device=device)
        for grad in grads:
            squares += grad.detach().double().pow(2).sum()
        ring_allreduce(squares, op="sum", ring=self._ring)
        total_norm = squares.sqrt()
        # the same formula as torch.nn.utils.clip_grad_norm_
        coefficient = torch.clamp(clip_val / (total_norm + 1e-6), max=1.0)
        for grad in grads:
            grad.mul_(coefficient.to(grad.dtype))

    def _stepping_optimizers(self) -> list[torch.optim.Optimizer]:
        return [o for o in self._shard_optimizers if any(g["params"] for g in o.param_groups)]

    # ------------------------------------------------------------------ checkpoints in the standard torch layout
    def _front_params(self, optimizer: torch.optim.Optimizer) -> list[torch.nn.Parameter]:
        return [p for group in optimizer.param_groups for p in group["params"]]

    def optimizer_state(self, optimizer: Any) -> dict:
        """The full optimizer state, consolidated from every shard, on rank 0 (every rank must call it)."""
        optimizer = _unwrap(optimizer)
        self._add_new_param_groups(optimizer)
        shard = self._shard_optimizer_for(optimizer)
        index_of = {id(p): k for k, p in enumerate(self._front_params(optimizer))}
        local = []
        if shard is not None:
            pieces = [pc for group in self._pieces_of(optimizer) for pc in group]
            for pc, t in zip(pieces, [t for g in shard.param_groups for t in g["params"]]):
                if t in shard.state:
                    local.append((index_of[id(pc.param)], pc.start, pc.end, _to_cpu(shard.state[t])))
        gathered = [None] * self.world_size if self.is_global_zero else None
        dist.gather_object(local, gathered, dst=0)
        if not self.is_global_zero:
            return {}
        params = self._front_params(optimizer)
        state: dict[int, dict] = {}
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
        for k, full in state.items():
            for key, value in full.items():
                if isinstance(value, Tensor) and value.dim() == 1 and value.numel() == params[k].numel():
                    full[key] = value.view_as(params[k]).to(params[k].device)
        front = optimizer.state_dict()
        return {"state": dict(sorted(state.items())), "param_groups": front["param_groups"]}

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Each rank takes its shard's slice of a full (standard layout) optimizer state."""
        for front, shard, saved in zip(self.optimizers, self._shard_optimizers, checkpoint["optimizer_states"]):
            front = _unwrap(front)
            self._add_new_param_groups(front)  # groups added before the checkpoint is loaded (e.g. in on_fit_start)
            if len(front.param_groups) != len(saved["param_groups"]):
                raise ValueError(
                    f"the checkpoint's {type(front).__name__} state has {len(saved['param_groups'])} parameter groups, "
                    f"the optimizer {len(front.param_groups)}: add the same groups before resuming"
                )
            for group, saved_group in zip(front.param_groups, saved["param_groups"]):
                group.update(hyperparameters(saved_group))
            params = self._front_params(front)
            index_of = {id(p): k for k, p in enumerate(params)}
            shard_state, shard_index = {}, 0
            shard_groups = []
            for pieces, saved_group in zip(self._pieces_of(front), saved["param_groups"]):
                indices = []
                for pc in pieces:
                    full = saved["state"].get(index_of[id(pc.param)])
                    if full is not None:
                        shard_state[shard_index] = {
                            key: _slice_state(key, value, pc, params[index_of[id(pc.param)]])
                            for key, value in full.items()
                        }
                    indices.append(shard_index)
                    shard_index += 1
                shard_groups.append({**hyperparameters(saved_group), "params": indices})
            shard.load_state_dict({"state": shard_state, "param_groups": shard_groups})

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        description = "Data parallel with a parameter server sharded over all ranks (1/N of the optimizer state each)"
        cls._register_variants(strategy_registry, cls.strategy_name, description)
        cls._register_variants(strategy_registry, "sharded_parameter_server", description)


def _to_cpu(piece_state: dict) -> dict:
    return {k: v.detach().cpu().clone() if isinstance(v, Tensor) else v for k, v in piece_state.items()}


#: optimizer state entries that are one number per parameter, not one per element (ASGD's eta and mu, the step)
SCALAR_STATE_KEYS = ("step", "eta", "mu")


def _slice_state(key: str, value: Any, piece: ShardPiece, param: torch.nn.Parameter) -> Any:
    if isinstance(value, Tensor) and value.shape == param.shape and (param.dim() > 0 or key not in SCALAR_STATE_KEYS):
        return value.reshape(-1)[piece.start : piece.end].clone()
    return value.clone() if isinstance(value, Tensor) else value
