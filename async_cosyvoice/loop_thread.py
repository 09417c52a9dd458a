"""An asyncio event loop in a background thread, for callers without one (scripts, tests, a
server started from synchronous code)."""
from __future__ import annotations

import asyncio
import queue
import threading
from typing import AsyncIterator, Awaitable, Iterator, TypeVar

T = TypeVar("T")
_DONE = object()


class LoopThread:
    def __init__(self, name: str = "event-loop"):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def call(self, coro: Awaitable[T], timeout: float | None = None) -> T:
        """Run a coroutine on the loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def iterate(self, items: AsyncIterator[T]) -> Iterator[T]:
        """An async iterator consumed on the loop, as a plain iterator in the caller's thread.
        Leaving the loop early cancels the consumer (which closes `items`)."""
        out: queue.Queue = queue.Queue()

        async def pump():
            try:
                async for item in items:
                    out.put(item)
            except BaseException as e:  # noqa: B036 - handed to the caller's thread
                out.put(e)
            finally:
                out.put(_DONE)

        future = asyncio.run_coroutine_threadsafe(pump(), self.loop)
        try:
            while (item := out.get()) is not _DONE:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            future.cancel()

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.close()
