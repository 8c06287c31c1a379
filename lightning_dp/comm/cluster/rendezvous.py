"""Join a process group whose sockets listen only on the configured interface.

``init_process_group("env://")`` starts torch's TCP store listening on every interface of the main node, and
gloo picks whatever address the machine's hostname resolves to. Here the store listens only on the main
address (``MASTER_ADDR``) and gloo / NCCL use the one interface that carries traffic towards it: loopback when
the main address is loopback (every single-node run), the cluster-facing interface otherwise.

Across several hosts NCCL keeps choosing its own interfaces (InfiniBand, several NICs): only gloo is narrowed.
Every key a job writes lies under a scope of its own, ``lightning_dp/<job id>/<restart>/<launch or join>`` (see
:func:`join_job`), so that a restarted attempt, a later job on the same port, or a stray rank of another job
never reads another job's addresses. Rank 0 publishes the job's record (its id and scope, and the proof of the
optional shared secret) before anything else; every other rank checks it against what its launcher told it
(:meth:`JobRecord.check`) and refuses to join another job with :class:`~lightning_dp.comm.errors.ForeignJobError`.

A job that survives the loss of a rank keeps a directory of its members in the store (see
:mod:`lightning_dp.comm.membership`). A process that finds one there is a new process taking a lost rank's place: it
joins no default group (the members' was formed once, without it) but a placeholder that refuses every collective
(:class:`AbsentDefaultGroup`), and joins the members' own groups once they admit it.

The store has no authentication: whoever reaches its port can read its keys. The job checks keep mistakes out
(stray ranks, two jobs on one port, a restart), not attackers; binding narrowly keeps the store off other
networks, and the cluster's private network must still be trusted.
"""

from __future__ import annotations

import atexit
import ctypes
import errno
import hashlib
import hmac
import ipaddress
import json
import logging
import os
import signal
import socket
import struct
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, cast

import torch.distributed as dist

from lightning_dp.comm.errors import ForeignJobError

log = logging.getLogger(__name__)

_SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's IPv4 address


def resolve(host: str) -> str:
    """The IPv4 address ``host`` names (an address is returned as it is)."""
    try:
        return str(ipaddress.IPv4Address(host))
    except ValueError:
        return str(socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)[0][4][0])


def local_address_towards(host: str) -> str:
    """The local IPv4 address this machine uses to reach ``host`` (no packet is sent)."""
    address = resolve(host)
    if ipaddress.IPv4Address(address).is_loopback:
        return address
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((address, 9))  # a UDP "connect" only asks the routing table
        return probe.getsockname()[0]


def interface_with_address(address: str) -> str | None:
    """The name of the network interface whose (primary) IPv4 address is ``address`` (Linux), or ``None``."""
    try:
        import fcntl
    except ImportError:  # not a Unix system
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:  # interface without an IPv4 address
                continue
            if socket.inet_ntoa(raw[20:24]) == address:
                return name
    return None


def _listening_socket(address: str, port: int) -> int | None:
    """A socket listening on ``address:port`` (its file descriptor, ownership passed on), or ``None`` if
    ``address`` is not an address of this machine."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((address, port))
        sock.listen(1024)
    except OSError as error:
        sock.close()
        if error.errno == errno.EADDRNOTAVAIL:  # the main address is not one of ours (e.g. a NAT or virtual IP)
            return None
        raise
    return sock.detach()


def _agent_hosts_store(main_address: str, main_port: int) -> bool:
    """Whether torchrun's agent already serves the store at ``main_address:main_port`` (then every rank is a
    client, as in ``init_process_group``)."""
    return (
        os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        and os.environ.get("MASTER_ADDR") == main_address
        and os.environ.get("MASTER_PORT") == str(main_port)
    )


def _store(
    main_address: str, address: str | None, main_port: int, rank: int, world_size: int, timeout: timedelta
) -> dist.TCPStore:
    """The rendezvous store: rank 0 serves it on ``address:main_port`` only (everywhere if ``address`` is
    ``None``), unless torchrun's agent serves it."""
    if rank != 0 or _agent_hosts_store(main_address, main_port):
        return dist.TCPStore(main_address, main_port, world_size, False, timeout=timeout)
    # multi_tenant: a later run in this process on the same port (a sweep, a fixed SLURM port) shares the server
    try:
        listen_fd = _listening_socket(address, main_port) if address is not None else None
    except OSError as error:
        if error.errno != errno.EADDRINUSE:
            raise
        # shares this process's server, if any
        try:
            return dist.TCPStore(
                main_address, main_port, world_size, is_master=True, timeout=timeout, multi_tenant=True
            )
        except dist.DistNetworkError as taken:
            raise ForeignJobError(
                f"rank 0 cannot serve the rendezvous on {main_address}:{main_port}: another process holds the port "
                "(another job, or a rank of an earlier launch still running). Give this job a free MASTER_PORT "
                "(or stop the other job); no rank of this launch joined anything."
            ) from taken
    if listen_fd is None and address is not None:
        log.warning("MASTER_ADDR=%s is not an address of this machine; the store listens everywhere", main_address)
    return dist.TCPStore(
        main_address, main_port, world_size, is_master=True, timeout=timeout, multi_tenant=True,
        wait_for_workers=False, master_listen_fd=listen_fd,
    )  # fmt: skip


def init_bound_process_group(
    backend: str,
    main_address: str,
    main_port: int,
    rank: int,
    world_size: int,
    timeout: timedelta,
    single_host: bool,
    node_rank: int = 0,
    local_rank: int = 0,
) -> str:
    """``dist.init_process_group`` with the store on ``main_address:main_port`` only and gloo on the interface
    towards it (NCCL too when ``single_host``), every key under the job's scope (:func:`join_job`), which it
    returns. ``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME`` set by the user win.

    A loopback main address in a run over several hosts (a hostname that resolves to 127.0.1.1 on its own node,
    as Debian's /etc/hosts does) cannot be what the other nodes reach, so there nothing is narrowed."""
    address: str | None
    interface: str | None
    try:
        address = resolve(main_address)
        if not single_host and ipaddress.IPv4Address(address).is_loopback:
            log.warning(
                "MASTER_ADDR=%s resolves to loopback %s here but the run spans several hosts: binding the "
                "store everywhere", main_address, address,
            )  # fmt: skip
            address = None
        interface = interface_with_address(local_address_towards(address)) if address is not None else None
    except (OSError, ValueError) as error:  # e.g. an IPv6-only main address
        log.warning("cannot bind narrowly to the interface towards %s (%s); torch chooses", main_address, error)
        address = interface = None
    if interface is not None:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", interface)
        if single_host:  # across hosts NCCL picks its fast interfaces (InfiniBand, several NICs) itself
            os.environ.setdefault("NCCL_SOCKET_IFNAME", interface)

    base = _store(main_address, address, main_port, rank, world_size, timeout)
    where = f"{main_address}:{main_port}"
    scope = join_job(base, rank, node_rank, local_rank, where, timeout)
    job = _job_stores[scope] = dist.PrefixStore(f"{scope}/job", base)
    if rank == 0 and world_size > 1:
        _await_the_job(job, scope, where, world_size, timeout)
    elif rank != 0:
        job.add(PRESENT_KEY, 1)
    if job.check([DIRECTORY_KEY]):  # the job runs: this process takes a lost rank's place
        log.warning("rank %d: the job at %s:%s is running; this process asks to join it", rank, main_address, main_port)
        _replacing.add(scope)
        init_absent_default_group(rank, world_size)
    else:
        # under the job's scope, the prefix init_process_group gives its own store: never torchrun's agent's keys,
        # nor those of an earlier attempt, job or stray rank on this port
        dist.init_process_group(backend, store=dist.PrefixStore(f"{scope}/default_pg", base), rank=rank,
                                world_size=world_size, timeout=timeout)  # fmt: skip
    register_close_at_exit()
    return scope


#: where, in a job's store (:func:`job_store`), the job's membership keeps its directory
DIRECTORY_KEY = "membership/directory"
#: counts, in a job's store, the processes other than rank 0 that reached it
PRESENT_KEY = "present"
#: the backend name of :class:`AbsentDefaultGroup`
ABSENT_BACKEND = "lightning_dp_absent"
_job_stores: dict[str, dist.Store] = {}
_replacing: set[str] = set()


def job_store(scope: str | None) -> dist.Store | None:
    """The store every process of the job ``scope`` reaches, under the job's scope (``None``: this process did not
    join ``scope`` itself)."""
    return _job_stores.get(scope) if scope is not None else None


def _await_the_job(job: dist.Store, scope: str, where: str, world_size: int, timeout: timedelta) -> None:
    """Rank 0, in the store it serves: wait until the job's other processes reached it. Either every other rank of a
    job that starts (:data:`PRESENT_KEY`), or the members of the running job ``scope`` that lost its rank 0: they find
    the store served again where it was and keep their directory there (:func:`reach_job_store`), and this process
    takes rank 0's place (a new process in another lost rank's place may be present before them). The store of a
    running job went with its rank 0, so nothing else tells a new process in rank 0's place from the first process of
    a job."""
    deadline = time.monotonic() + timeout.total_seconds()
    while not (job.check([DIRECTORY_KEY]) or int(job.add(PRESENT_KEY, 0)) >= world_size - 1):
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"rank 0: no other process of job {_job_id_of(scope)!r} reached the store it serves at {where} "
                f"within {timeout.total_seconds():.0f} s: the job's other ranks did not start, or, for a new process "
                "in rank 0's place of a running job, its members did not recognize it (every process of the job "
                f"needs the same job id, {JOB_ID_VARIABLE} or the cluster's, and the same {SECRET_VARIABLE})"
            )
        time.sleep(0.05)


def _job_id_of(scope: str) -> str:
    """The job id of a job's scope (``lightning_dp/<job id>/<restart attempt>/<launch or rendezvous>``)."""
    return scope.split("/", 1)[1].rsplit("/", 2)[0]


def _attempt_of(scope: str) -> str:
    """``lightning_dp/<job id>/<restart attempt>`` of a job's scope (see :func:`join_job`), without what tells one
    launch or rendezvous of the attempt from another."""
    return scope.rsplit("/", 1)[0]


def reach_job_store(scope: str, main_address: str, main_port: int, timeout: float = 2.0) -> dist.Store | None:
    """The job's store at ``main_address:main_port``, where a process serves it again (a new process in rank 0's
    place) and published there the record of the same job and restart attempt as ``scope``, with the proof of the same
    secret: the record's scope in it (as :func:`job_store`; that process's launch or rendezvous count may differ from
    the lost rank 0's). ``None`` where nothing answers within ``timeout`` seconds or the record there is another's."""
    try:  # (a plain connection first: torch logs every failed attempt of a store's client with its backtrace)
        socket.create_connection((main_address, main_port), timeout=timeout).close()
        base = dist.TCPStore(main_address, main_port, is_master=False, timeout=timedelta(seconds=timeout),
                             wait_for_workers=False)  # fmt: skip
        if not base.check([JOB_RECORD_KEY]):
            return None
        data = json.loads(base.get(JOB_RECORD_KEY))
    except (RuntimeError, ValueError, OSError):
        return None
    found = data.get("scope") if isinstance(data, dict) else None
    if not isinstance(found, str) or _attempt_of(found) != _attempt_of(scope):
        return None
    if not hmac.compare_digest(str(data.get("proof", "")), _proof(str(data.get("job", "")))):
        return None
    return dist.PrefixStore(f"{found}/job", base)


def replaces_lost_rank(scope: str | None) -> bool:
    """Whether this process found the job ``scope`` running, and joins it in a lost rank's place."""
    return scope in _replacing


def proof_of(text: str) -> str:
    """The proof that this process holds the job's shared secret (:data:`SECRET_VARIABLE`), bound to ``text``
    (empty without a secret)."""
    return _proof(text)


class AbsentDefaultGroup(dist.ProcessGroup):
    """The default group of a process that joins a running job: it has the rank and size of the job's ranks, so
    that torch and Lightning see a distributed process, and every collective on it raises (the job's traffic runs
    on the membership's groups)."""

    def __init__(self, rank: int, size: int) -> None:
        super().__init__(rank, size)  # type: ignore[call-arg]

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return ABSENT_BACKEND

    def _absent(self, *args: object, **kwargs: object) -> Any:
        raise RuntimeError(
            "a process that joined a running job has no default process group (the members formed theirs without "
            "it): this collective must run on the group the strategy gives it"
        )

    allreduce = allreduce_coalesced = broadcast = allgather = _allgather_base = reduce_scatter = barrier = _absent
    _reduce_scatter_base = send = recv = recv_anysource = gather = scatter = alltoall_base = _absent


def init_absent_default_group(rank: int, world_size: int) -> None:
    """Make an :class:`AbsentDefaultGroup` with ``rank`` and ``world_size`` this process's default group."""
    if ABSENT_BACKEND not in dist.Backend.backend_list:
        dist.Backend.register_backend(
            ABSENT_BACKEND, lambda store, group_rank, group_size, timeout: AbsentDefaultGroup(group_rank, group_size),
            devices=["cpu", "cuda"],
        )  # fmt: skip
    dist.init_process_group(ABSENT_BACKEND, store=dist.HashStore(), rank=rank, world_size=world_size)


#: seconds :func:`close_groups_at_exit` waits for the process groups to close, and for gloo's worker threads to let
#: go of their last operations
GROUP_CLOSE_SECONDS = 5.0
GROUP_SETTLE_SECONDS = 0.2
_close_at_exit_registered: list[bool] = []


def register_close_at_exit() -> None:
    """Have :func:`close_groups_at_exit` run when this process exits (once however often this is called; ``atexit``
    runs the handlers registered later first)."""
    if not _close_at_exit_registered:
        atexit.register(close_groups_at_exit)
        _close_at_exit_registered.append(True)


def close_groups_at_exit() -> None:
    """Close this process's process groups while the interpreter is still whole (registered with ``atexit`` by
    :func:`init_bound_process_group`).

    A gloo worker thread lets go of an operation it ran (and of the operation's tensors, which takes the GIL) only
    after the caller has seen the operation complete. When the caller then exits at once, the thread takes the GIL
    during the interpreter's finalization and the process aborts ("terminate called without an active exception",
    SIGABRT) after a run that succeeded. This destroys the groups and then releases the GIL for
    :data:`GROUP_SETTLE_SECONDS`, so those threads finish first. Bounded: where an operation still waits for a lost
    peer, the process exits after :data:`GROUP_CLOSE_SECONDS` all the same. NCCL groups are destroyed in this
    thread, as Lightning does, so that no thread is inside NCCL while the process ends."""
    if dist.is_initialized():
        if dist.get_backend() == "nccl":
            dist.destroy_process_group()
        else:
            closer = threading.Thread(target=dist.destroy_process_group, name="lddp-close-groups", daemon=True)
            try:
                closer.start()
            except RuntimeError:  # interpreters that refuse new threads once shutting down
                dist.destroy_process_group()
            else:
                closer.join(GROUP_CLOSE_SECONDS)
    time.sleep(GROUP_SETTLE_SECONDS)


# ---------------------------------------------------------------------------------------------------- jobs apart
#: a job id every rank (and dedicated server) of a job is given by whoever starts them (a job script); a rank whose
#: id differs from rank 0's is refused. Without it torchrun's run id, then SLURM's job id, serve as the job id.
JOB_ID_VARIABLE = "LIGHTNING_DP_JOB_ID"
#: ``<pid>:<id>`` of the process that started a node's ranks itself (Lightning's launchers), set only in the
#: environment of the ranks it starts: they die with that process (``pid`` 0: they cannot, see :func:`new_launch`)
#: and join only the job their node's local rank 0 joined with the same launch
LAUNCH_VARIABLE = "LIGHTNING_DP_LAUNCH"
#: an optional shared secret: only ranks and servers holding the same value join the job
SECRET_VARIABLE = "LIGHTNING_DP_JOB_SECRET"
#: where rank 0 publishes the job's record (id, scope, proof of the secret)
JOB_RECORD_KEY = "lightning_dp/job"
#: where each node's launcher publishes, under its launch, the scope it joined (for the ranks it started)
LAUNCHES_KEY = "lightning_dp/launches"

_joins = 0  # rendezvous this process has joined without a launch (a Hydra sweep under SLURM joins once per job)
_launch: str | None = None  # this process's launch (:func:`this_launch`)
_joined_scopes: set[str] = set()  # every scope this process has joined


def external_job_id() -> str | None:
    """The job id the launcher gave every rank alike: :data:`JOB_ID_VARIABLE`, torchrun's run id, SLURM's job id."""
    for name in (JOB_ID_VARIABLE, "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID"):
        value = os.environ.get(name)
        if value:
            return value
    return None


def restart_attempt() -> str:
    """Which attempt of the job this process belongs to: torchrun's restart count (its store outlives attempts),
    else SLURM's (a requeued job keeps its id)."""
    return os.environ.get("TORCHELASTIC_RESTART_COUNT") or os.environ.get("SLURM_RESTART_COUNT") or "0"


def new_launch() -> str:
    """A fresh :data:`LAUNCH_VARIABLE` value for the ranks this process is about to start, which also becomes this
    process's own launch. Only a launch from the main thread names its pid: the kernel's parent-death signal fires
    when the *thread* that started a process ends, which a launch from another thread may outlive."""
    global _launch
    pid = os.getpid() if threading.current_thread() is threading.main_thread() else 0
    _launch = f"{pid}:{uuid.uuid4().hex[:16]}"
    return _launch


def this_launch() -> str | None:
    """The launch this process belongs to: the one it started last (:func:`new_launch`) or was given
    (:func:`set_launch`), else the one its environment names (taken out of the environment, so that no program
    this process runs later inherits it)."""
    global _launch
    handed = os.environ.pop(LAUNCH_VARIABLE, None) or None
    if _launch is None:
        _launch = handed
    return _launch


def set_launch(launch: str | None) -> None:
    """Make ``launch`` this process's launch (a rank a multiprocessing launcher started is handed it directly)."""
    global _launch
    os.environ.pop(LAUNCH_VARIABLE, None)
    _launch = launch


def launcher_pid(launch: str | None = None) -> int | None:
    """The pid of the process that started ``launch`` (default: this process's), if it named one."""
    launch = this_launch() if launch is None else launch
    pid = int(launch.split(":", 1)[0]) if launch else 0
    return pid or None


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):  # no /proc: the signal test is all there is
        return True


def die_with_parent(parent: int) -> None:
    """Linux: have the kernel SIGKILL this process when its parent dies (even by SIGKILL), and exit at once if the
    process ``parent`` (a pid: the parent itself, or, under ``forkserver``, the process the fork server serves) is
    gone already. Elsewhere nothing: closed sockets still end a lost peer's waits."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent and not _alive(parent):  # it died before the line above took effect
        sys.stderr.write(f"lightning-dp: the process that started this one (pid {parent}) is gone; exiting\n")
        sys.stderr.flush()
        os._exit(1)


_PR_SET_PDEATHSIG = 1  # Linux prctl option


def _proof(job_id: str) -> str:
    secret = os.environ.get(SECRET_VARIABLE, "")
    return hmac.new(secret.encode(), job_id.encode(), hashlib.sha256).hexdigest() if secret else ""


@dataclass(frozen=True)
class JobRecord:
    """What rank 0 publishes: the job id, the scope of every key of this rendezvous, the secret's proof, and rank
    0's launch (empty where the cluster started it)."""

    job_id: str
    scope: str
    proof: str
    launch: str = ""

    def dumps(self) -> str:
        return json.dumps({"job": self.job_id, "scope": self.scope, "proof": self.proof, "launch": self.launch})

    @classmethod
    def read(
        cls, store: dist.Store, where: str, timeout: timedelta, fresh: Callable[[JobRecord], bool] | None = None
    ) -> JobRecord:
        """Wait up to ``timeout`` for the record of the job served at ``where`` (one ``fresh`` accepts: an earlier
        job's record stays in a store that outlives it until rank 0 replaces it); a clear error if none comes."""
        deadline = time.monotonic() + timeout.total_seconds()
        try:
            store.wait([JOB_RECORD_KEY], timeout)
            while True:
                data = json.loads(store.get(JOB_RECORD_KEY))
                record = cls(str(data["job"]), str(data["scope"]), str(data["proof"]), str(data.get("launch", "")))
                if fresh is None or fresh(record):
                    return record
                if time.monotonic() > deadline:
                    raise ForeignJobError(
                        f"the job at {where} has not published a record for this process within "
                        f"{timeout.total_seconds():.0f} s: the record there (job {record.job_id!r}) is an earlier "
                        "job's. Is rank 0 of this job running, with the same MASTER_ADDR / MASTER_PORT?"
                    )
                time.sleep(0.05)
        except (RuntimeError, ValueError) as error:  # torch raises DistStoreError (a RuntimeError) on timeout
            if isinstance(error, ForeignJobError):
                raise
            raise ForeignJobError(
                f"the rendezvous at {where} answered but no lightning-dp job published itself there within "
                f"{timeout.total_seconds():.0f} s ({error}): another program (e.g. a `ddp` job) or a job that "
                "failed to start holds that port. Check MASTER_ADDR / MASTER_PORT, or pick a free port."
            ) from error

    @classmethod
    def publish_for(cls, store: dist.Store, scope: str) -> None:
        """Publish a record for ``scope`` where the job's default group was created by another party (Ray Train),
        so that dedicated servers started by hand find the scope and check the job id and secret as usual."""
        job_id = external_job_id() or "external"
        store.set(JOB_RECORD_KEY, cls(job_id, scope, _proof(job_id)).dumps())

    def check(self, where: str, joining: str, claim: str | None) -> None:
        """Refuse ``joining`` (e.g. ``"rank 3"``), which its launcher says belongs to job ``claim`` (``None``: no
        claim), if it belongs to another job or lacks the job's secret."""
        if claim is not None and claim != self.job_id:
            raise ForeignJobError(
                f"{joining} belongs to job {claim!r}, but {where} serves job {self.job_id!r}: two jobs use the same "
                "port (or this is a stray rank of an earlier launch). Give each job its own MASTER_PORT; this "
                f"process leaves without touching the other job. (To join job {self.job_id!r} on purpose, set "
                f"{JOB_ID_VARIABLE}={self.job_id}.)"
            )
        if not hmac.compare_digest(_proof(self.job_id), self.proof):
            holds = "holds a different" if os.environ.get(SECRET_VARIABLE) else "does not hold the"
            raise ForeignJobError(
                f"{joining} {holds} shared secret of the job at {where} ({SECRET_VARIABLE}): refused. Start every "
                f"rank and server of a job with the same {SECRET_VARIABLE}."
            )


def _stray(joining: str, launch: str, where: str) -> ForeignJobError:
    return ForeignJobError(
        f"{joining} was started by launch {launch!r}, whose launcher is gone: this is a stray rank of an earlier "
        f"launch dialing {where}. It leaves without touching the job there."
    )


def _launch_scope(store: dist.Store, launch: str, where: str, joining: str, timeout: timedelta) -> str:
    """The scope the node's launcher (local rank 0) joined with ``launch``, once it has."""
    key = f"{LAUNCHES_KEY}/{launch}"
    pid = launcher_pid(launch)
    deadline = time.monotonic() + timeout.total_seconds()
    while not store.check([key]):
        if pid is not None and not _alive(pid):
            raise _stray(joining, launch, where)
        if time.monotonic() > deadline:
            raise ForeignJobError(
                f"{joining} waited {timeout.total_seconds():.0f} s at {where} for the rank that started it (launch "
                f"{launch!r}) to join the job: is that rank's MASTER_ADDR / MASTER_PORT the same?"
            )
        time.sleep(0.05)
    return store.get(key).decode()


def join_job(store: dist.Store, rank: int, node_rank: int, local_rank: int, where: str, timeout: timedelta) -> str:
    """Agree on the job's scope (see the module docstring) and check this process belongs to it; returns the scope.

    Rank 0 publishes the record; the others check it. Ranks a cluster started (torchrun, SLURM: every process runs
    the same program) name the scope themselves from the job id, the restart attempt and how many rendezvous they
    joined before, so that a record an earlier attempt left in torchrun's store cannot mislead them. Where
    Lightning's launcher started a node's ranks, its local rank 0 (the launcher) joins as above, waiting for a
    record it has not joined before (a store that outlives a job, as in a Hydra sweep, still holds the last
    job's), and publishes the scope under its launch; the node's other ranks take it from there. A rank whose
    launcher is gone is a stray of an earlier launch and is refused at once."""
    global _joins
    launch = this_launch()
    joining = f"rank {rank}"
    claim = external_job_id()
    pid = launcher_pid(launch) if launch else None
    if pid is not None and pid != os.getpid() and not _alive(pid):
        raise _stray(joining, cast(str, launch), where)
    if launch is None:
        join, _joins = _joins, _joins + 1
    if rank == 0:
        nonce = launch.split(":", 1)[1] if launch else None
        job_id = claim or nonce or uuid.uuid4().hex[:16]
        scope = f"lightning_dp/{job_id}/{restart_attempt()}/{nonce or join}"
        store.set(JOB_RECORD_KEY, JobRecord(job_id, scope, _proof(job_id), launch or "").dumps())
    elif launch is not None and local_rank != 0:
        scope = _launch_scope(store, launch, where, joining, timeout)
    else:
        fresh: Callable[[JobRecord], bool] | None = None
        if launch is not None:
            fresh = lambda record: record.scope not in _joined_scopes  # noqa: E731
        elif claim is None:  # no job id to tell jobs apart: the record of the same rendezvous count
            fresh = lambda record: record.scope.endswith(f"/{restart_attempt()}/{join}")  # noqa: E731
        record = JobRecord.read(store, where, timeout, fresh)
        record.check(where, joining, claim)
        if launch is None and claim is not None:  # started by the cluster: never an earlier attempt's scope
            scope = f"lightning_dp/{claim}/{restart_attempt()}/{join}"
        else:
            scope = record.scope
    if launch is not None and local_rank == 0:
        held = store.compare_set(f"{scope}/launch/{node_rank}", "", launch).decode()
        if held != launch:
            raise ForeignJobError(
                f"{joining} was started as node {node_rank} of the job at {where}, but launch {held!r} holds that "
                "node already: two launches claim one node (check NODE_RANK on every machine). It leaves without "
                "touching the job."
            )
        store.set(f"{LAUNCHES_KEY}/{launch}", scope)
    _joined_scopes.add(scope)
    return scope
