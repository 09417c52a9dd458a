"""Handing freed heap memory back to the OS, so a long-running server's resident memory stays bounded.

glibc's malloc keeps what a process frees inside its arenas (one per thread that allocates, up to
8 per core) and returns only what lies at the top of a heap. A server whose threads (frontend
pool, token2wav and LM threads, ONNX Runtime, gRPC) allocate and free buffers sized by the
longest utterance so far ends up with hundreds of MiB free but resident: measured on the soak
(tiny model, 2-core CPU box), RSS 1,155 MiB with 200 MiB of it in use and 490 MiB free in the
arenas; `malloc_trim(0)` brought it to 777 MiB in 50 ms. Its growth also raises glibc's
dynamic mmap threshold, so later large buffers land in the arenas too. That is not a leak (the
in-use bytes stay flat), but RSS that climbs in steps of 300 MiB defeats memory limits and alarms.

`HeapTrimmer` calls `malloc_trim(0)` in a worker thread when a synthesis stream ends and the
last trim is at least `min_interval` seconds old: driven by the work that frees the memory, at
most one trim at a time, no timer. Where libc has no `malloc_trim` (musl, macOS) it does nothing.
"""
from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging
import time

log = logging.getLogger(__name__)


def _malloc_trim():
    """libc's malloc_trim, or None off glibc."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        trim = libc.malloc_trim
    except (OSError, AttributeError, TypeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


class HeapTrimmer:
    def __init__(self, min_interval: float):
        self.min_interval = min_interval
        self._trim = _malloc_trim() if min_interval > 0 else None
        self._last = time.monotonic()
        self._task: asyncio.Task | None = None
        self.trims = 0
        self.seconds = 0.0  # spent inside malloc_trim, all trims together

    @property
    def enabled(self) -> bool:
        return self._trim is not None

    def stream_ended(self) -> None:
        """Call on the event loop when a synthesis stream ends; starts a trim if one is due."""
        if self._trim is None or (self._task is not None and not self._task.done()):
            return
        if time.monotonic() - self._last < self.min_interval:
            return
        self._task = asyncio.get_running_loop().create_task(self._run(), name="malloc-trim")

    async def _run(self) -> None:
        start = time.monotonic()
        try:
            await asyncio.to_thread(self._trim, 0)
        finally:
            self._last = time.monotonic()
            self.trims += 1
            self.seconds += self._last - start
        log.debug("malloc_trim took %.1f ms", (self._last - start) * 1e3)

    async def close(self) -> None:
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)
