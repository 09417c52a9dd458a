"""Our servicer, written for grpc.aio, run inside a Ray Serve ingress method.

grpc.aio handlers write streamed messages with `context.write` and fail with `context.abort`;
Ray Serve's ingress methods are generators that yield messages and fail by raising after setting
the status on Ray's `grpc_context`. `RayCallContext` is the grpc.aio side of that bridge and
`serve_streaming` / `serve_unary` the Ray side.
"""
from __future__ import annotations

import asyncio
import contextvars
import logging
from typing import Any, AsyncIterator, Awaitable, Callable

import grpc

from grpc_async.auth import BearerToken

log = logging.getLogger("grpc_async.server")  # the plain server's logger: one log for the service

# The Ray grpc_context of the RPC being served (read by RemoteSynthesizer to tag the response
# with the replica that did the work).
current_call: contextvars.ContextVar["RayCallContext | None"] = contextvars.ContextVar("current_call", default=None)

_END = object()


class Aborted(Exception):
    """Raised by `abort`; Ray sends the status set on its grpc_context just before."""


class RayCallContext:
    """The part of grpc.aio.ServicerContext our servicer uses, over Ray's RayServegRPCContext."""

    def __init__(self, ray_context):
        self.ray_context = ray_context
        self.messages: asyncio.Queue = asyncio.Queue()
        self._trailing: dict[str, str | bytes] = {}

    async def write(self, message) -> None:
        self.messages.put_nowait(message)

    async def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata=()) -> None:
        for key, value in trailing_metadata:  # google.rpc details (grpc-status-details-bin)
            self.add_trailer(key, value)
        self.ray_context.set_code(code)
        self.ray_context.set_details(details)
        raise Aborted(details)

    async def send_initial_metadata(self, metadata) -> None:
        # Ray's ingress has no initial metadata: what we would send there rides in the trailers
        for key, value in metadata:
            self.add_trailer(key, value)

    def add_trailer(self, key: str, value: str | bytes) -> None:
        self._trailing[key] = value
        self.ray_context.set_trailing_metadata(list(self._trailing.items()))

    def peer(self) -> str:
        return self.ray_context.peer()

    def time_remaining(self) -> float | None:
        return None

    def invocation_metadata(self):
        return self.ray_context.invocation_metadata()


def authorize(auth: BearerToken | None, ray_context) -> None:
    """What the plain server's BearerAuthInterceptor does: UNAUTHENTICATED without the token."""
    problem = None if auth is None else auth.problem(ray_context.invocation_metadata())
    if problem is not None:
        log.info("rpc status=UNAUTHENTICATED detail=%r", problem)
        ray_context.set_code(grpc.StatusCode.UNAUTHENTICATED)
        ray_context.set_details(problem)
        raise Aborted(problem)


async def serve_streaming(handler: Callable[[Any, RayCallContext], Awaitable[None]], request,
                          ray_context, auth: BearerToken | None = None) -> AsyncIterator:
    """Run a grpc.aio streaming handler (after the token check); yield what it writes; raise what it raised."""
    authorize(auth, ray_context)
    call = RayCallContext(ray_context)
    token = current_call.set(call)
    task = asyncio.ensure_future(handler(request, call))
    current_call.reset(token)
    task.add_done_callback(lambda _: call.messages.put_nowait(_END))
    try:
        while (message := await call.messages.get()) is not _END:
            yield message
        task.result()
    finally:
        task.cancel()


async def serve_unary(handler: Callable[[Any, RayCallContext], Awaitable[Any]], request, ray_context,
                      auth: BearerToken | None = None):
    authorize(auth, ray_context)
    call = RayCallContext(ray_context)
    token = current_call.set(call)
    try:
        return await handler(request, call)
    finally:
        current_call.reset(token)
