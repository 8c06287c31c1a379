"""Emulated hosts on one machine: network namespaces joined by a bridge, every link rate-limited with tc.

Used by ``emulated_cluster.py`` and by the multi-node tests. Addresses (10.77.0.0/24) exist only inside the
namespaces created here (named ``lddp-*``), and everything is removed on exit, also on errors.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

SUBNET = "10.77.0"
PREFIX = "lddp"
IFNAME = "lddp0"


def sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=check, capture_output=True, text=True)


def host_ns(i: int) -> str:
    return f"{PREFIX}-h{i}"


def _remove_leftovers() -> None:
    """Namespaces and links of an earlier run that was killed before it could clean up (only ours, by name)."""
    for line in sh("ip", "netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        if name.startswith(f"{PREFIX}-"):
            sh("ip", "netns", "del", name, check=False)
    for line in sh("ip", "-o", "link", "show", check=False).stdout.splitlines():
        name = line.split(":")[1].strip().split("@")[0] if ":" in line else ""
        if name.startswith((f"{PREFIX}v", f"{PREFIX}s", f"{PREFIX}t")) and name[len(PREFIX) + 1 :].isdigit():
            sh("ip", "link", "del", name, check=False)


#: TCP settings of a host tuned for links with a large bandwidth-delay product: socket buffers that may grow to
#: 32 MB (one full 1 Gbit/s × 100 ms round trip in flight) and no return to slow start after an idle pause (the
#: pause between two steps' exchanges)
LONG_FAT_TCP = {
    "net.ipv4.tcp_rmem": "4096 131072 33554432",
    "net.ipv4.tcp_wmem": "4096 65536 33554432",
    "net.ipv4.tcp_slow_start_after_idle": "0",
}


@contextmanager
def emulated_hosts(
    n: int, rate_mbit: float, delay_ms: float = 0.0, tcp: dict[str, str] | None = None, queue_ms: float = 200.0
):
    """Create ``n`` hosts joined by a bridge in a switch namespace; every link shaped to ``rate_mbit`` both ways
    and delayed by ``delay_ms`` in each direction of each link (so host to host: twice that); ``tcp``: sysctl
    settings for every host (e.g. :data:`LONG_FAT_TCP`); ``queue_ms``: how long a packet may wait in a link's
    queue (tbf's latency: the buffer of a switch port)."""
    switch = f"{PREFIX}-sw"
    created = []
    _remove_leftovers()
    try:
        sh("ip", "netns", "add", switch)
        created.append(switch)
        sh("ip", "-n", switch, "link", "add", "br0", "type", "bridge")
        sh("ip", "-n", switch, "link", "set", "br0", "up")
        sh("ip", "-n", switch, "link", "set", "lo", "up")
        for i in range(n):
            ns = host_ns(i)
            sh("ip", "netns", "add", ns)
            created.append(ns)
            sh("ip", "link", "add", f"{PREFIX}v{i}", "type", "veth", "peer", "name", f"{PREFIX}s{i}")
            sh("ip", "link", "set", f"{PREFIX}v{i}", "netns", ns)
            sh("ip", "link", "set", f"{PREFIX}s{i}", "netns", switch)
            sh("ip", "-n", ns, "link", "set", f"{PREFIX}v{i}", "name", IFNAME)
            sh("ip", "-n", ns, "addr", "add", f"{SUBNET}.{i + 1}/24", "dev", IFNAME)
            sh("ip", "-n", ns, "link", "set", IFNAME, "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")
            for key, value in (tcp or {}).items():
                sh("ip", "netns", "exec", ns, "sysctl", "-q", "-w", f"{key}={value}")
            sh("ip", "-n", switch, "link", "set", f"{PREFIX}s{i}", "master", "br0")
            sh("ip", "-n", switch, "link", "set", f"{PREFIX}s{i}", "up")
            for netns, dev in ((ns, IFNAME), (switch, f"{PREFIX}s{i}")):  # upload and download of host i
                shape = ["tbf", "rate", f"{rate_mbit}mbit", "burst", "256kb", "latency", f"{queue_ms}ms"]
                if delay_ms:
                    try:
                        sh("ip", "netns", "exec", netns, "tc", "qdisc", "add", "dev", dev, "root", "handle", "1:",
                           "netem", "delay", f"{delay_ms}ms")  # fmt: skip
                    except subprocess.CalledProcessError as error:
                        raise RuntimeError(
                            "adding delay needs the netem qdisc (kernel module sch_netem), which this kernel "
                            "does not offer; run without a delay"
                        ) from error
                    sh("ip", "netns", "exec", netns, "tc", "qdisc", "add", "dev", dev, "parent", "1:", "handle",
                       "2:", *shape)  # fmt: skip
                else:
                    sh("ip", "netns", "exec", netns, "tc", "qdisc", "add", "dev", dev, "root", *shape)
        yield [host_ns(i) for i in range(n)]
    finally:
        for ns in reversed(created):
            sh("ip", "netns", "del", ns, check=False)


# ---------------------------------------------------------------------------------------------------- delayed links
TUNSETIFF = 0x400454CA
IFF_TUN, IFF_NO_PI = 0x0001, 0x1000
#: jumbo frames, as clusters use; larger ones (up to 64 KB) made several concurrent flows slower through the switch
TUN_MTU = 9000


SWITCH_SOURCE = Path(__file__).with_name("delay_switch.c")


def _switch_binary(directory: str) -> str:
    """Compile the delay switch (benchmarks/delay_switch.c) into ``directory``."""
    binary = os.path.join(directory, "delay_switch")
    sh("gcc", "-O2", "-o", binary, str(SWITCH_SOURCE))
    return binary


class SwitchedHosts(list):
    """The namespaces of :func:`delayed_hosts`' hosts (a list of their names), whose links the switch can cut."""

    def __init__(self, names: list[str], control: int) -> None:
        super().__init__(names)
        self._control = control

    def _send(self, command: str, pairs: Sequence[tuple[int, int]]) -> None:
        os.write(self._control, "".join(f"{command} {a} {b}\n" for a, b in pairs).encode())

    def block(self, source: int, destination: int) -> None:
        """Drop every packet from host ``source`` to host ``destination`` from now on (one way; silently)."""
        self._send("block", [(source, destination)])

    def cut(self, host: int) -> None:
        """Cut host ``host``'s link: nothing reaches it or leaves it, and no one is told."""
        self.partition([[host], [i for i in range(len(self)) if i != host]])

    def partition(self, sides: Sequence[Sequence[int]]) -> None:
        """Split the hosts into ``sides``: no packet crosses from one side to another, either way."""
        self._send("block", [(a, b) for side in sides for other in sides if other is not side for a in side
                             for b in other])  # fmt: skip

    def heal(self) -> None:
        """Every link carries packets again."""
        self._send("unblock", [(a, b) for a in range(len(self)) for b in range(len(self)) if a != b])


@contextmanager
def delayed_hosts(
    n: int, rate_mbit: float, latency_ms: float, tcp: dict[str, str] | None = None, queue_ms: float = 200.0
):
    """``n`` hosts like :func:`emulated_hosts`, joined by a switch process (benchmarks/delay_switch.c, compiled
    with gcc) instead of a bridge: every link carries ``rate_mbit`` each way, a packet takes ``latency_ms`` one way
    from host to host (plus its time on the two links) and waits at most ``queue_ms`` for a link. Works without the
    netem qdisc. Yields the hosts as :class:`SwitchedHosts`: their links can be cut, one way or both, and mended."""
    import fcntl
    import struct
    import tempfile

    _remove_leftovers()
    created, fds = [], []
    pipe: list[int] = []
    switch = None
    build = tempfile.TemporaryDirectory()
    try:
        binary = _switch_binary(build.name)
        for i in range(n):
            ns = host_ns(i)
            sh("ip", "netns", "add", ns)
            created.append(ns)
            fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
            fds.append(fd)
            name = f"{PREFIX}t{i}"
            fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
            sh("ip", "link", "set", name, "netns", ns)  # the open descriptor stays attached to the moved device
            sh("ip", "-n", ns, "link", "set", name, "name", IFNAME)
            sh("ip", "-n", ns, "link", "set", IFNAME, "mtu", str(TUN_MTU))
            sh("ip", "-n", ns, "addr", "add", f"{SUBNET}.{i + 1}/24", "dev", IFNAME)
            sh("ip", "-n", ns, "link", "set", IFNAME, "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")
            for key, value in (tcp or {}).items():
                sh("ip", "netns", "exec", ns, "sysctl", "-q", "-w", f"{key}={value}")
        control_read, control_write = os.pipe()
        pipe = [control_read, control_write]
        args = [str(rate_mbit * 1e6 / 8), str(latency_ms / 1e3), str(queue_ms / 1e3), str(control_read),
                *map(str, fds)]  # fmt: skip
        switch = subprocess.Popen([binary, *args], pass_fds=[*fds, control_read])
        os.close(control_read)
        pipe = [control_write]
        yield SwitchedHosts([host_ns(i) for i in range(n)], control_write)
    finally:
        if switch is not None:
            switch.kill()
            switch.wait()
        for fd in [*fds, *pipe]:
            os.close(fd)
        for ns in reversed(created):
            sh("ip", "netns", "del", ns, check=False)
        build.cleanup()


def start_in_hosts(
    commands: Sequence[tuple[str, list[str]]],
    env: Mapping[str, str],
    extra_env: Sequence[Mapping[str, str]] | None = None,
    **popen: Any,
) -> list[subprocess.Popen]:
    """Start each ``(namespace, argv)`` inside its namespace, with ``env`` (plus ``extra_env[i]`` for command
    ``i``) and ``popen``'s keyword arguments."""
    extra = list(extra_env) if extra_env is not None else [{}] * len(commands)
    if len(extra) != len(commands):
        raise ValueError(f"{len(commands)} commands but {len(extra)} extra environments")
    return [
        subprocess.Popen(["ip", "netns", "exec", ns, *argv], env={**env, **more}, **popen)
        for (ns, argv), more in zip(commands, extra)
    ]


def wait_all(procs: Sequence[subprocess.Popen], timeout: float) -> None:
    """Wait for each of ``procs`` (at most ``timeout`` seconds each); kill what is left on any failure, and raise
    naming the exit codes if any failed."""
    try:
        for p in procs:
            p.wait(timeout=timeout)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    if any(p.returncode for p in procs):
        raise RuntimeError(f"a worker failed: exit codes {[p.returncode for p in procs]}")


def run_in_hosts(
    commands: Sequence[tuple[str, list[str]]],
    env: Mapping[str, str],
    timeout: float,
    extra_env: Sequence[Mapping[str, str]] | None = None,
    **popen: Any,
) -> None:
    """:func:`start_in_hosts`, then :func:`wait_all`."""
    wait_all(start_in_hosts(commands, env, extra_env, **popen), timeout)


def node_ranks(count: int) -> list[dict[str, str]]:
    """``NODE_RANK`` for each of ``count`` hosts, one Lightning node each (``extra_env`` of :func:`start_in_hosts`)."""
    return [{"NODE_RANK": str(rank)} for rank in range(count)]


def server_command(master_addr: str, master_port: int | str, index: int, num_servers: int) -> list[str]:
    """``python -m lightning_dp.server`` joining the trainers at ``master_addr:master_port`` as server ``index``."""
    return [sys.executable, "-m", "lightning_dp.server", "--master-addr", master_addr, "--master-port",
            str(master_port), "--server-index", str(index), "--num-servers", str(num_servers)]  # fmt: skip
