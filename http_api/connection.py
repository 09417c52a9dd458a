"""A deadline for each request's head on the HTTP door's connections, which uvicorn does not have.

uvicorn closes a keep-alive connection that stays idle after a response (`timeout_keep_alive`,
set from limits.idle_connection_seconds), but its timer stops at the first byte received, and a
new connection has none: a client that connects and sends nothing, or half a request line, was
held forever. `with_head_deadline(protocol, seconds)` is uvicorn's protocol (httptools or h11)
with one more timer: each request's head (request line and headers) must be complete within
`seconds` of the connection opening or of the previous response; else the connection is closed
(there is no request yet to answer). The body has its own deadline (app.BodyDeadline,
limits.body_read_seconds); a WebSocket's config its own (limits.first_message_seconds).
"""
from __future__ import annotations

import asyncio


class _HeadDeadline:
    head_seconds: float = 10.0
    _head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm_head_timer()

    def on_headers_complete(self) -> None:  # httptools: the head is parsed
        super().on_headers_complete()
        self._cancel_head_timer()

    def handle_events(self) -> None:  # h11: a request's cycle starts once its head is parsed
        super().handle_events()
        if self.cycle is not None and not self.cycle.response_complete:
            self._cancel_head_timer()

    def handle_websocket_upgrade(self, *args) -> None:
        self._cancel_head_timer()
        super().handle_websocket_upgrade(*args)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and (self.cycle is None or self.cycle.response_complete):
            self._arm_head_timer()  # the next request's head

    def connection_lost(self, exc) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    def _arm_head_timer(self) -> None:
        self._cancel_head_timer()
        self._head_timer = self.loop.call_later(self.head_seconds, self._head_timeout)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timeout(self) -> None:
        self._head_timer = None
        if self.cycle is None or self.cycle.response_complete:
            self.timeout_keep_alive_handler()  # uvicorn's own close of a connection with no request


def with_head_deadline(protocol: type[asyncio.Protocol], head_seconds: float) -> type[asyncio.Protocol]:
    """`protocol` (a uvicorn HTTP protocol class) whose connections must send each request's head
    within `head_seconds`."""
    return type(f"HeadDeadline{protocol.__name__}", (_HeadDeadline, protocol), {"head_seconds": head_seconds})
