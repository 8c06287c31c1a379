"""The TCP sockets this process holds, read from /proc (Linux; elsewhere the list is empty)."""

from __future__ import annotations

import ipaddress
import os

LISTEN = "0A"


def _address(hex_address: str) -> str:
    raw = bytes.fromhex(hex_address)
    # /proc/net/tcp* prints each 32-bit word of the address in host (little-endian) order
    swapped = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    address = ipaddress.ip_address(swapped)
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return str(address)


def tcp_sockets() -> list[dict]:
    """``{"address", "port", "listening"}`` for every TCP socket among this process's file descriptors."""
    if not os.path.isdir("/proc/self/fd"):
        return []
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        if not os.path.exists(table):
            continue
        with open(table) as f:
            next(f)
            for line in f:
                fields = line.split()
                if fields[9] in inodes:
                    host, port = fields[1].split(":")
                    found.append({"address": _address(host), "port": int(port, 16), "listening": fields[3] == LISTEN})
    return found
