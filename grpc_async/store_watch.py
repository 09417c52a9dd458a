"""Health follows the speaker store: NOT_SERVING from the moment a call finds it unreachable (Redis
down) until it answers again.

The store flips `reachable` on the call that fails (any front door, any thread); `StoreWatch` hears
that, turns health NOT_SERVING and pings the store with exponential back-off until it answers,
then turns health back to SERVING. While the store is down, requests that need it get UNAVAILABLE
(StoreUnavailable) and the rest (synthesis from prompt audio) still run: NOT_SERVING tells load
balancers to prefer another replica, it does not refuse anything by itself.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable

from async_cosyvoice.errors import StoreUnavailable
from async_cosyvoice.speakers import SpeakerStoreBase

log = logging.getLogger("grpc_async.server")

FIRST_RETRY_SECONDS = 0.1
MAX_RETRY_SECONDS = 5.0


class StoreWatch:
    def __init__(self, store: SpeakerStoreBase, on_change: Callable[[bool], Awaitable[None]]):
        self.store = store
        self._on_change = on_change  # (reachable) -> set health
        self._down = asyncio.Event()
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        loop = asyncio.get_running_loop()

        def heard(reachable: bool) -> None:  # any thread
            if not reachable:
                loop.call_soon_threadsafe(self._down.set)

        self.store.watch(heard)
        if not self.store.reachable:
            self._down.set()
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while True:
            await self._down.wait()
            log.error("speaker store %s is unreachable: health NOT_SERVING, requests for stored speakers get "
                      "UNAVAILABLE; reconnecting", self.store)
            await self._on_change(False)
            delay = FIRST_RETRY_SECONDS
            while True:
                try:
                    await asyncio.to_thread(self.store.ping)
                    break
                except StoreUnavailable:
                    await asyncio.sleep(delay)
                    delay = min(2 * delay, MAX_RETRY_SECONDS)
            self._down.clear()
            if not self.store.reachable:  # failed again since the ping
                self._down.set()
                continue
            log.info("speaker store %s answers again: health SERVING", self.store)
            await self._on_change(True)

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
