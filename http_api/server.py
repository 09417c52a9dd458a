"""uvicorn inside an existing event loop: the HTTP front door shares the gRPC server's loop.

`uvicorn.Server.serve()` would install its own signal handlers and a ticking main loop; the
gRPC server owns both, so this starts and stops uvicorn's listener directly.
"""
from __future__ import annotations

import asyncio
import logging
import ssl
from pathlib import Path

import uvicorn

from async_cosyvoice.config import ServerConfig

from .app import create_app
from .backend import Backend
from .connection import with_head_deadline
from .protocol import JsonErrorsProtocol

log = logging.getLogger("http_api")


def tls_files(server: ServerConfig) -> tuple[Path, Path] | None:
    """(certificate, key) of the HTTP door: its own (http_tls_cert/http_tls_key), else gRPC's
    (tls_cert/tls_key); None when TLS is not configured."""
    if bool(server.http_tls_cert) != bool(server.http_tls_key):
        raise ValueError("server.http_tls_cert and server.http_tls_key go together")
    if server.http_tls_cert:
        return server.http_tls_cert, server.http_tls_key
    if server.tls_cert and server.tls_key:
        return server.tls_cert, server.tls_key
    return None


class HttpFrontDoor:
    def __init__(self, backend: Backend, host: str, port: int):
        self.backend = backend
        server = backend.config.server
        self.tls = tls_files(server)
        tls = {}
        if self.tls:
            tls = {"ssl_certfile": str(self.tls[0]), "ssl_keyfile": str(self.tls[1])}
            if server.tls_client_ca:  # mTLS on both doors
                tls.update(ssl_ca_certs=str(server.tls_client_ca), ssl_cert_reqs=ssl.CERT_REQUIRED)
        limits = backend.config.limits
        # one log line per request is ours (logger http_api); uvicorn logs only warnings and errors
        self.app = create_app(backend)  # the ASGI app served (FastAPI, with the middlewares of app.py)
        self._config = uvicorn.Config(self.app, host=host, port=port, lifespan="off", access_log=False,
                                      log_config=None, log_level="warning", ws="websockets-sansio", ws_max_size=1 << 20,
                                      timeout_graceful_shutdown=1,
                                      http=with_head_deadline(JsonErrorsProtocol, limits.first_message_seconds),
                                      timeout_keep_alive=limits.idle_connection_seconds, **tls)
        self._server = uvicorn.Server(self._config)
        self.host = host
        self.port: int | None = None

    async def start(self) -> int:
        config = self._config
        config.load()
        self._server.lifespan = config.lifespan_class(config)
        try:
            await self._server.startup()
        except SystemExit:  # uvicorn exits the process when it cannot bind; we report instead
            raise RuntimeError(f"cannot bind the HTTP port {config.host}:{config.port}") from None
        self.port = self._server.servers[0].sockets[0].getsockname()[1]
        log.info("HTTP on %s://%s:%d (OpenAI /v1/audio/speech, WebSocket /v1/audio/speech/stream, page /)",
                 "https" if self.tls else "http", self.host, self.port)
        return self.port

    def end_sessions(self, message: str) -> list[asyncio.Task]:
        """End every open WebSocket session with an error message saying `message` and close code
        1012 (service restart) with a reason. Returns their handler tasks."""
        return self.backend.end_sessions(message)

    async def stop(self, grace: float = 1.0) -> None:
        """Stop accepting, let open responses finish for `grace` seconds, then cancel them.
        WebSocket sessions still open (waiting for a config, say) are ended with a reason first:
        uvicorn's own shutdown closes them with 1012 and nothing else."""
        if not self._server.started:
            return
        left = self.end_sessions("the server is shutting down; retry on another instance")
        if left:
            await asyncio.wait(left, timeout=max(0.1, grace))
        self._config.timeout_graceful_shutdown = max(0.1, grace)
        self._server.started = False
        await self._server.shutdown()
        self.backend.encode_pool.shutdown(wait=False, cancel_futures=True)
