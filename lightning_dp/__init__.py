"""lightning-dp: data-parallel synchronization schemes as PyTorch Lightning strategies.

Importing the package registers the strategies by name, so ``Trainer(strategy="ring_allreduce")`` works: at
once when Lightning is already imported, otherwise the moment ``lightning.pytorch`` finishes importing. The
package itself does not import Lightning, so :mod:`lightning_dp.comm` (the algorithms on plain
``torch.distributed``) loads without it.
"""

from __future__ import annotations

import importlib
import importlib.abc
import sys
import warnings
from typing import Any

from lightning_dp.comm import errors as _errors
from lightning_dp.comm.errors import *  # noqa: F403 - the error family is part of the top-level API

__version__ = "0.1.0"

_STRATEGY_EXPORTS = (
    "DataParallelStrategy",
    "ParameterServerStrategy",
    "RingAllReduceStrategy",
    "ShardedParameterServerStrategy",
    "register_strategies",
)

__all__ = [
    *_STRATEGY_EXPORTS,
    "CommMonitor",  # noqa: F405 - defined on first access (see __getattr__)
    *_errors.__all__,
    "__version__",
]


def __getattr__(name: str) -> Any:
    if name in _STRATEGY_EXPORTS:
        from lightning_dp import strategies

        return getattr(strategies, name)
    if name == "CommMonitor":
        from lightning_dp.monitor import CommMonitor

        return CommMonitor
    raise AttributeError(f"module 'lightning_dp' has no attribute {name!r}")


def _register() -> None:
    # importing lightning_dp.strategies registers them; if it is importing right now (it imported Lightning),
    # it registers when it finishes
    if "lightning_dp.strategies" not in sys.modules:
        importlib.import_module("lightning_dp.strategies")


def _register_quietly() -> None:
    """From inside Lightning's import: a failure here must not break ``import lightning``."""
    try:
        _register()
    except Exception as error:  # noqa: BLE001 - reported, and raised again on first use of a strategy class
        warnings.warn(f"lightning-dp could not register its strategies with Lightning: {error!r}", stacklevel=2)


class _RegisterWhenLightningLoads(importlib.abc.MetaPathFinder):
    """Runs :func:`_register` right after the module ``lightning.pytorch`` has executed."""

    target = "lightning.pytorch"

    def find_spec(self, fullname, path, target=None):  # noqa: ANN001 - the importlib protocol
        if fullname != self.target:
            return None
        sys.meta_path.remove(self)  # find the real spec with the remaining finders, once
        from importlib.util import find_spec

        spec = find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        execute = spec.loader.exec_module

        def exec_module(module) -> None:  # noqa: ANN001
            execute(module)
            if module.__name__ == self.target:  # a loader may be shared, e.g. one zipimporter per archive
                _register_quietly()

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


if "lightning.pytorch" in sys.modules:
    _register()
elif not any(isinstance(finder, _RegisterWhenLightningLoads) for finder in sys.meta_path):
    sys.meta_path.insert(0, _RegisterWhenLightningLoads())
