"""The private Lightning behaviour lightning-dp relies on, pinned, so that an upgrade that changes it fails here."""

from __future__ import annotations

import inspect

import lightning
import pytest

pytestmark = pytest.mark.unit


def test_private_symbols_exist_with_the_signatures_used():
    from lightning_dp import _lightning_compat as compat

    for name in compat.__all__:
        assert callable(getattr(compat, name)) or name == "TESTED_LIGHTNING", name
    from lightning.pytorch.plugins.precision import Precision

    assert list(inspect.signature(Precision._after_closure).parameters) == ["self", "model", "optimizer"]
    assert list(inspect.signature(Precision._wrap_closure).parameters) == ["self", "model", "optimizer", "closure"]
    assert list(inspect.signature(compat._sync_ddp_if_available).parameters)[:3] == ["result", "group", "reduce_op"]
    from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop

    # replaced by the parameter servers with staleness != 0 (a collective before every step, and in the handler)
    assert list(inspect.signature(_TrainingEpochLoop._broadcast_sigterm_tensor).parameters) == ["self"]
    from lightning.pytorch.trainer.connectors.signal_connector import _SignalConnector

    assert list(inspect.signature(_SignalConnector._sigterm_notifier_fn).parameters) == ["self", "signum", "_"]
    source = inspect.getsource(_SignalConnector.register_signal_handlers)
    assert "self._sigterm_notifier_fn" in source  # read when handlers are registered, after the strategy's set-up
    # exact mid-epoch resume rebuilds the training loader and silences the loop's resumability warning for it
    assert list(inspect.signature(compat._update_dataloader).parameters)[:3] == ["dataloader", "sampler", "mode"]
    assert list(inspect.signature(compat._parse_num_batches).parameters) == ["stage", "length", "limit_batches"]
    from lightning_dp.strategies.resume import _NOT_RESUMABLE

    reset = inspect.getsource(_TrainingEpochLoop.reset)
    assert "isinstance(loader, _Stateful)" in reset and _NOT_RESUMABLE in reset
    # the popen launcher's launch is repeated with an observer that waits before it kills (launchers.ScriptLauncher)
    launch = inspect.getsource(compat._SubprocessScriptLauncher.launch)
    assert "_launch_process_observer(self.procs)" in launch and "_set_num_threads_if_needed(" in launch
    assert "self._child_processes" in inspect.getsource(compat._ChildProcessObserver._terminate_all)
    trainer = lightning.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False)
    assert trainer._signal_connector.received_sigterm is False and trainer.received_sigterm is False


def test_the_tested_lightning_release_is_stated():
    from lightning_dp._lightning_compat import TESTED_LIGHTNING

    assert any(lightning.__version__.startswith(release + ".") for release in TESTED_LIGHTNING), (
        f"Lightning {lightning.__version__} is not among the tested releases {TESTED_LIGHTNING}: run the suite and "
        "update TESTED_LIGHTNING (and the README) if it passes"
    )


def test_hydra_support_replaces_lightnings_child_command_hook():
    from lightning.fabric.strategies.launchers import subprocess_script as fabric_launcher
    from lightning.pytorch.strategies.launchers import subprocess_script as pytorch_launcher

    from lightning_dp import hydra_support

    saved = fabric_launcher._hydra_subprocess_cmd, pytorch_launcher._hydra_subprocess_cmd
    try:
        hydra_support.install()
        assert fabric_launcher._hydra_subprocess_cmd is hydra_support.subprocess_command
        assert pytorch_launcher._hydra_subprocess_cmd is hydra_support.subprocess_command
    finally:
        fabric_launcher._hydra_subprocess_cmd, pytorch_launcher._hydra_subprocess_cmd = saved


def test_hydra_support_fails_loudly_when_the_hook_is_gone(monkeypatch):
    from lightning.fabric.strategies.launchers import subprocess_script as fabric_launcher
    from lightning.pytorch.strategies.launchers import subprocess_script as pytorch_launcher

    from lightning_dp import hydra_support

    fabric_hook = fabric_launcher._hydra_subprocess_cmd
    monkeypatch.delattr(pytorch_launcher, "_hydra_subprocess_cmd")
    with pytest.raises(RuntimeError, match="has no _hydra_subprocess_cmd"):
        hydra_support.install()
    assert not hasattr(pytorch_launcher, "_hydra_subprocess_cmd")
    assert fabric_launcher._hydra_subprocess_cmd is fabric_hook  # nothing half-patched


def test_lightning_calls_the_hook_for_a_hydra_run():
    """What install() relies on: both popen launchers ask ``_hydra_subprocess_cmd`` for the command under Hydra."""
    from lightning.fabric.strategies.launchers import subprocess_script as fabric_launcher
    from lightning.pytorch.strategies.launchers import subprocess_script as pytorch_launcher

    for module in (fabric_launcher, pytorch_launcher):
        assert "_hydra_subprocess_cmd(" in inspect.getsource(module._SubprocessScriptLauncher._call_children_scripts)


def test_errors_form_one_family_catchable_as_builtin_errors():
    import torch.distributed as dist

    import lightning_dp

    family = [
        lightning_dp.ConfigurationError,
        lightning_dp.UnsupportedChangeError,
        lightning_dp.SparseGradientError,
        lightning_dp.ReplicaMismatchError,
        lightning_dp.PeerUnreachableError,
        lightning_dp.NonFiniteGradientError,
    ]
    assert all(issubclass(e, lightning_dp.LightningDPError) for e in family)
    assert issubclass(lightning_dp.ConfigurationError, ValueError)
    assert issubclass(lightning_dp.PeerUnreachableError, dist.DistNetworkError)
    assert issubclass(lightning_dp.NonFiniteGradientError, FloatingPointError)
    assert str(lightning_dp.PeerUnreachableError("rank 1 is gone")) == "rank 1 is gone"
