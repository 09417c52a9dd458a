"""Request bytes that are not the method's message (corrupt wire data, invalid UTF-8 in a string)
get INVALID_ARGUMENT with what failed, on every RPC, health and reflection included.

grpc deserializes before the handler runs and answers a failing deserializer with UNKNOWN
"Unexpected <class 'DecodeError'>" (and a traceback in the log). This interceptor gives every
handler a deserializer that returns an `Undecodable` in place of raising; a unary handler then
aborts with INVALID_ARGUMENT, and a streaming one raises InvalidRequest where the bad message
arrives in its request iterator (the servicer's error path turns it into INVALID_ARGUMENT).
"""
from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass

import grpc

from async_cosyvoice.errors import InvalidRequest

log = logging.getLogger("grpc_async.server")


@dataclass(frozen=True)
class Undecodable:
    message: str  # what failed, for the INVALID_ARGUMENT


def _tolerant(deserializer, method: str):
    def deserialize(data: bytes):
        try:
            return deserializer(data)
        except Exception as e:  # noqa: BLE001 - DecodeError, or what a custom deserializer raises
            return Undecodable(f"the request message of {method} cannot be decoded ({type(e).__name__}: {e}); "
                               "send a serialized message of the method's request type (strings must be UTF-8)")
    return deserialize


class UndecodableRequests(grpc.aio.ServerInterceptor):
    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or handler.request_deserializer is None:
            return handler
        method = details.method
        kinds = (("unary_unary", grpc.unary_unary_rpc_method_handler, False),
                 ("unary_stream", grpc.unary_stream_rpc_method_handler, False),
                 ("stream_unary", grpc.stream_unary_rpc_method_handler, True),
                 ("stream_stream", grpc.stream_stream_rpc_method_handler, True))
        for attr, make, streaming in kinds:
            behavior = getattr(handler, attr)
            if behavior is not None:
                break
        else:
            return handler
        if not (inspect.iscoroutinefunction(behavior) or inspect.isasyncgenfunction(behavior)):
            return handler  # a synchronous handler: none in this server
        return make(_checking(behavior, streaming, method),
                    request_deserializer=_tolerant(handler.request_deserializer, method),
                    response_serializer=handler.response_serializer)


def _checking(behavior, streaming: bool, method: str):
    """`behavior` that refuses an Undecodable request (unary) or raises where one arrives (streaming)."""
    async def checked(requests):
        async for request in requests:
            if isinstance(request, Undecodable):
                raise InvalidRequest(request.message)
            yield request

    async def refuse_or_run(request, context):
        if streaming:
            request = checked(request)
        elif isinstance(request, Undecodable):
            log.info("rpc method=%s status=INVALID_ARGUMENT detail=%r", method, request.message)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        return request

    if inspect.isasyncgenfunction(behavior):
        async def generator(request, context):
            async for response in behavior(await refuse_or_run(request, context), context):
                yield response
        return generator

    async def coroutine(request, context):
        return await behavior(await refuse_or_run(request, context), context)
    return coroutine
