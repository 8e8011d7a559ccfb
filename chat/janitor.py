"""The janitor: frees sessions idle past `app.session_ttl_s`, and hands the memory they held back to the OS."""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging
import threading
import time

from chat.api import SessionService

log = logging.getLogger("chat.janitor")


def _return_freed_memory() -> None:
    """Hand freed heap pages back to the OS (glibc keeps them in per-thread arenas otherwise, so a
    server's RSS would never shrink after idle sessions' banks are freed)."""
    libc = ctypes.util.find_library("c")
    if libc:
        try:
            ctypes.CDLL(libc).malloc_trim(0)
        except (OSError, AttributeError):  # not glibc
            pass


class Janitor:
    """A thread that frees the service's idle sessions every few seconds, from `start` to `close`."""

    def __init__(self, service: SessionService):
        self.service = service
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="recall-chat-janitor", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._closing.set()

    def _loop(self) -> None:
        ttl = self.service.cfg.app.session_ttl_s
        while not self._closing.wait(min(5.0, ttl / 2)):
            self.free_idle_sessions(ttl)

    def free_idle_sessions(self, ttl: float) -> int:
        """Free every session idle for more than `ttl` seconds with nothing running; how many."""
        now = time.monotonic()
        idle = [s for s in list(self.service.sessions.values())
                if now - s.last_used > ttl and not any(not r.done.is_set() for r in s.active)]
        for s in idle:
            log.info("session %d idle for %.0f s: freed", s.id, now - s.last_used)
            lost = s.own_bank is not None or s.conv is not None and bool(s.conv.messages)
            self.service.end_session(s)
            s.expired = now - s.last_used if lost else None  # (what it held is said at its next answer)
        if idle:
            gc.collect()
            _return_freed_memory()
        return len(idle)
