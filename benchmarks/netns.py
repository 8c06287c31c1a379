"""Emulated hosts on one machine: network namespaces joined by a bridge, every link rate-limited with tc.

Used by ``emulated_cluster.py`` and by the multi-node tests. Addresses (10.77.0.0/24) exist only inside the
namespaces created here (named ``lddp-*``), and everything is removed on exit, also on errors.
"""

from __future__ import annotations

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
        if name.startswith((f"{PREFIX}v", f"{PREFIX}s")) and name[len(PREFIX) + 1 :].isdigit():
            sh("ip", "link", "del", name, check=False)


@contextmanager
def emulated_hosts(n: int, rate_mbit: float, delay_ms: float = 0.0):
    """Create ``n`` hosts joined by a bridge in a switch namespace; every link shaped to ``rate_mbit`` both ways."""
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
            sh("ip", "-n", switch, "link", "set", f"{PREFIX}s{i}", "master", "br0")
            sh("ip", "-n", switch, "link", "set", f"{PREFIX}s{i}", "up")
            for netns, dev in ((ns, IFNAME), (switch, f"{PREFIX}s{i}")):  # upload and download of host i
                shape = ["tbf", "rate", f"{rate_mbit}mbit", "burst", "256kb", "latency", "200ms"]
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
