"""One concurrency limit for all front doors: gRPC and HTTP streams take slots from the same limiter.

Transport-neutral (the library never imports a transport; the transports share this object).
`idle` is set while no stream runs, so a shutdown can wait for in-flight work of every front door.
"""
from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator, Callable

from .errors import Overloaded


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
