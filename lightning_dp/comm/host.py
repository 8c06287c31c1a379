"""Objects that leave this process as pickles carry host tensors only.

A pickled CUDA tensor is rebuilt on the device index it was saved from: a CPU-only dedicated server cannot read it at
all, and another rank creates a CUDA context on that GPU to read it (half a GiB, or an error where GPUs run in
exclusive-process mode). :func:`to_host` copies every tensor of an object to host memory first.
"""

from __future__ import annotations

from typing import Any

import torch


def to_host(obj: Any) -> Any:
    """``obj`` with every tensor in it (inside dicts, lists and tuples, at any depth) in host memory: a CPU tensor as it
    is, any other a detached CPU copy; dicts come back as plain dicts, everything else as it is."""
    if isinstance(obj, torch.Tensor):
        return obj if obj.device.type == "cpu" else obj.detach().to("cpu")
    if isinstance(obj, dict):
        return {key: to_host(value) for key, value in obj.items()}
    if type(obj) in (list, tuple):
        return type(obj)(to_host(value) for value in obj)
    return obj
