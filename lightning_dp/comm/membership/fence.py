"""Fencing a process group: end every connection of its gloo context, so that no operation on it waits any more.

gloo's ``ProcessGroup.abort()`` and ``shutdown()`` leave a thread blocked in a wait where it is: the wait ends
only when a connection it waits on closes. A fence shuts down (``shutdown(2)``, not ``close``: gloo still owns
the descriptors) the TCP connections the group opened when it was created. Every operation of this process on the
group then fails at once, and so does every operation a peer waits for from this process on it, so that the
ranks of a job that fence together all leave their exchanges within milliseconds, wherever each one waited. No
message of the fenced group can land in memory after the fence has been seen (a receive that has not completed
fails instead).

Linux only (the sockets are found in ``/proc``); elsewhere a fence finds no connections and waits end only by the
group's timeout.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple, TypeVar

T = TypeVar("T")


def socket_descriptors() -> dict[int, str]:
    """The file descriptors of this process that are sockets, each with its socket's identity (``socket:[inode]``,
    which a descriptor number reused for another socket does not keep); empty where ``/proc`` is not available."""
    found: dict[int, str] = {}
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return found
    for name in names:
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            found[int(name)] = target
    return found


def _is_connection(fd: int) -> bool:
    """Whether ``fd`` is a TCP socket that is not listening (gloo's listener must stay: shutting it down aborts
    the process)."""
    try:
        sock = socket.socket(fileno=fd)
    except OSError:
        return False
    try:
        return sock.type == socket.SOCK_STREAM and not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
    except OSError:
        return False
    finally:
        sock.detach()


class Connection(NamedTuple):
    """A TCP connection of a group: its descriptor and both ends' addresses (a descriptor the group closed and the
    process reused for another socket is not the same connection: a fence leaves it alone)."""

    fd: int
    ends: tuple[Any, Any]


def _ends(fd: int) -> tuple[Any, Any] | None:
    try:
        sock = socket.socket(fileno=fd)
    except OSError:
        return None
    try:
        return sock.getsockname(), sock.getpeername()
    except OSError:
        return None
    finally:
        sock.detach()


def connections_opened_by(
    create: Callable[[], T], exclude: Callable[[], Iterable[int]] = lambda: ()
) -> tuple[T, list[Connection]]:
    """Run ``create`` (which creates a gloo process group) and return its result with the TCP connections it
    opened, to :func:`fence` later. ``exclude()``, asked once ``create`` returns: the descriptors of sockets another
    thread of this process owns (a control plane that accepted a connection meanwhile), left out.

    A socket is new by its identity, not its descriptor number: one that another thread closed meanwhile may have
    handed its number to a connection of the group."""
    before = set(socket_descriptors().values())
    result = create()
    after = socket_descriptors()
    owned = set(exclude())
    opened = [fd for fd, identity in sorted(after.items()) if identity not in before and fd not in owned]
    connections = [Connection(fd, ends) for fd in opened if _is_connection(fd) and (ends := _ends(fd))]
    return result, connections


def fence(connections: Iterable[Connection]) -> None:
    """Shut down ``connections`` (from :func:`connections_opened_by`) for reading and writing, each where its
    descriptor is still that connection. Never raises."""
    for fd, ends in connections:
        if _ends(fd) != ends:  # closed, or its descriptor reused by another socket since
            continue
        try:
            sock = socket.socket(fileno=fd)
        except OSError:
            continue
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:  # already shut down, or closed by the peer
            pass
        finally:
            sock.detach()
