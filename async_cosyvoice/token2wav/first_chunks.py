"""Streams still owed their first chunk, so that background work on the device gives way to them.

A new listener waits for its first chunk: the LLM's first tokens, then one token2wav batch. A CUDA
graph capture beside them (the token2wav batcher's capture thread) holds the GIL for much of a
second and runs its warm-up calls on the card; on an H200 the first request after SERVING, which
ran beside the cover captures that follow SERVING, took 1.84x the warm p50, all of the excess in
its LLM part (141 ms to its tokens against 50 ms warm; docs/perf/h200-covers/). So before each
capture the capture thread waits until no stream that started within `grace_s` owes its first
chunk, for at most `max_wait_s`: arrivals that never stop must not starve the captures, and a
stream that has owed its first chunk longer than `grace_s` (a text-in stream waiting for its
text) holds nothing back. A capture already under way is not interrupted.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

__all__ = ["FirstChunksOwed"]


class FirstChunksOwed:
    def __init__(self, grace_s: float = 1.0, max_wait_s: float = 3.0,
                 clock: Callable[[], float] = time.monotonic):
        if grace_s < 0 or max_wait_s < 0:
            raise ValueError(f"grace_s and max_wait_s must be >= 0, got {grace_s} and {max_wait_s}")
        self.grace_s, self.max_wait_s = grace_s, max_wait_s
        self._clock = clock
        self._since: dict[int, float] = {}  # stream key -> when it started, while it owes its first chunk
        self._changed: asyncio.Event | None = None  # set when a stream stops owing (a give_way is waiting)

    def started(self, key: int) -> None:
        self._since[key] = self._clock()

    def served(self, key: int) -> None:
        """The stream's first chunk is done (delivered, failed or dropped) or the stream ended."""
        if self._since.pop(key, None) is not None and self._changed is not None:
            self._changed.set()

    @property
    def owed(self) -> int:
        return len(self._since)

    async def give_way(self) -> float:
        """Wait while a stream that started within `grace_s` owes its first chunk, at most
        `max_wait_s`; returns the seconds waited."""
        start = self._clock()
        deadline = start + self.max_wait_s
        while True:
            now = self._clock()
            young_until = [t + self.grace_s for t in self._since.values() if now - t < self.grace_s]
            if not young_until or now >= deadline:
                return now - start
            self._changed = asyncio.Event()
            try:  # until one stops owing, the youngest ages out or the wait is up, whichever comes first
                await asyncio.wait_for(self._changed.wait(), min(min(young_until), deadline) - now)
            except TimeoutError:
                pass
            finally:
                self._changed = None
