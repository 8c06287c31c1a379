"""Hydra support: correct child-process commands for Lightning's popen launcher, and a config search path.

Lightning re-runs the script for every extra rank. Under Hydra it builds that command from ``sys.argv``, which
under ``--multirun`` still holds ``-m`` and the whole sweep (each rank would start a sweep of its own) and points
the ranks at the unused single-run directory. :func:`subprocess_command` instead re-runs exactly this job: its
own resolved overrides, in its own output directory, without ``-m``, writing no second ``.hydra`` folder.
:func:`install` puts it in place of Lightning's; ``examples/train.py`` calls it before building the Trainer.

A sweep runs its jobs one after another in one process, so each job must also leave no process group and none
of the rendezvous variables Lightning exported behind: :func:`job_scope` takes care of that.

Where a cluster starts every rank (SLURM, torchrun), each rank composes its own config, and a run folder named
by the time would differ between ranks that start in different seconds. ``conf/train.yaml`` names it with the
``lightning_dp.job_dir`` resolver (:func:`cluster_job_folder`): the cluster's job id there, the time otherwise.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

_CONFIG_FLAGS = ("--config-path", "--config-name", "--config-dir", "-cp", "-cn", "-cd")


def _config_flags(argv: Sequence[str]) -> list[str]:
    """The ``--config-path/-name/-dir`` arguments of ``argv`` (both ``--flag=value`` and ``--flag value`` forms)."""
    kept: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg.split("=", 1)[0] in _CONFIG_FLAGS:
            kept.append(arg)
            if "=" not in arg and i + 1 < len(argv):
                kept.append(argv[i + 1])
                i += 1
        i += 1
    return kept


def subprocess_command(local_rank: int) -> tuple[list[str], str]:
    """The command and working directory that start rank ``local_rank`` of the current Hydra job."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.utils import get_original_cwd, to_absolute_path

    import __main__

    config = HydraConfig.get()
    if __main__.__spec__ is None:
        command = [sys.executable, to_absolute_path(sys.argv[0])]
    else:
        command = [sys.executable, "-m", __main__.__spec__.name]
    command += _config_flags(sys.argv[1:])
    command += list(config.overrides.task)
    command += [
        f'hydra.run.dir="{config.runtime.output_dir}"',
        f"hydra.job.name={config.job.name}_rank{local_rank}",
        "hydra.output_subdir=null",
    ]
    return command, get_original_cwd()


def cluster_job_folder(default: str) -> str:
    """The run folder's name for a job whose ranks a cluster started: ``slurm-<job id>`` under SLURM (one per array
    task), ``torchrun-<run id>`` under torchrun (with its default run id ``none``: the folder torchrun's agent made
    for this job on this node, shared by its restarts); ``default`` (the time) when Lightning starts the ranks."""
    slurm_job = os.environ.get("SLURM_JOB_ID")
    if slurm_job and os.environ.get("SLURM_JOB_NAME") not in ("bash", "interactive"):  # Lightning's SLURM rule
        return f"slurm-{slurm_job}"
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if run_id and run_id != "none":
        return f"torchrun-{run_id}"
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")  # <agent tmp>/<run id>_<random>/attempt_<n>/<rank>/...
    if run_id and error_file:
        parts = error_file.split(os.sep)
        attempt = next((i for i, part in enumerate(parts) if part.startswith("attempt_")), None)
        if attempt:
            return f"torchrun-{parts[attempt - 1]}"
    return default


def cluster_rank_suffix() -> str:
    """``_rank<r>`` for a rank other than 0 that a cluster started (torchrun's ``RANK``, SLURM's ``SLURM_PROCID``),
    so that ranks sharing the run folder log to files of their own; empty otherwise."""
    if os.environ.get("TORCHELASTIC_RUN_ID"):
        rank = os.environ.get("RANK", "0")
    else:
        rank = os.environ.get("SLURM_PROCID", "0") if cluster_job_folder("") else "0"
    return "" if rank == "0" else f"_rank{rank}"


def register_resolvers() -> None:
    """Register ``${lightning_dp.job_dir:<default>}`` and ``${lightning_dp.rank_suffix:}`` with OmegaConf (once)."""
    from omegaconf import OmegaConf

    if not OmegaConf.has_resolver("lightning_dp.job_dir"):
        OmegaConf.register_new_resolver("lightning_dp.job_dir", cluster_job_folder)
    if not OmegaConf.has_resolver("lightning_dp.rank_suffix"):
        OmegaConf.register_new_resolver("lightning_dp.rank_suffix", cluster_rank_suffix)


def install() -> None:
    """Make Lightning's popen launcher (``ddp`` and every lightning-dp strategy) use :func:`subprocess_command`.
    Raises ``RuntimeError`` if this Lightning version has no such hook to replace."""
    # Lightning first: loading it registers the strategies, which import the compatibility module themselves; a
    # compatibility module still half-imported at that moment would break their registration
    import lightning.pytorch  # noqa: F401

    from lightning_dp._lightning_compat import patch_hydra_subprocess_command

    patch_hydra_subprocess_command(subprocess_command)


@contextmanager
def job_scope() -> Iterator[None]:
    """Run one training job so that the next job of a sweep starts clean: afterwards the process groups are
    destroyed and the environment variables the launcher exported (``MASTER_PORT``, ``LOCAL_RANK``, ...) are gone."""
    import torch.distributed as dist

    saved = dict(os.environ)
    try:
        yield
    finally:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        os.environ.clear()
        os.environ.update(saved)


register_resolvers()  # before Hydra composes any config that names the run folder with it
