"""Handing freed heap memory back to the OS, so a long-running server's resident memory stays bounded.

glibc's malloc keeps what a process frees inside its arenas (one per thread that allocates, up to
8 per core) and returns only what lies at the top of a heap. Its mmap threshold also rises to the
size of each large block freed (128 KiB up to 32 MiB), after which large buffers live in the
arenas too. A server whose threads (frontend pool, token2wav and LM threads, ONNX Runtime, gRPC)
allocate and free buffers sized by the utterance at hand ends up with hundreds of MiB free but
resident. Measured on the soak (tiny model, 2-core CPU box, default plan): RSS 1,155 MiB of which
200 MiB in use and 490 MiB free in the arenas; `malloc_trim(0)` brought it to 777 MiB in 50 ms.
Not a leak (the in-use bytes stay flat), but RSS that moves in steps of 300 MiB defeats memory
limits and alarms. Two remedies, both on by default in the server (docs/robustness.md):

- `fix_mmap_threshold`: every allocation >= 1 MiB gets its own mmap and goes back to the OS
  when freed (the server's entry point sets it; it is process-wide).
- `HeapTrimmer`: `malloc_trim(0)` in a worker thread when a synthesis stream ends and the last
  trim is at least `min_interval` seconds old: driven by the work that frees the memory, at most
  one trim at a time, no timer.

Where libc has neither function (musl, macOS) both do nothing.
"""
from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging
import os
import time

log = logging.getLogger(__name__)


M_MMAP_THRESHOLD = -3  # mallopt parameter (malloc.h)


def _libc_function(name: str, argtypes: list, restype):
    """A glibc function by name, or None (musl, macOS, no libc found)."""
    try:
        fn = getattr(ctypes.CDLL(ctypes.util.find_library("c")), name)
    except (OSError, AttributeError, TypeError):
        return None
    fn.argtypes, fn.restype = argtypes, restype
    return fn


def _malloc_trim():
    return _libc_function("malloc_trim", [ctypes.c_size_t], ctypes.c_int)


def fix_mmap_threshold(nbytes: int) -> bool:
    """Serve every allocation of `nbytes` or more with its own mmap, returned to the OS on free.
    glibc's default threshold starts at 128 KiB but rises to the size of each large block freed
    (up to 32 MiB), after which big buffers live in the arenas and their memory stays resident;
    setting it fixes it. A process-wide setting: the server's entry point calls this, an embedding
    application decides for itself. MALLOC_MMAP_THRESHOLD_ in the environment wins (returns
    False, as does a libc without mallopt)."""
    if nbytes <= 0 or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    mallopt = _libc_function("mallopt", [ctypes.c_int, ctypes.c_int], ctypes.c_int)
    return mallopt is not None and mallopt(M_MMAP_THRESHOLD, nbytes) == 1


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
