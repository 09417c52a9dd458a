"""`POST /v1/audio/speech`, OpenAI-compatible: text in, one encoded audio stream out.

The synthesis starts and its first chunk is awaited before the response starts, so a bad voice or
text gets its status code; after that the body streams: `stream_format: audio` sends the encoded
bytes as they are made (chunked transfer), `sse` sends `speech.audio.delta` events with base64
audio and one `speech.audio.done`. A client that goes away cancels the task iterating the
synthesis, which aborts the engine request; the stream slot is released when the response ends.
"""
from __future__ import annotations

import base64
import contextlib
import json
from typing import AsyncIterator, Awaitable, Callable, Literal

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from async_cosyvoice.demo import served_model_name
from async_cosyvoice.errors import InvalidRequest
from async_cosyvoice.request import AudioChunk, SynthesisOptions, SynthesisRequest

from .audio import OPENAI_FORMATS, OPENAI_SAMPLE_RATE, EncodedAudio
from .backend import Backend, backend_of
from .call import HttpCall
from .errors import INTERNAL, error_body, error_response, request_id_of, status_for
from .voice import choose_voice

router = APIRouter()

OPENAI_TTS_MODELS = ("tts-1", "tts-1-hd", "gpt-4o-mini-tts")


class VoiceRef(BaseModel):
    id: str


class SpeechRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")  # drop-in: OpenAI clients may send fields we do not use

    model: str
    input: str
    voice: str | VoiceRef
    instructions: str | None = None
    response_format: str = "mp3"
    speed: float = Field(1.0, strict=True)  # strict: true is not 1.0 (ints are still floats)
    stream_format: Literal["audio", "sse"] = "audio"
    seed: int | None = Field(None, strict=True, description="extension: the same seed gives the same audio (0..2^64-1)")


def check_model(backend: Backend, model: str) -> None:
    served = served_model_name(backend.config)
    if model not in (served, *OPENAI_TTS_MODELS):
        raise InvalidRequest(f"model {model!r} is not served; use {served!r} (GET /v1/models) or one of "
                             f"{', '.join(OPENAI_TTS_MODELS)}")


def check_format(body: SpeechRequest) -> None:
    if body.response_format not in OPENAI_FORMATS:
        raise InvalidRequest(f"response_format {body.response_format!r} is not supported; one of "
                             f"{', '.join(OPENAI_FORMATS)}")


def peer(request: Request) -> str:
    return f"{request.client.host}:{request.client.port}" if request.client else "-"


class AudioStreamResponse(StreamingResponse):
    """A StreamingResponse that always runs `on_close` (release the slot, abort, log), even when the
    body was never iterated or the client went away mid-stream."""

    def __init__(self, content, on_close: Callable[[], Awaitable[None]], **kwargs):
        super().__init__(content, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._on_close()


@router.post("/v1/audio/speech")
async def create_speech(body: SpeechRequest, request: Request):
    backend = backend_of(request)
    call = HttpCall("POST /v1/audio/speech", peer(request), request_id_of(request))
    call.format = body.response_format
    cleanup = contextlib.AsyncExitStack()
    try:
        synth = backend.synthesizer()
        check_model(backend, body.model)
        check_format(body)
        synth.rules.check_text(body.input, "input")  # speed and the rest: checked by the synthesizer
        voice = body.voice.id if isinstance(body.voice, VoiceRef) else body.voice
        call.voice = voice
        choice = await choose_voice(synth, backend.config, voice, body.instructions)
        call.mode = choice.mode.value
        call.stream = body.speed == 1.0  # speed is applied to a whole utterance's mel (upstream rule)
        await cleanup.enter_async_context(backend.limiter.slot())
        options = SynthesisOptions(stream=call.stream, speed=body.speed, seed=body.seed)
        chunks = synth.synthesize(SynthesisRequest(
            mode=choice.mode, text=body.input, speaker_id=choice.speaker_id, instruct_text=choice.instruct_text,
            options=options, request_id=call.request_id))
        cleanup.push_async_callback(chunks.aclose)  # aborts the engine request if we stop early
        audio = await EncodedAudio.open(body.response_format, OPENAI_SAMPLE_RATE, synth.sample_rate,
                                        backend.encode_pool)
        first = await anext(chunks)
    except BaseException as e:  # noqa: B036 - CancelledError is re-raised
        call.failed(e)
        await cleanup.aclose()
        call.finish(backend.metrics)
        if not isinstance(e, Exception):
            raise
        return error_response(e, call.request_id)

    done = False

    async def on_close() -> None:
        if not done and call.status == "200":
            call.status = "CANCELLED"  # the client went away before the end
        await cleanup.aclose()
        call.finish(backend.metrics)

    async def encoded() -> AsyncIterator[bytes]:
        nonlocal done
        chunk: AudioChunk | None = first
        while chunk is not None:
            data = await audio.encode(chunk.samples)
            call.chunk(len(chunk.samples), chunk.sample_rate, len(data), chunk.first_segment_timeline)
            if data:
                yield data
            if chunk.is_final:
                call.tokens = int(chunk.n_tokens)
                break
            chunk = await anext(chunks, None)
        tail = await audio.finish()
        call.bytes_out += len(tail)
        if tail:
            yield tail
        done = True

    async def guarded(events: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        """After the status line went out, an error can only end the body (audio: cut short)."""
        try:
            async for item in events:
                yield item
        except Exception as e:
            call.failed(e)
            raise

    headers = {"x-request-id": call.request_id}
    if body.stream_format == "sse":
        return AudioStreamResponse(sse_events(encoded(), call), on_close, media_type="text/event-stream",
                                   headers={**headers, "cache-control": "no-cache"})
    return AudioStreamResponse(guarded(encoded()), on_close, media_type=audio.content_type, headers=headers)


async def sse_events(encoded: AsyncIterator[bytes], call: HttpCall) -> AsyncIterator[bytes]:
    """OpenAI's speech SSE: `speech.audio.delta` {audio: base64} ... then `speech.audio.done` {usage}.
    An error after the start becomes an `error` event (the status line was 200 already)."""
    try:
        async for data in encoded:
            yield _event({"type": "speech.audio.delta", "audio": base64.b64encode(data).decode()})
    except Exception as e:
        call.failed(e)
        status = status_for(e)
        message = call.detail if status is not INTERNAL else f"internal error (request id {call.request_id})"
        yield _event({"type": "error", **error_body(status, message)})
        return
    usage = {"input_tokens": 0, "output_tokens": call.tokens, "total_tokens": call.tokens}
    yield _event({"type": "speech.audio.done", "usage": usage})


def _event(payload: dict) -> bytes:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n".encode()
