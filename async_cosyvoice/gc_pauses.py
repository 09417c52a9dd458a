"""Python's garbage-collection pauses, counted and, when a full collection is long, logged.

A collection stops every thread of the process (it holds the GIL) for as long as it scans its
generation; a full one (generation 2) scans every object not frozen, so after a start that compiled
and captured it can take tens of milliseconds, in the middle of whichever request allocated last.
The warm-up freezes the start's objects (warmup.settle_heap); this log shows what is left:
`full garbage collection: 85 ms (...)` at INFO for each full collection of at least `slow_s`.
"""
from __future__ import annotations

import gc
import logging
import time
from collections import Counter

log = logging.getLogger(__name__)


class GCPauses:
    """A `gc.callbacks` entry: pauses per generation (`count`, `seconds`), long full ones logged."""

    def __init__(self, slow_s: float = 0.02):
        self.slow_s = slow_s
        self.count: Counter = Counter()
        self.seconds: Counter = Counter()
        self._started: float | None = None

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":  # the collecting thread holds the GIL until "stop": one collection at a time
            self._started = time.perf_counter()
            return
        if self._started is None:
            return
        pause, self._started = time.perf_counter() - self._started, None
        generation = info["generation"]
        self.count[generation] += 1
        self.seconds[generation] += pause
        if generation == 2 and pause >= self.slow_s:
            log.info("full garbage collection: %.0f ms (%d objects freed, %d frozen ones not scanned)", pause * 1e3,
                     info["collected"], gc.get_freeze_count())


GC_PAUSES = GCPauses()


def watch_gc_pauses() -> GCPauses:
    """Count (and log the long full ones of) this process's collections from now on; once per process."""
    if GC_PAUSES not in gc.callbacks:
        gc.callbacks.append(GC_PAUSES)
    return GC_PAUSES


def unwatch_gc_pauses() -> None:
    """Stop watching (a closing server: its last collections are no pause of a request)."""
    if GC_PAUSES in gc.callbacks:
        gc.callbacks.remove(GC_PAUSES)
