"""Shared memory between the ranks of one node: one segment every local rank maps, and a barrier that sleeps.

:class:`NodeSharedMemory` is created collectively at set-up. The first rank of each node creates a file in
``/dev/shm`` under a name no other run can pick (its pid and 64 random bits), reserves its pages (so a small
``/dev/shm`` fails here, not with a bus error later), and every local rank maps it. As soon as every rank has
mapped it the file is unlinked: the memory stays shared while mapped and is freed by the kernel when the last
rank exits, however it exits (SIGKILL included), so nothing is ever left behind in ``/dev/shm``.

The segment holds, per *slot* (one per gradient bucket), one input region per local rank and two result regions
(used alternately, so that a rank may write a result while a slower one still reads the previous result), and a
dissemination barrier over process-shared POSIX semaphores. How a rank waits is decided once (``wait``): where the
node's ranks do not outnumber the cores they may run on together (their CPU affinities, capped by the cgroup's CPU
quota), it first polls its semaphore for
:data:`SPIN_SECONDS` (a peer that arrives within that time costs no system call and no wake-up), then sleeps in the
kernel; where they do outnumber them it sleeps at once, so the core goes to a peer that has work. A wait is
bounded: every tenth of a second it checks that the local peers are still alive (a dead process cannot post a
semaphore), and after the timeout it names the ranks that never arrived
(:class:`~lightning_dp.comm.errors.PeerUnreachableError`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import math
import os
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from lightning_dp.comm.errors import ConfigurationError, PeerUnreachableError

#: where segments are created: a tmpfs; ``LIGHTNING_DP_SHM_DIR`` picks another (e.g. a larger tmpfs mount)
SHM_DIR = os.environ.get("LIGHTNING_DP_SHM_DIR", "/dev/shm")
NAME_PREFIX = "lightning-dp-"
#: alignment of every region (a cache line; keeps ranks writing different regions off each other's lines)
ALIGN = 64
#: room for one ``sem_t`` (32 bytes on 64-bit Linux) on a cache line of its own
SEM_BYTES = 64
#: how often a waiting rank checks that its peers are alive
POLL_SECONDS = 0.1
#: how a rank waits at the barrier: ``"auto"`` (spin, then sleep, when the node's ranks fit its cores; else
#: sleep), ``"spin"`` (spin, then sleep), ``"sleep"``
WAITS = ("auto", "spin", "sleep")
#: how long a spinning rank polls its semaphore before it sleeps
SPIN_SECONDS = 200e-6


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.sem_init.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint]
_libc.sem_post.argtypes = [ctypes.c_void_p]
_libc.sem_timedwait.argtypes = [ctypes.c_void_p, ctypes.POINTER(_Timespec)]
_libc.sem_trywait.argtypes = [ctypes.c_void_p]
_libc.sem_destroy.argtypes = [ctypes.c_void_p]


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def cpu_quota() -> float | None:
    """The CPUs' worth of time this process's cgroup may use (``cpu.max`` of cgroup v2: a container's ``--cpus``, a
    pod's CPU limit), or ``None`` where there is no limit or no cgroup v2."""
    try:
        with open("/proc/self/cgroup") as f:
            path = next((line.split(":", 2)[2].strip() for line in f if line.startswith("0::")), None)
        if path is None:
            return None
        with open(f"/sys/fs/cgroup{path.rstrip('/')}/cpu.max") as f:
            quota, period = f.read().split()
    except (OSError, ValueError, StopIteration):
        return None
    return None if quota == "max" else int(quota) / int(period)


def usable_cores(affinities: Sequence[Sequence[int]] | None = None) -> int:
    """The cores the ranks whose CPU affinities are ``affinities`` (default: this process's) may run on together:
    the union of the affinities, capped by this process's cgroup CPU quota (:func:`cpu_quota`)."""
    if affinities is None:
        affinities = [sorted(os.sched_getaffinity(0))]
    cores = len(set().union(*map(set, affinities)))
    quota = cpu_quota()
    return cores if quota is None else max(1, min(cores, math.floor(quota)))


def spin_seconds(wait: str, local_size: int, cores: int | None = None) -> float:
    """How long a rank of a node of ``local_size`` ranks that may run on ``cores`` cores together (default
    :func:`usable_cores`) spins before it sleeps at the barrier, for ``wait`` (one of :data:`WAITS`)."""
    if wait not in WAITS:
        raise ConfigurationError(f"shm_wait={wait!r} is not supported; choose one of {WAITS}")
    if wait == "auto":
        wait = "spin" if local_size <= (usable_cores() if cores is None else cores) else "sleep"
    return SPIN_SECONDS if wait == "spin" else 0.0


def _pid_namespace() -> int | None:
    """The inode of this process's pid namespace (ranks in one namespace can watch each other by pid)."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` exists and has not exited (a zombie, killed but not yet reaped, counts as dead)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except FileNotFoundError:
        return False
    except OSError:
        return True  # cannot tell: assume alive and let the timeout decide
    state = stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3]
    return state not in (b"Z", b"X", b"x")


@dataclass(frozen=True)
class NodeLayout:
    """Which ranks of a group share a node: ``nodes[i]`` lists node ``i``'s group ranks in order."""

    nodes: list[list[int]]
    rank: int

    @classmethod
    def gather(cls, node_key: object, group: dist.ProcessGroup | None = None) -> NodeLayout:
        """Collective: ranks that pass equal ``node_key`` share a node (nodes numbered by their first rank)."""
        keys: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(keys, node_key, group=group)
        nodes: dict[object, list[int]] = {}
        for rank, key in enumerate(keys):
            nodes.setdefault(key, []).append(rank)
        return cls(list(nodes.values()), dist.get_rank(group))

    @property
    def node(self) -> int:
        return next(i for i, ranks in enumerate(self.nodes) if self.rank in ranks)

    @property
    def local_ranks(self) -> list[int]:
        return self.nodes[self.node]

    @property
    def local_rank(self) -> int:
        return self.local_ranks.index(self.rank)

    @property
    def local_size(self) -> int:
        return len(self.local_ranks)

    @property
    def num_nodes(self) -> int:
        return len(self.nodes)

    @property
    def uniform(self) -> bool:
        """Whether every node has the same number of ranks."""
        return len({len(ranks) for ranks in self.nodes}) == 1


class SharedMemoryUnavailable(RuntimeError):
    """The local ranks could not share a segment (no ``/dev/shm``, too small, or not one memory namespace)."""


class NodeSharedMemory:
    """Input and result regions of ``slot_bytes`` for each local rank, and a barrier, shared by the ranks of one
    node. Collective over ``group``: every rank of the group constructs it (each node gets its own segment).

    Raises :class:`SharedMemoryUnavailable` on every rank when any node cannot share one, so all ranks can fall
    back together. ``wait``: how a rank waits at the barrier (one of :data:`WAITS`); ``interrupt``: see
    :attr:`interrupt`.
    """

    def __init__(
        self,
        layout: NodeLayout,
        slot_bytes: Sequence[int],
        group: dist.ProcessGroup | None = None,
        timeout: float = 300.0,
        wait: str = "auto",
        interrupt: Callable[[], None] | None = None,
    ) -> None:
        self.layout = layout
        self.group = group
        self.timeout = timeout
        #: called while a rank waits for its peers (every poll): raises to end the wait (the job's membership
        #: changes)
        self.interrupt = interrupt
        spin_seconds(wait, layout.local_size, cores=1)  # an unknown ``wait`` fails here, before anything is shared
        #: seconds a waiting rank spins before it sleeps (0: it sleeps at once); decided in :meth:`_share`
        self.spin_seconds = 0.0
        self.cores = 1
        self._wait_mode = wait
        self.local_rank, self.local_size = layout.local_rank, layout.local_size
        size = self.local_size
        self.rounds = max(1, math.ceil(math.log2(size))) if size > 1 else 0
        header = _align(8 * size)  # one arrival counter per local rank
        self._sem_offset = header
        offset = header + self.rounds * size * SEM_BYTES
        #: ``(first input, stride between ranks' inputs, first result, stride between results)`` of each slot
        self._slots: list[tuple[int, int, int, int]] = []
        for nbytes in slot_bytes:
            stride = _align(nbytes)
            self._slots.append((offset, stride, offset + size * stride, stride))
            offset += (size + 2) * stride
        #: bytes of this node's segment
        self.nbytes = max(offset, 1)
        self._memory = self._share(self.nbytes)
        self._base = self._memory.data_ptr()
        self._arrivals = self._memory[:header].view(torch.int64)
        self._arrived = 0

    # ------------------------------------------------------------------ set-up
    def _share(self, nbytes: int) -> torch.Tensor:
        layout, me = self.layout, dist.get_rank(self.group)
        leader = layout.local_ranks[0] == me
        created, failure, memory = None, None, None
        try:
            if leader:
                name = os.path.join(SHM_DIR, f"{NAME_PREFIX}{os.getpid()}-{secrets.token_hex(8)}")
                try:
                    memory = self._create(name, nbytes)
                    created = name
                except (OSError, RuntimeError) as error:  # torch.from_file raises RuntimeError
                    failure = f"rank {me} could not create {name} ({nbytes} bytes): {error}"
            names: list = [None] * dist.get_world_size(self.group)
            dist.all_gather_object(names, created, group=self.group)
            if not leader:
                memory, failure = self._attach(names[layout.local_ranks[0]], nbytes, me)
            outcomes: list = [None] * dist.get_world_size(self.group)
            mine = (failure, os.getpid(), _pid_namespace(), sorted(os.sched_getaffinity(0)))
            dist.all_gather_object(outcomes, mine, group=self.group)
        finally:
            if created is not None:
                os.unlink(created)  # mapped by every local rank (or failed): the kernel frees it with the last mapping
        failures = [f for f, _, _, _ in outcomes if f is not None]
        if failures:
            raise SharedMemoryUnavailable("; ".join(failures))
        local = [outcomes[r] for r in layout.local_ranks]
        self._pids = [pid for _, pid, _, _ in local]
        #: a peer in another pid namespace cannot be watched by pid; then only the timeout bounds a wait
        self._watch_pids = len({namespace for _, _, namespace, _ in local}) == 1 and local[0][2] is not None
        #: the cores the node's ranks may run on together
        self.cores = usable_cores([affinity for _, _, _, affinity in local])
        self.spin_seconds = spin_seconds(self._wait_mode, layout.local_size, self.cores)
        assert memory is not None
        return memory

    def _create(self, name: str, nbytes: int) -> torch.Tensor:
        fd = os.open(name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            try:
                os.posix_fallocate(fd, 0, nbytes)  # reserve the pages: ENOSPC here instead of SIGBUS on first touch
            finally:
                os.close(fd)
            memory = torch.from_file(name, shared=True, size=nbytes, dtype=torch.uint8)
            memory[: self._sem_offset].zero_()
            for i in range(self.rounds * self.local_size):
                if _libc.sem_init(memory.data_ptr() + self._sem_offset + i * SEM_BYTES, 1, 0) != 0:
                    raise OSError(ctypes.get_errno(), "sem_init failed")
        except BaseException:
            os.unlink(name)
            raise
        return memory

    @staticmethod
    def _attach(name: str | None, nbytes: int, me: int) -> tuple[torch.Tensor | None, str | None]:
        if name is None:
            return None, None  # the leader failed and says why
        try:
            if os.path.getsize(name) != nbytes:
                return None, f"rank {me} found {name} with an unexpected size"
            return torch.from_file(name, shared=True, size=nbytes, dtype=torch.uint8), None
        except (OSError, RuntimeError) as error:
            return None, f"rank {me} could not map {name} ({error}); are the ranks of one node in one /dev/shm?"

    # ------------------------------------------------------------------ regions
    def _view(self, slot: int, offset: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        nbytes = numel * torch.empty(0, dtype=dtype).element_size()
        if nbytes > self._slots[slot][1]:
            raise ValueError(f"{nbytes} bytes do not fit slot {slot} of {self._slots[slot][1]} bytes")
        return self._memory[offset : offset + nbytes].view(dtype)

    def input(self, slot: int, numel: int, dtype: torch.dtype, local_rank: int | None = None) -> torch.Tensor:
        """Local rank ``local_rank``'s (default: this rank's) input region of ``slot``, as ``numel`` ``dtype``s."""
        first, stride, _, _ = self._slots[slot]
        rank = self.local_rank if local_rank is None else local_rank
        return self._view(slot, first + rank * stride, numel, dtype)

    def result(self, slot: int, parity: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """Result region ``parity`` (0 or 1) of ``slot``, shared by all local ranks."""
        _, _, first, stride = self._slots[slot]
        return self._view(slot, first + parity * stride, numel, dtype)

    # ------------------------------------------------------------------ synchronization
    def barrier(self) -> None:
        """Return once every local rank has called it as often as this one (a dissemination barrier: ``ceil(log2
        L)`` rounds of one semaphore post and one wait). Memory written before it is visible to all after it."""
        if self.local_size == 1:
            return
        if self._memory.numel() == 0:
            raise RuntimeError("the shared memory of this node was closed")
        self._arrived += 1
        self._arrivals[self.local_rank] = self._arrived
        size, me = self.local_size, self.local_rank
        deadline = time.monotonic() + self.timeout
        for k in range(self.rounds):
            _libc.sem_post(self._sem(k, (me + (1 << k)) % size))
            self._wait(self._sem(k, me), (me - (1 << k)) % size, deadline)

    def _sem(self, round_: int, local_rank: int) -> int:
        return self._base + self._sem_offset + (round_ * self.local_size + local_rank) * SEM_BYTES

    def _wait(self, sem: int, peer: int, deadline: float) -> None:
        if self.spin_seconds:
            trywait, clock = _libc.sem_trywait, time.perf_counter
            spin_until = clock() + self.spin_seconds
            while clock() < spin_until:
                if trywait(sem) == 0:
                    return
        while True:
            now = time.time() + POLL_SECONDS
            until = _Timespec(int(now), int((now % 1) * 1e9))
            if _libc.sem_timedwait(sem, ctypes.byref(until)) == 0:
                return
            code = ctypes.get_errno()
            if code not in (errno.ETIMEDOUT, errno.EINTR):
                raise OSError(code, f"sem_timedwait failed: {os.strerror(code)}")
            self._check_peers(deadline, peer)

    def _global_rank(self, local_rank: int) -> int:
        group_rank = self.layout.local_ranks[local_rank]
        return dist.get_global_rank(self.group, group_rank) if self.group is not None else group_rank

    def _check_peers(self, deadline: float, peer: int) -> None:
        if self.interrupt is not None:
            self.interrupt()
        me = self._global_rank(self.local_rank)
        if self._watch_pids:
            dead = [r for r, pid in enumerate(self._pids) if r != self.local_rank and not process_alive(pid)]
            if dead:
                names = ", ".join(f"rank {self._global_rank(r)} (pid {self._pids[r]})" for r in dead)
                raise PeerUnreachableError(
                    f"rank {me} could not reach {names} during the shared-memory exchange: the process exited"
                )
        if time.monotonic() > deadline:
            arrivals = self._arrivals.tolist()
            late = [r for r in range(self.local_size) if arrivals[r] < self._arrived] or [peer]
            names = ", ".join(f"rank {self._global_rank(r)}" for r in late)
            raise PeerUnreachableError(
                f"rank {me} waited {self.timeout:.0f} s in the shared-memory exchange for {names}, which never "
                "arrived (hung, or far behind); the strategy's timeout bounds this wait"
            )

    def close(self) -> None:
        """Drop this rank's mapping (the memory is freed once every rank and every view of it let go)."""
        self._memory = torch.empty(0, dtype=torch.uint8)
        self._arrivals = torch.zeros(max(1, self.local_size), dtype=torch.int64)
