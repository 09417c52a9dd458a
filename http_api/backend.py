"""What the HTTP routes are built from (`Backend`, shared with the gRPC front door) and who may call."""
from __future__ import annotations

import asyncio
import hmac
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Protocol

from fastapi import Request
from starlette.requests import HTTPConnection

from async_cosyvoice.config import Config
from async_cosyvoice.limiter import StreamLimiter

from .errors import UNAUTHORIZED, ApiError

if TYPE_CHECKING:
    from async_cosyvoice.request import FirstChunkParts
    from async_cosyvoice.tts import Synthesizer


class RequestRecorder(Protocol):
    """What the HTTP door records of each finished request (the server's metrics, shared with gRPC)."""

    def record_request(self, method: str, mode: str, status: str, ok: bool, stream: str, elapsed: float,
                       first_chunk: float | None, audio_seconds: float, tokens: int, chunks: int,
                       first_chunk_parts: "FirstChunkParts | None" = None) -> None: ...


@dataclass
class Backend:
    """What the HTTP front door shares with the gRPC one."""
    config: Config
    metrics: RequestRecorder
    limiter: StreamLimiter
    synthesizer: Callable[[], "Synthesizer"]  # the ready Synthesizer, or raises NotReady
    # audio encoding runs here, never on the event loop
    encode_pool: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(max_workers=4, thread_name_prefix="http-encode"))
    sessions: set[asyncio.Task] = field(default_factory=set)  # open WebSocket handler tasks
    ending: str | None = None  # set by end_sessions: what the cancelled sessions tell their clients

    def end_sessions(self, message: str) -> list[asyncio.Task]:
        """Cancel every open WebSocket session; each tells its client `message` (websocket.py)."""
        self.ending = message
        tasks = list(self.sessions)
        for task in tasks:
            task.cancel()
        return tasks

    def check_token(self, authorization: str | None) -> None:
        token = self.config.server.auth_token
        if not token:
            return
        if not authorization:
            raise ApiError(UNAUTHORIZED, "missing 'Authorization: Bearer <token>' header")
        if not hmac.compare_digest(authorization.encode(), f"Bearer {token}".encode()):
            raise ApiError(UNAUTHORIZED, "invalid bearer token")


def backend_of(request: Request) -> Backend:
    return request.app.state.backend


def bearer(connection: HTTPConnection) -> str | None:
    """`Authorization: Bearer` header, or `?api_key=` for browsers (they cannot set WebSocket
    headers, nor the API docs page its fetch's)."""
    if "authorization" in connection.headers:
        return connection.headers["authorization"]
    key = connection.query_params.get("api_key")
    return f"Bearer {key}" if key is not None else None


async def require_token(request: Request) -> None:
    backend_of(request).check_token(request.headers.get("authorization"))
