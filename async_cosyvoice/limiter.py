"""Admission: one concurrency limit for all front doors (gRPC and HTTP streams take slots from the
same `StreamLimiter`), and one memory budget for the requests that run (`MemoryBudget`).

Transport-neutral (the library never imports a transport; the transports share this object).
`idle` is set while no stream runs, so a shutdown can wait for in-flight work of every front door.
"""
from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator, Callable

from .errors import Overloaded, TooLarge


class StreamLimiter:
    def __init__(self, max_streams: int, on_reject: Callable[[], None] | None = None,
                 on_release: Callable[[], None] | None = None):
        self.max_streams = max_streams
        self.active = 0
        self.idle = asyncio.Event()
        self.idle.set()
        self._on_reject = on_reject
        self._on_release = on_release  # after each stream, e.g. HeapTrimmer.stream_ended

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        """Hold one stream slot for the body; raises Overloaded when all are taken."""
        if self.active >= self.max_streams:
            if self._on_reject is not None:
                self._on_reject()
            raise Overloaded(f"{self.max_streams} synthesis streams are already running "
                             "(limits.max_concurrent_streams); retry later")
        self.active += 1
        self.idle.clear()
        try:
            yield
        finally:
            self.active -= 1
            if not self.active:
                self.idle.set()
            if self._on_release is not None:
                self._on_release()


class MemoryBudget:
    """The admission bounds (cost.py) of running requests, within `capacity` bytes.

    `reserve(nbytes)` refuses a request over `max_request` (or over the whole capacity) with
    TooLarge at once; one that does not fit beside the running ones waits, first come first
    served, up to `wait_seconds` for them to end, then is shed with Overloaded. capacity None:
    no budget, only the per-request limit."""

    def __init__(self, max_request: int | None, capacity: int | None, wait_seconds: float):
        self.max_request, self.capacity, self.wait_seconds = max_request, capacity, wait_seconds
        self.used = 0
        self._waiters: list[tuple[int, asyncio.Future]] = []

    def check(self, nbytes: int) -> None:
        """TooLarge for a request that can never be admitted."""
        if self.max_request is not None and nbytes > self.max_request:
            raise TooLarge(f"this request may need up to {nbytes / 2**20:.0f} MiB; the limit is "
                           f"{self.max_request / 2**20:.0f} MiB per request (limits.max_request_bytes): "
                           "ask for fewer tokens, a shorter text or prompt")
        if self.capacity is not None and nbytes > self.capacity:
            raise TooLarge(f"this request may need up to {nbytes / 2**20:.0f} MiB, more than all requests "
                           f"together may use ({self.capacity / 2**20:.0f} MiB, limits.memory_budget_bytes)")

    @contextlib.asynccontextmanager
    async def reserve(self, nbytes: int) -> AsyncIterator[None]:
        self.check(nbytes)
        if self.capacity is not None and (self._waiters or self.used + nbytes > self.capacity):
            entry = (nbytes, asyncio.get_running_loop().create_future())
            self._waiters.append(entry)
            try:
                await asyncio.wait_for(asyncio.shield(entry[1]), self.wait_seconds)
            except BaseException as e:
                if entry[1].done() and not entry[1].cancelled():  # admitted as it gave up
                    self._release(nbytes)
                else:
                    entry[1].cancel()
                    self._waiters.remove(entry)
                    self._wake()  # those behind it may fit
                if isinstance(e, TimeoutError):
                    raise Overloaded(f"the running requests hold {self.used / 2**20:.0f} of "
                                     f"{self.capacity / 2**20:.0f} MiB (limits.memory_budget_bytes) and this one "
                                     f"may need {nbytes / 2**20:.0f} MiB; not enough ended within "
                                     f"{self.wait_seconds:g} s (limits.admission_wait_seconds); retry later") from None
                raise
        else:
            self.used += nbytes
        try:
            yield
        finally:
            self._release(nbytes)

    def _release(self, nbytes: int) -> None:
        self.used -= nbytes
        self._wake()

    def _wake(self) -> None:
        """Admit waiters in order while the first one fits (its bytes are counted here)."""
        while self._waiters and self.used + self._waiters[0][0] <= self.capacity:
            nbytes, waiter = self._waiters.pop(0)
            self.used += nbytes
            waiter.set_result(None)
