"""A warm interpreter for the tests' launches.

Every launched training script begins by importing torch, Lightning and lightning_dp: about 4.5 s of a 2-core
machine's time, paid again by each of the suite's hundreds of launches before Lightning's launcher can even start the
other ranks. :class:`WarmStarter` keeps one process that has imported them; for each launch it forks a child that
then runs as ``python -m <module> args`` (or ``python <script> args``) would: a session of its own, the launch's
environment, working directory, output file, ``sys.argv``, ``sys.path[0]`` and ``__main__``, fresh random seeds, and
its exit status reported to the test. Before it runs anything, each such child forks :data:`RANK_TEMPLATES` pristine
copies of itself that wait, children of the launch, for a command: the ranks that Lightning's ``popen`` launcher
starts (``subprocess.Popen`` of ``python <script>`` in its module) and the workers torchrun's agent starts (``python
-u ...``, each in a session of its own, entered before the hand-off returns) are handed to them, under the same
rules, and are the launch's children as with a real ``Popen``. The copies no rank took end when the launch does.

What a warm start does not reproduce: every process forked from one warm interpreter shares its hash seed (fresh
interpreters each draw one), ranks start at once rather than after their imports, what the preloaded modules do
at import happens once, in the warm process (its warnings go to its own error file), ``sys.flags`` are the warm
process's (``-u`` is given by unbuffered streams alone), and inside an emulated host ``/sys`` is the machine's.
``LIGHTNING_DP_TEST_WARM=0`` runs every launch cold, as a user's run starts.

A launch starts cold (a plain ``subprocess.Popen``) when its command is not ``python [-u] -m ...`` or ``python [-u]
<file>``, when its environment differs from the warm process's in a variable that may be read at import time
(anything but :data:`RUN_TIME_VARIABLES` and :data:`SET_BY_IMPORTS`; for a rank too, and what Lightning's import
reads of its rank is set again), when no warm process runs (one found dead before a launch is started again, up to
:data:`RESTARTS` times; one that fails while a launch is handed to it ends warm starts, said on stderr with the end
of its errors), and always when the test process runs with ``LIGHTNING_DP_TEST_WARM=0``. The warm environment is the
launches' as it is at the first launch (collection's imports may set variables until then). The warm process forks
only while it is single-threaded (checked when it starts) and exits when the test process does. A launch inside an
emulated host's network namespace (``netns``) enters it with ``setns`` before it forks its copies, as root may.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import faulthandler
import io
import os
import pickle
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tests.helpers.launch_report import COUNTER

#: what the warm process imports once
PRELOAD = ("torch", "torch.distributed", "lightning.pytorch", "lightning_dp", "lightning_dp.strategies", "hydra",
           "omegaconf", "torchvision", "tests.scripts.models")  # fmt: skip
#: variables a launch may set differently from the warm process: what the preloaded modules read of them at
#: import (Lightning's rank for its rank-zero helpers) the launched code sets again before it matters
RUN_TIME_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "WORLD_SIZE", "RANK", "LOCAL_RANK", "GROUP_RANK",
                      "LIGHTNING_DP_TEST_", "LIGHTNING_DP_PARTITION_BYTES", "LIGHTNING_DP_JOB_SECRET",
                      "LIGHTNING_DP_JOB_ID", "LIGHTNING_DP_GPU_TIER_", "PYTEST_CURRENT_TEST", "LIGHTNING_DP_LAUNCH",
                      "PL_GLOBAL_SEED", "PL_SEED_WORKERS", "TORCHELASTIC_", "ROLE_", "LOCAL_WORLD_SIZE",
                      "GROUP_WORLD_SIZE", "TORCH_NCCL_ASYNC_ERROR_HANDLING")  # fmt: skip
#: variables imports set in their own process (torch's compile cache and Lightning's NVML check, preloaded; the
#: Intel OpenMP settings of scikit-learn, which the demo data imports, and which torch's GNU OpenMP does not read): a
#: fresh interpreter sets them the same way, whether the launch's environment has them or not
SET_BY_IMPORTS = (
    "TORCHINDUCTOR_CACHE_DIR",
    "PYTORCH_NVML_BASED_CUDA_CHECK",
    "KMP_DUPLICATE_LIB_OK",
    "KMP_INIT_AT_FORK",
)
_STATUS = struct.Struct("!q")
_LENGTH = struct.Struct("!I")
#: warm interpreters started again after one exited, before launches start cold for good
RESTARTS = 3
#: pristine copies each warm launch keeps for the ranks it starts: the tests' runs have at most 4 per node, and
#: torchrun's agent starts 2 workers and 2 more on a restart
RANK_TEMPLATES = 4


@dataclass(frozen=True)
class _Request:
    argv: list[str]  # sys.argv of the launched program: [module or script, *args]
    module: bool  # python -m argv[0]; else python argv[0]
    env: dict[str, str]
    cwd: str
    netns: str | None = None  # the named network namespace it runs in (``ip netns exec``'s), if any
    unbuffered: bool = False  # python -u
    new_session: bool = False  # a rank that asked for a session of its own (torchrun's workers)


class WarmProcess:
    """The part of ``subprocess.Popen`` the launch helpers use, for a process the warm interpreter forked."""

    def __init__(self, pid: int, connection: socket.socket) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._connection = connection

    def poll(self) -> int | None:
        if self.returncode is None and select.select([self._connection], [], [], 0)[0]:
            self._read_status()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            if not select.select([self._connection], [], [], timeout)[0]:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0)
            self._read_status()
        assert self.returncode is not None
        return self.returncode

    def _read_status(self) -> None:
        data = self._connection.recv(_STATUS.size)
        # the warm process gone before it reported: as if the child had been killed
        self.returncode = _STATUS.unpack(data)[0] if len(data) == _STATUS.size else -9
        self._connection.close()


class WarmStarter:
    """Starts launches from the warm interpreter (started on first use), or cold where that could differ."""

    def __init__(self, base_env: Callable[[], dict[str, str]], cwd: Path) -> None:
        self._env_of_launches = base_env  # read at the first launch: imports may set variables until then
        self._base_env: dict[str, str] = {}
        self._cwd = cwd
        self._process: subprocess.Popen | None = None
        self._address = ""
        self._folder = ""
        self._lock = threading.Lock()  # launches may start from several threads at once
        self._restarts = 0
        #: launches started cold for want of a warm process with their environment: per differing variable
        self.cold_because: dict[str, int] = {}
        self.enabled = os.environ.get("LIGHTNING_DP_TEST_WARM", "1") != "0"

    def start(
        self, command: list[str], env: dict[str, str], cwd: Path, output, netns: str | None = None
    ) -> subprocess.Popen | WarmProcess:
        """Start ``command`` with ``env`` in ``cwd``, stdout and stderr to the file ``output``, inside the named
        network namespace ``netns`` if given (as ``ip netns exec`` runs it). The process is in a session of its own
        when this returns."""
        with COUNTER.one_launch():  # one launch, or a process of the launch the caller counts
            request = self._request(command, env, cwd)
            if request is not None and self._ensure_running():
                try:
                    process = self._fork(dataclasses.replace(request, netns=netns), output)
                    COUNTER.started_warm()
                    return process
                except (OSError, struct.error) as error:  # the warm process is gone: this launch and the next cold
                    self._give_up(f"the warm interpreter stopped answering ({error!r})")
            prefix = ["ip", "netns", "exec", netns] if netns is not None else []
            return subprocess.Popen([*prefix, *command], cwd=cwd, env=env, stdout=output, stderr=subprocess.STDOUT,
                                    text=True, start_new_session=True)  # fmt: skip

    def _fork(self, request: _Request, output) -> WarmProcess:
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            connection.connect(self._address)
            socket.send_fds(connection, [pickle.dumps(request)], [output.fileno()])
            pid = _STATUS.unpack(connection.recv(_STATUS.size))[0]  # sent once the child has its own session
        except BaseException:
            connection.close()
            raise
        return WarmProcess(pid, connection)

    def _give_up(self, why: str) -> None:
        if self.enabled:
            errors = self._errors()
            sys.stderr.write(f"tests: {why}; launches start cold from now on\n{errors}")
        self.enabled = False

    def _request(self, command: list[str], env: dict[str, str], cwd: Path) -> _Request | None:
        if not self.enabled:
            return None
        with self._lock:
            if not self._base_env:
                self._base_env = self._env_of_launches()
        request = _request(command, env, str(cwd), self._base_env)
        if request is None:
            for name in import_time_differences(env, self._base_env):
                self.cold_because[name] = self.cold_because.get(name, 0) + 1
        return request

    def _ensure_running(self) -> bool:
        with self._lock:
            return self._start_if_needed()

    def _start_if_needed(self) -> bool:
        if not self.enabled:
            return False
        if self._process is not None and self._process.poll() is None:
            return True
        if self._process is not None:
            why = f"the warm interpreter exited ({self._process.returncode})"
            self._restarts += 1
            if self._restarts > RESTARTS:
                self._give_up(why)
                return False
            sys.stderr.write(f"tests: {why}; starting another\n{self._errors()}")
            shutil.rmtree(self._folder, ignore_errors=True)
        self._folder = tempfile.mkdtemp(prefix="lddp-warm-")
        self._address = os.path.join(self._folder, "socket")
        code = f"from tests.helpers.warm import serve; serve({self._address!r})"
        with open(os.path.join(self._folder, "errors"), "w") as errors:
            self._process = subprocess.Popen([sys.executable, "-c", code], cwd=self._cwd, env=self._base_env,
                                             stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                             stderr=errors)  # fmt: skip
        deadline = time.monotonic() + 120
        while not os.path.exists(self._address):
            if self._process.poll() is not None or time.monotonic() > deadline:
                self._give_up(f"the warm interpreter did not start (exit {self._process.poll()})")
                return False
            time.sleep(0.05)
        return True

    def _errors(self) -> str:
        """The end of what the warm process wrote to stderr (its children write to their launches' files)."""
        try:
            return Path(self._folder, "errors").read_text()[-3000:]
        except OSError:
            return ""

    def close(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.kill()
            self._process.wait()
        if self._folder:
            shutil.rmtree(self._folder, ignore_errors=True)


def import_time_differences(env: dict[str, str], warm_env: dict[str, str]) -> list[str]:
    """The variables ``env`` sets differently from ``warm_env`` that an import may read."""
    differing = sorted(k for k in env.keys() | warm_env.keys() if env.get(k) != warm_env.get(k))
    return [k for k in differing if not k.startswith(RUN_TIME_VARIABLES) and k not in SET_BY_IMPORTS]


def _request(command: list[str], env: dict[str, str], cwd: str, warm_env: dict[str, str]) -> _Request | None:
    """``command`` as a request to a process that imported :data:`PRELOAD` in ``warm_env``, or ``None`` where a
    fresh interpreter could differ."""
    if len(command) < 2 or command[0] != sys.executable:
        return None
    if import_time_differences(env, warm_env):
        return None
    unbuffered = command[1] == "-u"
    rest = command[2:] if unbuffered else command[1:]
    if len(rest) > 1 and rest[0] == "-m":
        return _Request(rest[1:], True, dict(env), cwd, unbuffered=unbuffered)
    if rest and rest[0].endswith(".py"):
        return _Request(rest, False, dict(env), cwd, unbuffered=unbuffered)
    return None


def serve(address: str) -> None:
    """The warm process: import :data:`PRELOAD`, then fork a child per request; never returns in the parent. In a
    child, become the launched program and exit as it does."""
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    if threading.active_count() != 1 or len(os.listdir("/proc/self/task")) != 1:
        raise RuntimeError("the warm interpreter started threads while importing; forking it would be unsafe")
    request, output = _serve_until_forked(address)
    _become(request, output)
    sys.exit(0)


def _serve_until_forked(address: str) -> tuple[_Request, int]:
    parent = os.getppid()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(address + ".tmp")
    listener.listen(16)
    os.rename(address + ".tmp", address)  # the address appears once it accepts
    children: dict[int, socket.socket] = {}
    while True:
        if os.getppid() != parent:  # the test process is gone
            os._exit(0)
        if select.select([listener], [], [], 0.02)[0]:
            connection, _ = listener.accept()
            message, fds, _, _ = socket.recv_fds(connection, 1 << 20, 1)
            request = pickle.loads(message)
            sys.stdout.flush()
            sys.stderr.flush()
            in_session, session_made = os.pipe()
            pid = os.fork()
            if pid == 0:
                os.setsid()  # before the test learns the pid: it may kill the whole session at once
                os.close(in_session)
                os.close(session_made)
                listener.close()
                connection.close()
                for other in children.values():
                    other.close()
                return request, fds[0]
            os.close(fds[0])
            os.close(session_made)
            os.read(in_session, 1)  # returns at the child's close of its end, after setsid
            os.close(in_session)
            connection.send(_STATUS.pack(pid))
            children[pid] = connection
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            connection = children.pop(pid)
            try:
                connection.send(_STATUS.pack(os.waitstatus_to_exitcode(status)))
            except OSError:  # the test stopped listening
                pass
            connection.close()


def _become(request: _Request, output: int) -> None:
    """Turn this forked child (already in a session of its own) into ``python [-m] argv``: files, network
    namespace, pristine copies for its ranks, environment, seeds, then run it."""
    os.dup2(output, 1)
    os.dup2(output, 2)
    os.close(output)
    if request.netns is not None:
        _enter_network_namespace(request.netns)
    stdin = os.open(os.devnull, os.O_RDONLY)
    os.dup2(stdin, 0)
    os.close(stdin)
    warm_env = dict(os.environ)
    templates: list[_Template] = []
    for _ in range(RANK_TEMPLATES):
        commands, give_command = os.pipe()
        started, tell_started = os.pipe()
        parent = os.getpid()
        try:
            pid = os.fork()
        except OSError:  # fewer copies: the ranks beyond them start cold
            for end in (commands, give_command, started, tell_started):
                os.close(end)
            break
        if pid == 0:
            for template in templates:
                os.close(template.commands)
                os.close(template.started)
            os.close(give_command)
            os.close(started)
            _run(_await_command(commands, tell_started, parent))
            return
        os.close(commands)
        os.close(tell_started)
        templates.append(_Template(pid, give_command, started))
    _start_ranks_from(templates, warm_env)
    atexit.register(_release, templates)
    _run(request)


def _enter_network_namespace(name: str) -> None:
    """Move this single-threaded process into the named network namespace (``/run/netns/<name>``, as ``ip netns``
    makes them): its sockets, interfaces and routes are the namespace's, and so are those of every process and thread
    it starts. ``ip netns exec`` also mounts a fresh ``/sys`` and the namespace's ``/etc/netns`` files: the launched
    programs read neither for the network, but a process started so sees no ``/sys/fs/cgroup`` (no CPU quota) where
    this one sees the machine's."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    descriptor = os.open(f"/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(descriptor, _CLONE_NEWNET) != 0:
            number = ctypes.get_errno()
            raise OSError(number, f"setns into network namespace {name!r}: {os.strerror(number)}")
    finally:
        os.close(descriptor)


_CLONE_NEWNET = 0x40000000  # Linux: the network namespace, for setns


@dataclass(frozen=True)
class _Template:
    """A pristine copy waiting for a rank's command: its pid, the end its command is written to, and the end it says
    on that it has its own session (where the command asked for one)."""

    pid: int
    commands: int
    started: int


def _release(templates: list[_Template]) -> None:
    """At the launch's exit: end the copies no rank took (they read an empty command) and reap them."""
    for template in templates:
        os.close(template.commands)
        os.close(template.started)
    for template in templates:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(template.pid, 0)
    templates.clear()


def _await_command(commands: int, tell_started: int, parent: int) -> _Request:
    """In a pristine copy: die with the launch until it hands this copy a rank's command (its length first), then
    return it, in a session of its own first if it asks for one (said on ``tell_started``)."""
    _set_parent_death_signal(signal.SIGKILL)
    if os.getppid() != parent:
        os._exit(0)
    size = _read_exactly(commands, _LENGTH.size)
    message = _read_exactly(commands, _LENGTH.unpack(size)[0]) if len(size) == _LENGTH.size else b""
    os.close(commands)
    if not message:  # the launch ended with this copy unused
        os._exit(0)
    _set_parent_death_signal(0)  # as a fresh process has it
    request: _Request = pickle.loads(message)
    if request.new_session:
        os.setsid()
    os.write(tell_started, b"s")
    os.close(tell_started)
    return request


def _read_exactly(fd: int, size: int) -> bytes:
    """``size`` bytes from ``fd``, or fewer if it closes first."""
    chunks, left = [], size
    while left and (chunk := os.read(fd, left)):
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _set_parent_death_signal(number: int) -> None:
    import ctypes

    ctypes.CDLL(None).prctl(1, number)  # PR_SET_PDEATHSIG


class _RankPopen(subprocess.Popen):
    """``subprocess.Popen`` that hands a plain ``python [-m] argv`` start to one of the launch's pristine copies,
    and starts anything else (or when none is left) as ``subprocess.Popen`` does."""

    templates: list[_Template] = []
    warm_env: dict[str, str] = {}

    def _execute_child(self, args, executable, preexec_fn, close_fds, pass_fds, cwd, env, *rest):  # type: ignore[no-untyped-def]
        request = None
        if executable is None and preexec_fn is None and not pass_fds and len(rest) == 16:
            _, _, shell, *pipes, _, gid, gids, uid, umask, new_session, group = rest
            plain = not shell and all(fd == -1 for fd in pipes) and group == -1
            if plain and gid is None and gids is None and uid is None and umask == -1:
                command = [os.fsdecode(a) for a in args]
                request = _request(command, dict(os.environ if env is None else env), os.fspath(cwd or os.getcwd()),
                                   self.warm_env)  # fmt: skip
                if request is not None and new_session:
                    request = dataclasses.replace(request, new_session=True)
        while request is not None and self.templates:
            template = self.templates.pop(0)
            message = pickle.dumps(request)
            try:
                data = memoryview(_LENGTH.pack(len(message)) + message)
                while data:
                    data = data[os.write(template.commands, data) :]
                # once it said so, the copy runs the command (and leads its session): signals to its group reach it
                handed = os.read(template.started, 1) == b"s"
            except OSError:  # that copy is gone
                handed = False
            except BaseException:  # interrupted (a signal handler raised): no copy runs a command nobody waits for
                with contextlib.suppress(OSError):
                    os.kill(template.pid, signal.SIGKILL)
                    os.waitpid(template.pid, 0)
                raise
            finally:
                os.close(template.commands)
                os.close(template.started)
            if not handed:
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(template.pid, os.WNOHANG)
                continue
            self.pid = template.pid
            self._child_created = True
            return
        super()._execute_child(args, executable, preexec_fn, close_fds, pass_fds, cwd, env, *rest)


def _start_ranks_from(templates: list[_Template], warm_env: dict[str, str]) -> None:
    """Have Lightning's popen launchers (Fabric's and the Trainer's) and torchrun's worker handler start ranks with
    :class:`_RankPopen`."""
    import types

    from lightning.fabric.strategies.launchers import subprocess_script as fabric_launcher
    from lightning.pytorch.strategies.launchers import subprocess_script as pytorch_launcher
    from torch.distributed.elastic.multiprocessing.subprocess_handler import subprocess_handler as torchrun_handler

    _RankPopen.templates = templates
    _RankPopen.warm_env = warm_env
    shim = types.ModuleType("subprocess")
    shim.__dict__.update(subprocess.__dict__)
    shim.Popen = _RankPopen  # type: ignore[attr-defined]
    for module in (fabric_launcher, pytorch_launcher):
        module.subprocess = shim  # type: ignore[attr-defined]
    torchrun_handler.Popen = _RankPopen  # type: ignore[attr-defined]


def _run(request: _Request) -> None:
    """Become ``python [-m] argv`` of ``request``: directory, environment, seeds, Lightning's rank, then run it."""
    import random
    import runpy

    from lightning.fabric.utilities.rank_zero import _get_rank, rank_zero_only

    os.chdir(request.cwd)
    os.environ.clear()
    os.environ.update(request.env)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # (its stacks, asked for by a deadline that passed)
    rank_zero_only.rank = _get_rank() or 0  # what Lightning's import reads of the environment
    if request.unbuffered:  # as ``python -u`` makes them: text straight onto the unbuffered file descriptors
        for name, fd in (("stdout", 1), ("stderr", 2)):
            stream = getattr(sys, name)
            stream.flush()
            setattr(sys, name, io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), encoding=stream.encoding,
                                                errors=stream.errors, write_through=True))  # fmt: skip
    random.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    if request.module:
        sys.argv = ["-m", *request.argv[1:]]
        sys.path[0] = request.cwd
        runpy._run_module_as_main(request.argv[0], alter_argv=True)  # what ``python -m`` runs
    else:
        script = os.path.abspath(request.argv[0])
        sys.argv = list(request.argv)
        sys.path[0] = os.path.dirname(script)
        runpy.run_path(script, run_name="__main__")
