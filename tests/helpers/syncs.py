"""Where the exchange path makes the host wait for the device, checked against the places that say why.

A line of ``lightning_dp`` that may synchronize with a CUDA device on purpose says so in a comment starting with
``# sync:``, on the line itself or on the comment lines right above it (``docs/gpus.md`` lists them). Two recorders
attribute what they see to the innermost ``lightning_dp`` line of the stack:

- :class:`HostReads` (CPUs): every read of a tensor's values by the host (``tolist``, ``item``, ``bool``, ``float``,
  ``int``) and every write of a Python number into an element (``t[i] = 1``, a host copy into the device), each of
  which on a GPU waits for the device;
- :func:`cuda_syncs` (GPUs): every synchronizing call ``torch.cuda.set_sync_debug_mode("warn")`` reports.
"""

from __future__ import annotations

import linecache
import sys
import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

import lightning_dp

PACKAGE = Path(lightning_dp.__file__).resolve().parent
#: tensor methods that hand the host a tensor's values
READS = {"tolist", "item", "__bool__", "__float__", "__int__", "__index__", "numpy"}
MARKER = "# sync:"

Site = tuple[str, int]  # (file, line)


def in_package(filename: str) -> bool:
    return Path(filename).resolve().is_relative_to(PACKAGE)


def marked(site: Site) -> bool:
    """Whether the package line at ``site`` says why it synchronizes (see the module docstring)."""
    filename, lineno = site
    if not in_package(filename):
        return False
    if MARKER in linecache.getline(filename, lineno):
        return True
    above = lineno - 1
    while above > 0 and linecache.getline(filename, above).strip().startswith("#"):
        if MARKER in linecache.getline(filename, above):
            return True
        above -= 1
    return False


def describe(site: Site) -> str:
    filename, lineno = site
    where = Path(filename).resolve().relative_to(PACKAGE.parent) if in_package(filename) else filename
    return f"{where}:{lineno}: {linecache.getline(*site).strip()}"


class HostReads(TorchFunctionMode):
    """Records the package line of every host read of a tensor's values, and of every Python number written into a
    tensor, made inside it (modes are per thread: enter it on every thread that runs the exchanges)."""

    def __init__(self, sites: list[Site]) -> None:
        super().__init__()
        self.sites = sites
        self._lock = threading.Lock()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in READS or (name == "__setitem__" and isinstance(args[2], (int, float, bool))):
            frame = sys._getframe(1)
            while frame is not None and not in_package(frame.f_code.co_filename):
                frame = frame.f_back
            if frame is not None:
                with self._lock:
                    self.sites.append((frame.f_code.co_filename, frame.f_lineno))
        return func(*args, **(kwargs or {}))


@contextmanager
def cuda_syncs(sites: list[Site]) -> Iterator[None]:
    """Inside: every synchronizing CUDA call of any thread, as the line it came from (a package line, or any other
    for a call from elsewhere, which is never :func:`marked`)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode(0)
    sites.extend((w.filename, w.lineno) for w in caught if "synchroniz" in str(w.message))
