"""Byte counters for the traffic a rank sends and receives."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field


@dataclass
class CommStats:
    """Bytes this rank sent and received since the last :meth:`reset`. Thread-safe (the comm thread adds to it)."""

    bytes_sent: int = 0
    bytes_received: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, sent: int = 0, received: int = 0) -> None:
        with self._lock:
            self.bytes_sent += sent
            self.bytes_received += received

    def __getstate__(self) -> dict:
        return {"bytes_sent": self.bytes_sent, "bytes_received": self.bytes_received}

    def __setstate__(self, state: dict) -> None:
        self.__init__(**state)

    def reset(self) -> tuple[int, int]:
        """Zero the counters and return the ``(sent, received)`` they held."""
        with self._lock:
            totals = (self.bytes_sent, self.bytes_received)
            self.bytes_sent = self.bytes_received = 0
            return totals
