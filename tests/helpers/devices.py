"""Tensors that say they live on a CUDA device, for CPU tests of what must never reach another process or rank as a
device tensor: :class:`OnDevice` reports ``cuda:1`` (``is_cuda`` is true) while its values stay in host memory;
``.cpu()`` and ``.to("cpu")`` give plain CPU tensors, any other operation another :class:`OnDevice`."""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_map


class OnDevice(torch.Tensor):
    """A tensor reporting ``device`` (default ``cuda:1``) over the host tensor ``inner``."""

    inner: torch.Tensor

    @staticmethod
    def __new__(cls, inner: torch.Tensor, device: str | torch.device = "cuda:1"):
        return torch.Tensor._make_wrapper_subclass(
            cls, inner.shape, dtype=inner.dtype, device=torch.device(device), strides=inner.stride()
        )

    def __init__(self, inner: torch.Tensor, device: str | torch.device = "cuda:1") -> None:
        self.inner = inner

    def __repr__(self) -> str:
        return f"OnDevice({self.inner!r}, device={str(self.device)!r})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        devices = []

        def unwrap(t):
            if isinstance(t, OnDevice):
                devices.append(t.device)
                return t.inner
            return t

        out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))
        target = kwargs.get("device")
        if func is torch.ops.aten._to_copy.default and target is not None and torch.device(target).type == "cpu":
            return out
        return tree_map(lambda t: OnDevice(t, devices[0]) if isinstance(t, torch.Tensor) else t, out)


def tensors_in(obj) -> list[torch.Tensor]:
    """Every tensor inside ``obj`` (dicts, lists, tuples, at any depth)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for value in obj.values() for t in tensors_in(value)]
    if isinstance(obj, (list, tuple)):
        return [t for value in obj for t in tensors_in(value)]
    return []
