"""Handing a running job's state to a new member, from live peers, chunked across them.

The state is any nested structure of dicts, lists and tuples with tensors among its leaves (a Lightning checkpoint's
contents). One member, the *source*, sends its skeleton: the structure with every tensor replaced by a reference
naming its path, shape and dtype. Tensors found on every member alike (``replicated``: the weights and optimizer
state of replicas) are then dealt across all the donors by bytes, each donor sending the ones dealt to it from its own
copy; the others come from the source. Every tensor travels as its bytes, on the host, to every new member at once,
so that the transfer takes about the time of the largest donor's share at the link's rate (torchft hands a recovering
replica its state the same way, split across healthy peers).
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

Path = tuple[Any, ...]


@dataclass(frozen=True)
class TensorRef:
    """Where a tensor of the state was, in the skeleton: its index, path, shape, dtype and whether every donor holds
    it."""

    index: int
    path: Path
    shape: tuple[int, ...]
    dtype: torch.dtype
    replicated: bool

    @property
    def nbytes(self) -> int:
        numel = 1
        for n in self.shape:
            numel *= n
        return numel * torch.empty((), dtype=self.dtype).element_size()


def split_state(state: Any, replicated: Callable[[Path], bool]) -> tuple[Any, list[Tensor]]:
    """``state``'s skeleton (every tensor a :class:`TensorRef`, marked by ``replicated(path)``) and its tensors in
    order."""
    tensors: list[Tensor] = []

    def walk(value: Any, path: Path) -> Any:
        if isinstance(value, Tensor):
            ref = TensorRef(len(tensors), path, tuple(value.shape), value.dtype, replicated(path))
            tensors.append(value)
            return ref
        if isinstance(value, dict):
            return type(value)((k, walk(v, (*path, k))) for k, v in value.items())
        if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
            return type(value)(walk(v, (*path, i)) for i, v in enumerate(value))
        return value

    return walk(state, ()), tensors


def fill_state(skeleton: Any, tensors: Sequence[Tensor]) -> Any:
    """The structure of ``skeleton`` with each :class:`TensorRef` replaced by its tensor."""
    if isinstance(skeleton, TensorRef):
        return tensors[skeleton.index]
    if isinstance(skeleton, dict):
        return type(skeleton)((k, fill_state(v, tensors)) for k, v in skeleton.items())
    if isinstance(skeleton, (list, tuple)) and not hasattr(skeleton, "_fields"):
        return type(skeleton)(fill_state(v, tensors) for v in skeleton)
    return skeleton


def at_path(state: Any, path: Path) -> Any:
    """The value at ``path`` in ``state``."""
    for key in path:
        state = state[key]
    return state


def deal(refs: Sequence[TensorRef], donors: int) -> list[int]:
    """Which donor (an index into the donors, 0 the source) sends each tensor: the replicated ones by bytes, the
    largest first to the donor with the fewest bytes so far; the others from the source."""
    owner = [0] * len(refs)
    load = [0] * donors
    for ref in refs:
        if not ref.replicated:
            load[0] += ref.nbytes
    for ref in sorted((r for r in refs if r.replicated), key=lambda r: (-r.nbytes, r.index)):
        donor = min(range(donors), key=lambda d: (load[d], d))
        owner[ref.index] = donor
        load[donor] += ref.nbytes
    return owner


def _as_bytes(tensor: Tensor) -> Tensor:
    return tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)


@dataclass
class Handover:
    """What one rank moved in a handover: the bytes it sent (a donor) or received (a new member)."""

    bytes: int = 0


def hand_over(
    group: dist.ProcessGroup,
    me: int,
    source: int,
    donors: Sequence[int],
    recipients: Sequence[int],
    state: Callable[[], Any] | None,
    replicated: Callable[[Path], bool],
) -> tuple[Any, Handover]:
    """Move the state from ``donors`` (global ranks; ``source`` among them sends the skeleton and what only it holds)
    to ``recipients`` over ``group``, which holds them all; collective over ``group``. ``state()`` builds this donor's
    state (called on donors only). Returns, on a recipient, the state (its tensors on the host), else ``None``, and
    what this rank moved."""
    moved = Handover()
    skeleton: list[Any] = [None]
    own: Any = None
    if me in donors:
        assert state is not None
        own = state()
    if me == source:
        skeleton[0], _ = split_state(own, replicated)
        moved.bytes += len(pickle.dumps(skeleton[0])) * len(recipients)
    dist.broadcast_object_list(skeleton, group=group, group_src=dist.get_group_rank(group, source))
    refs: list[TensorRef] = []
    _collect(skeleton[0], refs)
    refs.sort(key=lambda r: r.index)
    ordered = [source, *sorted(d for d in donors if d != source)]
    owner = deal(refs, len(ordered))
    works = []
    received: list[Tensor] = []
    if me in ordered:
        mine = ordered.index(me)
        for ref in refs:
            if owner[ref.index] != mine or not ref.nbytes:
                continue
            value = at_path(own, ref.path)
            if not isinstance(value, Tensor) or tuple(value.shape) != ref.shape or value.dtype != ref.dtype:
                raise RuntimeError(
                    f"rank {me} cannot hand over {'/'.join(map(str, ref.path))}: it holds {type(value).__name__} "
                    f"{tuple(getattr(value, 'shape', ()))} where rank {source} holds {ref.dtype} {ref.shape}"
                )
            payload = _as_bytes(value)
            for recipient in recipients:
                works.append(dist.isend(payload, group=group, group_dst=dist.get_group_rank(group, recipient),
                                        tag=ref.index))  # fmt: skip
                moved.bytes += payload.numel()
    elif me in recipients:
        moved.bytes += len(pickle.dumps(skeleton[0]))
        for ref in refs:
            buffer = torch.empty(ref.nbytes, dtype=torch.uint8)
            received.append(buffer)
            if ref.nbytes:
                donor = ordered[owner[ref.index]]
                works.append(dist.irecv(buffer, group=group, group_src=dist.get_group_rank(group, donor),
                                        tag=ref.index))  # fmt: skip
            moved.bytes += ref.nbytes
    for work in works:
        if work is not None:
            work.wait()
    if me not in recipients:
        return None, moved
    tensors = [buffer.view(ref.dtype).reshape(ref.shape) for buffer, ref in zip(received, refs, strict=True)]
    return fill_state(skeleton[0], tensors), moved


def _collect(skeleton: Any, refs: list[TensorRef]) -> None:
    if isinstance(skeleton, TensorRef):
        refs.append(skeleton)
    elif isinstance(skeleton, dict):
        for v in skeleton.values():
            _collect(v, refs)
    elif isinstance(skeleton, (list, tuple)):
        for v in skeleton:
            _collect(v, refs)
