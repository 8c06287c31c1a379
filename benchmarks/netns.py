"""Emulated hosts on one machine: network namespaces joined by a bridge, every link rate-limited with tc.

Used by ``emulated_cluster.py`` and by the multi-node tests. Addresses (10.77.0.0/24) exist only inside the
namespaces created here (named ``lddp-*``), and everything is removed on exit, also on errors.
"""

from __future__ import annotations

import os
import subprocess
from contextlib import contextmanager

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
#: a large MTU keeps the packet rate (and the switch's per-packet work) low at 1 Gbit/s
TUN_MTU = 65000


class DelaySwitch:
    """A switch in user space between ``n`` hosts' TUN devices: every packet waits for its sender's uplink and its
    receiver's downlink (each ``rate`` bytes/s, one packet at a time), then ``delay`` seconds on the wire, and is
    dropped when it would wait more than ``queue`` seconds for a link (a switch port's buffer). For kernels without
    the netem qdisc; the hosts' address ``SUBNET.(i + 1)`` goes to host ``i``."""

    def __init__(self, fds: list[int], rate: float, delay: float, queue: float = 0.2) -> None:
        self.fds, self.rate, self.delay, self.queue = fds, rate, delay, queue
        self.stopped = False
        self.dropped = 0

    def run(self) -> None:
        import heapq
        import select
        import time

        uplink_free = [0.0] * len(self.fds)
        downlink_free = [0.0] * len(self.fds)
        pending: list[tuple[float, int, int, bytes]] = []  # (deliver at, sequence, host, packet)
        sequence = 0
        index = {fd: i for i, fd in enumerate(self.fds)}
        while not self.stopped:
            now = time.monotonic()
            while pending and pending[0][0] <= now:
                _, _, host, packet = heapq.heappop(pending)
                try:
                    os.write(self.fds[host], packet)
                except OSError:
                    self.dropped += 1
            wait = min(0.05, max(0.0, pending[0][0] - now)) if pending else 0.05
            readable, _, _ = select.select(self.fds, [], [], wait)
            now = time.monotonic()
            for fd in readable:
                source = index[fd]
                for _ in range(64):
                    try:
                        packet = os.read(fd, TUN_MTU + 64)
                    except BlockingIOError:
                        break
                    if len(packet) < 20 or packet[0] >> 4 != 4:
                        continue  # IPv4 only
                    target = packet[19] - 1
                    if not 0 <= target < len(self.fds) or target == source:
                        continue
                    seconds = len(packet) / self.rate
                    up_done = max(now, uplink_free[source]) + seconds
                    down_start = max(up_done, downlink_free[target])
                    if up_done - now > self.queue or down_start - up_done > self.queue:
                        self.dropped += 1
                        continue
                    uplink_free[source] = up_done
                    downlink_free[target] = down_start + seconds
                    sequence += 1
                    heapq.heappush(pending, (down_start + seconds + self.delay, sequence, target, packet))


@contextmanager
def delayed_hosts(n: int, rate_mbit: float, latency_ms: float, tcp: dict[str, str] | None = None):
    """``n`` hosts like :func:`emulated_hosts`, joined by a :class:`DelaySwitch` instead of a bridge: every link
    carries ``rate_mbit`` each way and a packet takes ``latency_ms`` one way from host to host (plus its time on
    the two links). Works without the netem qdisc."""
    import fcntl
    import struct
    import threading

    _remove_leftovers()
    created, fds = [], []
    switch = None
    thread = None
    try:
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
        switch = DelaySwitch(fds, rate_mbit * 1e6 / 8, latency_ms / 1e3)
        thread = threading.Thread(target=switch.run, name="delay-switch", daemon=True)
        thread.start()
        yield [host_ns(i) for i in range(n)]
    finally:
        if switch is not None:
            switch.stopped = True
        if thread is not None:
            thread.join(timeout=5)
        for fd in fds:
            os.close(fd)
        for ns in reversed(created):
            sh("ip", "netns", "del", ns, check=False)
