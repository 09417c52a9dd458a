"""The HTTP door's body guards (http_api/app.py: BodyLimit 413, BodyDeadline 408) against a real
server on 127.0.0.1 (HTTP only, model never ready: no model load) with raw-socket clients, so the
bytes on the wire are what is checked: exactly one response per request, and a guard never cuts a
response the app has started.

No shipped route answers before its body is complete (FastAPI reads a body before the route
runs), so one test route is added to the served app: it streams its answer without reading the
body, for longer than limits.body_read_seconds.
"""
from __future__ import annotations

import asyncio
import re
import socket
import time

import pytest
from fastapi import Request
from fastapi.responses import StreamingResponse

from async_cosyvoice.config import Config
from grpc_async.server import ServerThread

BODY_READ = 1.0      # limits.body_read_seconds
FIRST_MESSAGE = 2.0  # limits.first_message_seconds: also ends a connection whose body never completed
LIMIT = 4096         # limits.max_message_bytes
PARTS, PART_GAP = 6, 0.5  # the early route streams for PARTS * PART_GAP = 3 s > BODY_READ
EARLY = "/test/answers-early"


async def _never_ready(config):
    await asyncio.Event().wait()


async def answers_early(request: Request) -> StreamingResponse:
    async def parts():
        for i in range(PARTS):
            yield b"part %d\n" % i
            await asyncio.sleep(PART_GAP)
    return StreamingResponse(parts(), media_type="text/plain")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    cfg = Config.model_validate({
        "server": {"port": None, "http_port": 0, "grace_seconds": 0},
        "speakers": {"dir": str(tmp_path_factory.mktemp("spk-guards"))},
        "limits": {"body_read_seconds": BODY_READ, "first_message_seconds": FIRST_MESSAGE,
                   "max_message_bytes": LIMIT}})
    st = ServerThread(cfg, ready_timeout=None, synthesizer_factory=_never_ready)
    st.server.http.app.add_api_route(EARLY, answers_early, methods=["POST"])
    yield st
    st.close(grace=0)


def _connect(server) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.server.http_port), timeout=30)


def _read_until(s: socket.socket, end: bytes) -> bytes:
    data = b""
    while end not in data and (chunk := s.recv(65536)):
        data += chunk
    return data


def _read_to_close(s: socket.socket) -> tuple[bytes, float]:
    t0, data = time.monotonic(), b""
    while chunk := s.recv(65536):
        data += chunk
    return data, time.monotonic() - t0


def _status_lines(data: bytes) -> list[bytes]:
    return re.findall(rb"HTTP/1\.1 \d{3}", data)


def _dechunk(data: bytes) -> bytes:
    """The body of a chunked response (`data` starts at its head)."""
    body, rest = b"", data.split(b"\r\n\r\n", 1)[1]
    while True:
        size, rest = rest.split(b"\r\n", 1)
        n = int(size, 16)
        if n == 0:
            return body
        body, rest = body + rest[:n], rest[n + 2:]


def test_a_response_started_before_the_body_deadline_is_not_cut(server):
    """The client declares 100 bytes and sends 10; the route answers at once and streams for 3 s.
    The deadline passes mid-stream: no 408, and the app's whole response arrives. (Before, the
    deadline told the streaming response the client was gone and dropped its later parts.)"""
    with _connect(server) as s:
        s.sendall(b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n" % EARLY.encode() + b"x" * 10)
        t0 = time.monotonic()
        data = _read_until(s, b"\r\n0\r\n\r\n")
        streamed = time.monotonic() - t0
        assert _status_lines(data) == [b"HTTP/1.1 200"], data[:300]
        assert data.endswith(b"\r\n0\r\n\r\n"), f"the response was cut after {streamed:.1f} s: {data!r}"
        assert _dechunk(data) == b"".join(b"part %d\n" % i for i in range(PARTS))
        assert streamed > BODY_READ  # the deadline did pass while the response streamed
        # the request's body never completed: the connection cannot carry another request and is closed
        rest, waited = _read_to_close(s)
    assert rest == b"" and waited < FIRST_MESSAGE + 10


def test_a_body_over_the_limit_after_the_app_answered_is_the_apps(server):
    """The route answers on the first body chunk; the body then grows past the limit: no 413 after
    the app's 200, and its response arrives in full."""
    with _connect(server) as s:
        s.sendall(b"POST %s HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n" % EARLY.encode())
        head = _read_until(s, b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200"), head[:300]
        big = b"y" * (2 * LIMIT)
        s.sendall(b"%x\r\n%s\r\n0\r\n\r\n" % (len(big), big))
        data = head + _read_until(s, b"\r\n0\r\n\r\n")
    assert _status_lines(data) == [b"HTTP/1.1 200"], data[:300]
    assert _dechunk(data) == b"".join(b"part %d\n" % i for i in range(PARTS))


def test_a_body_shorter_than_its_content_length_gets_one_408(server):
    """A route that reads its body (POST /v1/audio/speech): one 408 after the deadline, nothing of
    the app after it, and the connection closed."""
    body = b'{"model": "tts-1", "input": "Hi.", "voice": "alloy"}'
    with _connect(server) as s:
        s.sendall(b"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n" % (len(body) + 100) + body)
        data, waited = _read_to_close(s)
    assert _status_lines(data) == [b"HTTP/1.1 408"], data[:300]
    assert b"limits.body_read_seconds" in data and b"x-request-id" in data.lower()
    assert BODY_READ <= waited < BODY_READ + 10


def test_a_streamed_body_over_the_limit_gets_one_413(server):
    with _connect(server) as s:
        s.sendall(b"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Transfer-Encoding: chunked\r\n\r\n")
        part = b"z" * 1024
        for _ in range(LIMIT // len(part) + 1):
            s.sendall(b"%x\r\n%s\r\n" % (len(part), part))
        data = _read_until(s, b"}")
    assert _status_lines(data) == [b"HTTP/1.1 413"], data[:300]
    assert b"limits.max_message_bytes" in data
