"""A real single-host SLURM cluster for the tests: Debian's ``slurm-wlm`` and ``munge``, on loopback.

:func:`slurm_cluster` starts ``munged`` (unless one runs), ``slurmctld`` and ``slurmd`` with a configuration of
its own (one node, ``localhost``, as many CPUs as the machine has and at least :data:`TASKS`, ports picked free,
2 s between a stopped job's SIGTERM and SIGKILL, a requeued job eligible again after :data:`CRED_EXPIRE_S` and
started within a second of it by the main scheduler) and stops them afterwards; clients find it through
``SLURM_CONF`` in the environment it yields.
:func:`unavailable` says why it cannot run here (not root, packages missing), for a skip.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.helpers.distributed import free_port

BINARIES = ("slurmctld", "slurmd", "munged", "srun", "sbatch", "scontrol", "sinfo")
MUNGE_SOCKET_DIR = Path("/run/munge")


def unavailable() -> str | None:
    """Why no cluster can start here, or ``None``."""
    if os.geteuid() != 0:
        return "needs root (slurmd runs jobs as any user)"
    missing = [b for b in BINARIES if shutil.which(b) is None]
    if missing:
        return f"SLURM is not installed ({', '.join(missing)} missing): apt-get install slurm-wlm munge"
    if not Path("/etc/munge/munge.key").exists():
        return "munge has no key (/etc/munge/munge.key)"
    return None


#: the tasks a job may start on the one node, whatever the machine's cores (the node's CPUs as SLURM counts them)
TASKS = 4

#: the job step credential's lifetime, which is also how long a requeued job waits before it starts again (SLURM's
#: default: 120 s); long enough for a step's launch on this one host, a second as SLURM sees it
CRED_EXPIRE_S = 10


def _config(root: Path) -> str:
    return f"""ClusterName=lightningdp
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
AuthType=auth/munge
AuthInfo=cred_expire={CRED_EXPIRE_S}
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
KillWait=2
SchedulerParameters=sched_interval=1
SlurmdParameters=config_overrides
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
NodeName=localhost NodeAddr=127.0.0.1 CPUs={max(os.cpu_count() or 1, TASKS)} State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""


def _munge_running() -> bool:
    return subprocess.run(["sh", "-c", "munge -n | unmunge"], capture_output=True).returncode == 0


@contextmanager
def slurm_cluster(root: Path) -> Iterator[dict[str, str]]:
    """Start the cluster in ``root``; yield the environment for its clients (``SLURM_CONF``); stop it."""
    for d in ("state", "spool"):
        (root / d).mkdir(parents=True, exist_ok=True)
    conf = root / "slurm.conf"
    conf.write_text(_config(root))
    env = {**os.environ, "SLURM_CONF": str(conf)}
    started_munge = False
    if not _munge_running():
        MUNGE_SOCKET_DIR.mkdir(parents=True, exist_ok=True)
        shutil.chown(MUNGE_SOCKET_DIR, "munge", "munge")
        subprocess.run(["su", "-s", "/bin/sh", "munge", "-c", "/usr/sbin/munged"], check=True)
        started_munge = True
    daemons = [
        subprocess.Popen(["slurmctld", "-D", "-f", str(conf)], env=env, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL),
        subprocess.Popen(["slurmd", "-D", "-N", "localhost", "-f", str(conf)], env=env, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL),
    ]  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            state = subprocess.run(["sinfo", "-h", "-o", "%t"], env=env, capture_output=True, text=True).stdout
            if state.strip() == "idle":
                break
            time.sleep(0.5)
        else:
            logs = "".join(p.read_text()[-2000:] for p in (root / "slurmctld.log", root / "slurmd.log") if p.exists())
            raise RuntimeError(f"the SLURM node never became idle:\n{logs}")
        yield {"SLURM_CONF": str(conf)}
    finally:
        subprocess.run(["scontrol", "shutdown"], env=env, capture_output=True, timeout=30)
        for daemon in daemons:
            try:
                daemon.wait(timeout=15)
            except subprocess.TimeoutExpired:
                daemon.kill()
        if started_munge:
            subprocess.run(["pkill", "-x", "munged"], capture_output=True)
