"""A warm interpreter for the tests' launches.

Every launched training script begins by importing torch, Lightning and lightning_dp: about 4.5 s of a 2-core
machine's time, paid again by each of the suite's hundreds of launches before Lightning's launcher can even start the
other ranks. :class:`WarmStarter` keeps one process that has imported them; for each launch it forks a child that
then runs as ``python -m <module> args`` (or ``python <script> args``) would: a session of its own, the launch's
environment, working directory, output file, ``sys.argv``, ``sys.path[0]`` and ``__main__``, fresh random seeds, and
its exit status reported to the test. Only a launch's first process comes from it: the ranks that Lightning's
launcher starts are fresh interpreters, as in a user's run.

A launch starts cold (a plain ``subprocess.Popen``) when its command is not ``python -m ...`` or ``python <file>``,
when its environment differs from the warm process's in a variable that may be read at import time (anything but
:data:`RUN_TIME_VARIABLES` and :data:`SET_BY_IMPORTS`), when the warm process cannot start or has died (said once
on stderr), and always when the test process runs with ``LIGHTNING_DP_TEST_WARM=0``. The warm process forks only
while it is single-threaded (checked when it starts) and exits when the test process does.
"""

from __future__ import annotations

import os
import pickle
import select
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

#: what the warm process imports once
PRELOAD = ("torch", "torch.distributed", "lightning.pytorch", "lightning_dp", "lightning_dp.strategies", "hydra",
           "omegaconf", "torchvision", "tests.scripts.models")  # fmt: skip
#: variables a launch may set differently from the warm process: what the preloaded modules read of them at
#: import (Lightning's rank for its rank-zero helpers) the launched code sets again before it matters
RUN_TIME_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "WORLD_SIZE", "RANK", "LOCAL_RANK", "GROUP_RANK",
                      "LIGHTNING_DP_TEST_", "LIGHTNING_DP_PARTITION_BYTES", "LIGHTNING_DP_JOB_SECRET",
                      "LIGHTNING_DP_GPU_TIER_", "PYTEST_CURRENT_TEST")  # fmt: skip
#: variables the preloaded imports set in their own process (torch's compile cache, Lightning's NVML check): a fresh
#: interpreter sets them the same way, whether the launch's environment has them or not
SET_BY_IMPORTS = ("TORCHINDUCTOR_CACHE_DIR", "PYTORCH_NVML_BASED_CUDA_CHECK")
_STATUS = struct.Struct("!q")


@dataclass(frozen=True)
class _Request:
    argv: list[str]  # sys.argv of the launched program: [module or script, *args]
    module: bool  # python -m argv[0]; else python argv[0]
    env: dict[str, str]
    cwd: str


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

    def __init__(self, base_env: dict[str, str], cwd: Path) -> None:
        self._base_env = base_env
        self._cwd = cwd
        self._process: subprocess.Popen | None = None
        self._address = ""
        self._folder = ""
        self._lock = threading.Lock()  # launches may start from several threads at once
        self.enabled = os.environ.get("LIGHTNING_DP_TEST_WARM", "1") != "0"

    def start(self, command: list[str], env: dict[str, str], cwd: Path, output) -> subprocess.Popen | WarmProcess:
        """Start ``command`` with ``env`` in ``cwd``, stdout and stderr to the file ``output``. The process is in a
        session of its own when this returns."""
        request = self._request(command, env, cwd)
        if request is not None and self._ensure_running():
            try:
                return self._fork(request, output)
            except (OSError, struct.error) as error:  # the warm process is gone: this launch and the next cold
                self._give_up(f"the warm interpreter stopped answering ({error!r})")
        return subprocess.Popen(command, cwd=cwd, env=env, stdout=output, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)  # fmt: skip

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
            sys.stderr.write(f"tests: {why}; launches start cold from now on\n")
        self.enabled = False

    def _request(self, command: list[str], env: dict[str, str], cwd: Path) -> _Request | None:
        if not self.enabled or not command or command[0] != sys.executable or len(command) < 2:
            return None
        differing = {k for k in env.keys() | self._base_env.keys() if env.get(k) != self._base_env.get(k)}
        if any(not k.startswith(RUN_TIME_VARIABLES) and k not in SET_BY_IMPORTS for k in differing):
            return None
        if command[1] == "-m" and len(command) > 2:
            return _Request(command[2:], True, dict(env), str(cwd))
        if command[1].endswith(".py"):
            return _Request(command[1:], False, dict(env), str(cwd))
        return None

    def _ensure_running(self) -> bool:
        with self._lock:
            return self._start_once()

    def _start_once(self) -> bool:
        if not self.enabled:
            return False
        if self._process is not None and self._process.poll() is None:
            return True
        if self._process is not None:
            self._give_up(f"the warm interpreter exited ({self._process.returncode})")
            return False
        self._folder = tempfile.mkdtemp(prefix="lddp-warm-")
        self._address = os.path.join(self._folder, "socket")
        code = f"from tests.helpers.warm import serve; serve({self._address!r})"
        self._process = subprocess.Popen([sys.executable, "-c", code], cwd=self._cwd, env=self._base_env,
                                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)  # fmt: skip
        deadline = time.monotonic() + 120
        while not os.path.exists(self._address):
            if self._process.poll() is not None or time.monotonic() > deadline:
                self._give_up(f"the warm interpreter did not start (exit {self._process.poll()})")
                return False
            time.sleep(0.05)
        return True

    def close(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.kill()
            self._process.wait()
        if self._folder:
            shutil.rmtree(self._folder, ignore_errors=True)


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
    """Turn this forked child (already in a session of its own) into ``python [-m] argv``: files, environment,
    seeds, then run it."""
    import random
    import runpy

    os.dup2(output, 1)
    os.dup2(output, 2)
    os.close(output)
    stdin = os.open(os.devnull, os.O_RDONLY)
    os.dup2(stdin, 0)
    os.close(stdin)
    os.chdir(request.cwd)
    os.environ.clear()
    os.environ.update(request.env)
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
