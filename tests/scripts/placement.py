"""Where a test script's ranks run, from the variables a test sets for it (see ``tests/test_gpu.py``).

- ``LIGHTNING_DP_TEST_ACCELERATOR``: ``"cpu"`` (default) or ``"gpu"``.
- ``LIGHTNING_DP_TEST_BACKEND``: the process-group backend of every strategy, ``ddp`` included (default: each
  strategy's own, NCCL on GPUs, gloo on CPUs).
- ``LIGHTNING_DP_TEST_NODES``: the ranks are that many single-device nodes, each process started by the test with
  ``NODE_RANK`` (two ranks sharing one GPU), instead of one node whose ranks Lightning's launcher starts.
- ``LIGHTNING_DP_TEST_TIMEOUT``: the strategies' ``timeout`` in seconds, where a script sets one (a GPU's first
  ``torch.compile`` of a backward can keep one rank away from the others for longer than a CPU test allows).
"""

from __future__ import annotations

import os
from typing import Any

ACCELERATOR = os.environ.get("LIGHTNING_DP_TEST_ACCELERATOR", "cpu")
BACKEND = os.environ.get("LIGHTNING_DP_TEST_BACKEND") or None
NODES = int(os.environ.get("LIGHTNING_DP_TEST_NODES") or 0)
TIMEOUT = float(os.environ["LIGHTNING_DP_TEST_TIMEOUT"]) if os.environ.get("LIGHTNING_DP_TEST_TIMEOUT") else None


def timeout(default: float) -> float:
    """The strategies' ``timeout``: ``LIGHTNING_DP_TEST_TIMEOUT`` if set, else the script's ``default``."""
    return TIMEOUT if TIMEOUT is not None else default


def trainer_placement(devices: int, num_nodes: int = 1) -> dict[str, Any]:
    """The Trainer's ``accelerator``, ``devices`` and ``num_nodes`` for ``devices`` ranks on each of ``num_nodes``
    nodes (with single-device nodes started by the test: ``devices`` ranks in all)."""
    if NODES:
        assert devices == NODES, f"{devices} ranks asked for, {NODES} single-device nodes started"
        return {"accelerator": ACCELERATOR, "devices": 1, "num_nodes": NODES}
    return {"accelerator": ACCELERATOR, "devices": devices, "num_nodes": num_nodes}


def backend_options() -> dict[str, Any]:
    """Strategy options that set the backend (none: the strategy's default)."""
    return {"process_group_backend": BACKEND} if BACKEND else {}


def ddp(**options: Any) -> Any:
    """Lightning's ``DDPStrategy`` with ``options`` on the chosen backend."""
    from lightning.pytorch.strategies import DDPStrategy

    return DDPStrategy(**options, **backend_options())
