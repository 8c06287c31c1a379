"""Join a process group whose sockets listen only on the configured interface.

``init_process_group("env://")`` starts torch's TCP store listening on every interface of the main node, and
gloo picks whatever address the machine's hostname resolves to. Here the store listens only on the main
address (``MASTER_ADDR``) and gloo / NCCL use the one interface that carries traffic towards it: loopback when
the main address is loopback (every single-node run), the cluster-facing interface otherwise.

Across several hosts NCCL keeps choosing its own interfaces (InfiniBand, several NICs): only gloo is narrowed.
The store has no authentication: whoever reaches its port can join or disturb the run. Binding narrowly keeps
it off other networks; the cluster's private network must still be trusted.
"""

from __future__ import annotations

import errno
import ipaddress
import logging
import os
import socket
import struct
from datetime import timedelta

import torch.distributed as dist

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
        return dist.TCPStore(main_address, main_port, world_size, is_master=True, timeout=timeout, multi_tenant=True)
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
) -> None:
    """``dist.init_process_group`` with the store on ``main_address:main_port`` only and gloo on the interface
    towards it (NCCL too when ``single_host``). ``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME`` set by the user win.

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

    # the prefix init_process_group gives its own rendezvous store: keys never collide with torchrun's agent
    store = dist.PrefixStore("default_pg", _store(main_address, address, main_port, rank, world_size, timeout))
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
