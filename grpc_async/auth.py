"""Who may call: optional bearer-token auth (health checks exempt) and optional (m)TLS credentials."""
from __future__ import annotations

import hmac
import logging

import grpc

from async_cosyvoice.config import Config

log = logging.getLogger("grpc_async.server")  # one logger for the whole service

HEALTH_EXEMPT = ("/grpc.health.v1.Health/",)


class BearerToken:
    """The check of `authorization: Bearer <token>` metadata (also run by the Ray ingress, whose
    proxy runs no interceptors)."""

    def __init__(self, token: str):
        if not token:
            raise ValueError("auth token must not be empty")
        self._expected = f"Bearer {token}".encode()

    def problem(self, metadata) -> str | None:
        """What is wrong with the call's metadata, or None when it carries the token."""
        values = [v for k, v in (metadata or ()) if k == "authorization"]
        if not values:
            return "missing 'authorization: Bearer <token>' metadata"
        value = values[0].encode() if isinstance(values[0], str) else values[0]
        if len(values) > 1 or not hmac.compare_digest(value, self._expected):
            return "invalid bearer token"
        return None


class BearerAuthInterceptor(grpc.aio.ServerInterceptor):
    """Requires `authorization: Bearer <token>` metadata on every RPC but health checks."""

    def __init__(self, token: str, exempt: tuple[str, ...] = HEALTH_EXEMPT):
        self._token = BearerToken(token)
        self._exempt = exempt

    async def intercept_service(self, continuation, details):
        if details.method.startswith(self._exempt):
            return await continuation(details)
        problem = self._token.problem(details.invocation_metadata)
        handler = await continuation(details)
        if problem is None or handler is None:
            return handler
        log.info("rpc method=%s status=UNAUTHENTICATED detail=%r", details.method, problem)
        return _deny_handler(handler, problem)


def _deny_handler(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    async def deny(_request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    kinds = [("unary_unary", grpc.unary_unary_rpc_method_handler),
             ("unary_stream", grpc.unary_stream_rpc_method_handler),
             ("stream_unary", grpc.stream_unary_rpc_method_handler),
             ("stream_stream", grpc.stream_stream_rpc_method_handler)]
    for attr, make in kinds:
        if getattr(handler, attr) is not None:
            return make(deny, request_deserializer=handler.request_deserializer,
                        response_serializer=handler.response_serializer)
    raise TypeError(f"unknown handler kind: {handler!r}")


def server_credentials(config: Config) -> grpc.ServerCredentials | None:
    s = config.server
    if not s.tls_cert and not s.tls_key:
        if s.tls_client_ca:
            raise ValueError("server.tls_client_ca needs server.tls_cert and server.tls_key")
        return None
    if not (s.tls_cert and s.tls_key):
        raise ValueError("TLS needs both server.tls_cert and server.tls_key")
    ca = s.tls_client_ca.read_bytes() if s.tls_client_ca else None
    return grpc.ssl_server_credentials([(s.tls_key.read_bytes(), s.tls_cert.read_bytes())],
                                       root_certificates=ca, require_client_auth=ca is not None)
