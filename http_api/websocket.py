"""`/v1/audio/speech/stream`: text pieces in as they arrive (LLM tokens, words, sentences), audio out.

Protocol (every message is a JSON text frame; the schema is in NOTES-http.md):
  client -> {"type": "config", "voice": id, "instructions"?, "format"?, "sample_rate"?, "options"?: {...},
             "text_mode"?: "bistream" | "sentence", "text_normalization"?: "safe" | "raw"}
            {"type": "text", "text": "..."}*   {"type": "flush"}   {"type": "end"}
  server -> {"type": "ready", "text_mode", ...}  {"type": "audio", "index", "sample_offset", "num_samples",
            "is_final", "audio": base64}*  {"type": "done", summary}   or   {"type": "error", "code", "message"}
The socket closes after `done` (1000) or `error` (4000 + the HTTP status). A client that closes
the socket cancels everything: the reader sees the close and cancels the synthesis task, whose
iterator close aborts the engine request.
"""
from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import re
import time
from typing import AsyncIterator

from fastapi import APIRouter, WebSocket, WebSocketDisconnect

from async_cosyvoice.errors import InvalidRequest
from async_cosyvoice.request import FLUSH, SynthesisOptions, SynthesisRequest
from async_cosyvoice.request_front import default_text_mode

from .audio import STREAM_FORMATS, EncodedAudio
from .backend import Backend, bearer
from .call import HttpCall
from .errors import INTERNAL, status_for
from .voice import choose_voice

router = APIRouter()

MIN_RATE, MAX_RATE = 8000, 48000
_REQUEST_ID_RE = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
_OPTION_TYPES = {"seed": int, "text_frontend": bool, "first_hop": int}


class ClientGone(Exception):
    """The client closed the socket."""


async def _receive(ws: WebSocket) -> dict:
    message = await ws.receive()
    if message["type"] == "websocket.disconnect":
        raise ClientGone()
    text = message.get("text")
    if text is None:
        raise InvalidRequest("send JSON text frames (binary frames are not part of this protocol)")
    try:
        data = json.loads(text)
    except ValueError as e:
        raise InvalidRequest(f"message is not valid JSON ({e})") from None
    if not isinstance(data, dict) or not isinstance(data.get("type"), str):
        raise InvalidRequest('each message must be a JSON object with a "type" (config, text, flush, end)')
    return data


def _options(given: object) -> SynthesisOptions:
    if given is None:
        given = {}
    if not isinstance(given, dict):
        raise InvalidRequest("config.options must be an object")
    unknown = sorted(set(given) - set(_OPTION_TYPES))
    if unknown:
        raise InvalidRequest(f"config.options: unknown {', '.join(unknown)}; known are "
                             f"{', '.join(_OPTION_TYPES)}")
    for name, kind in _OPTION_TYPES.items():
        value = given.get(name)
        if value is not None and (type(value) is not kind):
            raise InvalidRequest(f"config.options.{name} must be {kind.__name__}, got {json.dumps(value)}")
    seed = given.get("seed")
    if seed is not None and seed < 0:
        raise InvalidRequest(f"config.options.seed must be >= 0, got {seed}")
    return SynthesisOptions(stream=True, seed=seed, text_frontend=given.get("text_frontend", True),
                            first_hop=given.get("first_hop"))


class _Session:
    """One socket: config, then a reader task (text -> queue) and a speaker task (audio out)."""

    def __init__(self, ws: WebSocket, backend: Backend, call: HttpCall):
        self.ws, self.backend, self.call = ws, backend, call
        self.pieces: asyncio.Queue = asyncio.Queue()  # str | FLUSH | None (end)

    async def configure(self) -> tuple[SynthesisRequest, str, int, str, str | None]:
        backend, call = self.backend, self.call
        synth = backend.synthesizer()
        config = await _receive(self.ws)
        if config["type"] != "config":
            raise InvalidRequest(f'the first message must be {{"type": "config", "voice": ...}}, got type '
                                 f'{config["type"]!r}')
        unknown = sorted(set(config) - {"type", "voice", "instructions", "format", "sample_rate", "options",
                                        "request_id", "text_mode", "text_normalization"})
        if unknown:
            raise InvalidRequest(f"config: unknown field(s) {', '.join(unknown)}")
        fmt = config.get("format", "pcm")
        if fmt not in STREAM_FORMATS:
            raise InvalidRequest(f"config.format {fmt!r} is not supported; one of {', '.join(STREAM_FORMATS)}")
        rate = config.get("sample_rate", synth.sample_rate)
        if type(rate) is not int or not MIN_RATE <= rate <= MAX_RATE:
            raise InvalidRequest(f"config.sample_rate must be an integer in {MIN_RATE}..{MAX_RATE} Hz, got "
                                 f"{json.dumps(rate)}")
        request_id = config.get("request_id")
        if request_id is not None:
            if not isinstance(request_id, str) or not _REQUEST_ID_RE.fullmatch(request_id):
                raise InvalidRequest("config.request_id must be 1-64 characters from A-Z a-z 0-9 _ . -")
            call.request_id = request_id
        text_mode = config.get("text_mode", default_text_mode(synth.supports_bistream))
        if text_mode not in ("bistream", "sentence"):
            raise InvalidRequest(f"config.text_mode must be 'bistream' or 'sentence', got {json.dumps(text_mode)}")
        normalization = config.get("text_normalization")  # None: the library's default (safe)
        if normalization is not None and not isinstance(normalization, str):
            raise InvalidRequest("config.text_normalization must be a string (safe or raw)")
        instructions = config.get("instructions")
        if instructions is not None and not isinstance(instructions, str):
            raise InvalidRequest("config.instructions must be a string")
        options = _options(config.get("options"))
        call.voice, call.format, call.stream = str(config.get("voice", ""))[:80], fmt, True
        choice = await choose_voice(synth, backend.config, config.get("voice"), instructions, "config.voice")
        call.mode = choice.mode.value
        request = SynthesisRequest(mode=choice.mode, text="", speaker_id=choice.speaker_id,
                                   instruct_text=choice.instruct_text, options=options, request_id=call.request_id)
        return request, fmt, rate, text_mode, normalization

    async def read(self) -> None:
        """Text pieces into the queue until `end`; then only a close is expected. Returns never:
        raises ClientGone on close, InvalidRequest on a bad message."""
        limit = self.backend.config.limits.max_text_chars
        ended = got_text = False
        while True:
            message = await _receive(self.ws)
            kind = message["type"]
            if ended:
                raise InvalidRequest(f"message of type {kind!r} after end")
            if kind == "text":
                text = message.get("text")
                if not isinstance(text, str):
                    raise InvalidRequest('a text message needs "text": a string')
                if len(text) > limit:
                    raise InvalidRequest(f"a text message is {len(text)} characters long; the limit is {limit} "
                                         "(limits.max_text_chars)")
                if text:
                    if not got_text:  # first-chunk latency counts from the first text
                        self.call.clock_start, got_text = time.perf_counter(), True
                    self.pieces.put_nowait(text)
            elif kind == "flush":
                self.pieces.put_nowait(FLUSH)
            elif kind == "end":
                self.pieces.put_nowait(None)
                ended = True
            elif kind == "config":
                raise InvalidRequest("config may be sent only once, as the first message")
            else:
                raise InvalidRequest(f"unknown message type {kind!r}; one of text, flush, end")

    async def text(self) -> AsyncIterator:
        while (item := await self.pieces.get()) is not None:
            yield item

    async def speak(self, synth, request: SynthesisRequest, audio: EncodedAudio, text_mode: str,
                    normalization: str | None) -> None:
        """Chunks of the text stream -> audio messages; the library ends every stream with a final chunk
        (it may carry no samples), which also carries the encoder's tail."""
        call = self.call
        stream = synth.synthesize_stream(self.text(), request, text_mode=text_mode, text_normalization=normalization)
        async with contextlib.aclosing(stream) as chunks:
            async for chunk in chunks:
                data = await audio.encode(chunk.samples)
                if chunk.is_final:
                    data += await audio.finish()
                    call.tokens = int(chunk.n_tokens)
                call.chunk(len(chunk.samples), chunk.sample_rate, len(data), chunk.first_segment_timeline)
                await self.ws.send_text(json.dumps({
                    "type": "audio", "index": chunk.index, "sample_offset": chunk.sample_offset,
                    "num_samples": len(chunk.samples), "is_final": chunk.is_final,
                    "audio": base64.b64encode(data).decode()}))
                if chunk.is_final:
                    break


_CLOSE_NORMAL = 1000
_CLOSE_SERVICE_RESTART = 1012


@router.websocket("/v1/audio/speech/stream")
async def speech_stream(ws: WebSocket) -> None:
    backend: Backend = ws.app.state.backend
    client = f"{ws.client.host}:{ws.client.port}" if ws.client else "-"
    call = HttpCall("WS /v1/audio/speech/stream", client)
    session = _Session(ws, backend, call)
    tasks: list[asyncio.Task] = []
    await ws.accept()
    backend.sessions.add(asyncio.current_task())
    try:
        backend.check_token(bearer(ws))
        request, fmt, rate, text_mode, normalization = await session.configure()
        synth = backend.synthesizer()
        async with backend.limiter.slot():
            audio = await EncodedAudio.open(fmt, rate, synth.sample_rate, backend.encode_pool)
            await ws.send_text(json.dumps({"type": "ready", "request_id": call.request_id, "format": fmt,
                                           "sample_rate": rate, "content_type": audio.content_type,
                                           "text_mode": text_mode}))
            reader = asyncio.create_task(session.read())
            speaker = asyncio.create_task(session.speak(synth, request, audio, text_mode, normalization))
            tasks = [reader, speaker]
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            if not speaker.done():  # the reader ended first: the client closed or sent a bad message
                speaker.cancel()
                reader.result()
            speaker.result()
        await ws.send_text(json.dumps({"type": "done", **call.summary()}))
        await ws.close(_CLOSE_NORMAL)
    except (ClientGone, WebSocketDisconnect):  # starlette turns a send to a closed socket into the latter
        call.status = "CANCELLED"
    except asyncio.CancelledError:
        if backend.ending is None:
            call.status = "CANCELLED"
            raise
        # the server is shutting down (end_sessions): say so, then close with 1012 (service restart)
        call.status, call.detail = "503", backend.ending
        with contextlib.suppress(Exception):
            await ws.send_text(json.dumps({"type": "error", "code": "unavailable", "status": 503,
                                           "message": backend.ending}))
            await ws.close(_CLOSE_SERVICE_RESTART, reason="server shutting down; retry on another instance")
    except Exception as e:
        call.failed(e)
        status = status_for(e)
        message = call.detail if status is not INTERNAL else f"internal error (request id {call.request_id})"
        with contextlib.suppress(Exception):  # the client may be gone already
            await ws.send_text(json.dumps({"type": "error", "code": status.code, "status": status.http,
                                           "message": message}))
            await ws.close(4000 + status.http, reason=status.code)
    finally:
        backend.sessions.discard(asyncio.current_task())
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(BaseException):
                await task
        call.finish(backend.metrics)
