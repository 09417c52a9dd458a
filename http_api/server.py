"""uvicorn inside an existing event loop: the HTTP front door shares the gRPC server's loop.

`uvicorn.Server.serve()` would install its own signal handlers and a ticking main loop; the
gRPC server owns both, so this starts and stops uvicorn's listener directly.
"""
from __future__ import annotations

import logging

import uvicorn

from .app import create_app
from .backend import Backend

log = logging.getLogger("http_api")


class HttpFrontDoor:
    def __init__(self, backend: Backend, host: str, port: int):
        self.backend = backend
        # one log line per request is ours (logger http_api); uvicorn logs only warnings and errors
        self._config = uvicorn.Config(create_app(backend), host=host, port=port, lifespan="off", access_log=False,
                                      log_config=None, log_level="warning", ws="websockets-sansio", ws_max_size=1 << 20,
                                      timeout_graceful_shutdown=1)
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
        log.info("HTTP on http://%s:%d (OpenAI /v1/audio/speech, WebSocket /v1/audio/speech/stream, page /)",
                 self.host, self.port)
        return self.port

    async def stop(self, grace: float = 1.0) -> None:
        """Stop accepting, let open responses finish for `grace` seconds, then cancel them."""
        if not self._server.started:
            return
        self._config.timeout_graceful_shutdown = max(0.1, grace)
        self._server.started = False
        await self._server.shutdown()
        self.backend.encode_pool.shutdown(wait=False, cancel_futures=True)
