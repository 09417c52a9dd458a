"""The CosyVoice gRPC service on grpc.aio.

One process, one event loop: the servicer turns protobuf requests into `SynthesisRequest`s,
iterates `Synthesizer.synthesize(...)` and writes `AudioChunk` messages. When a client goes
away or its deadline passes, grpc cancels the handler task; the CancelledError unwinds through
the `finally` that closes the synthesizer's iterator, which aborts the engine request.

Also served: grpc.health.v1 (NOT_SERVING until the model is loaded and warmed up, and again
during shutdown), server reflection, optional bearer-token auth (health exempt), optional TLS,
Prometheus metrics on a side HTTP port, one structured log line per RPC.

Entry points: `run(config)` (blocking, used by `async-cosyvoice serve`), `serve(config)`
(coroutine) and `CosyVoiceServer` (start/stop in an existing loop, e.g. tests).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import hmac
import logging
import math
import re
import signal
import struct
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Awaitable, Callable

import grpc
import numpy as np
import soxr
from google.protobuf.timestamp_pb2 import Timestamp
from grpc_health.v1 import health as grpc_health
from grpc_health.v1 import health_pb2
from grpc_health.v1 import health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from async_cosyvoice.config import Config
from async_cosyvoice.errors import (CosyVoiceError, InvalidRequest, NotReady, Overloaded,
                                   SpeakerExists, SpeakerNotFound, Unsupported)
from async_cosyvoice.speakers import SpeakerInfo, SpeakerRecord, validate_speaker_id
from async_cosyvoice.tts import Audio, Mode, SynthesisOptions, SynthesisRequest

from ._stubs import SERVICE_NAME, load as _load_stubs
from .metrics import Metrics

if TYPE_CHECKING:
    from async_cosyvoice.tts import Synthesizer

pb2, pb2_grpc = _load_stubs()
log = logging.getLogger("grpc_async.server")

NATIVE_SAMPLE_RATE = 24000
MIN_OUTPUT_RATE, MAX_OUTPUT_RATE = 8000, 192000
MIN_SPEED, MAX_SPEED = 0.5, 2.0
MAX_CHUNK_BYTES = 1 << 20      # larger payloads are split over several AudioChunks
TOKENS_PER_SECOND = 25         # speech tokens per second of audio (CosyVoice2)
HEALTH_EXEMPT = ("/grpc.health.v1.Health/",)
_REQUEST_ID_RE = re.compile(r"[A-Za-z0-9_.\-]{1,64}")

_STATUS_OF: list[tuple[type[Exception], grpc.StatusCode]] = [
    (InvalidRequest, grpc.StatusCode.INVALID_ARGUMENT),
    (SpeakerNotFound, grpc.StatusCode.NOT_FOUND),
    (SpeakerExists, grpc.StatusCode.ALREADY_EXISTS),
    (Unsupported, grpc.StatusCode.FAILED_PRECONDITION),
    (Overloaded, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (NotReady, grpc.StatusCode.UNAVAILABLE),
]


def status_for(error: CosyVoiceError) -> grpc.StatusCode:
    for cls, code in _STATUS_OF:
        if isinstance(error, cls):
            return code
    return grpc.StatusCode.INTERNAL


# ---------------------------------------------------------------------------------------------
# Audio out: encoding, resampling, chunking


def wav_header(num_samples: int | None, sample_rate: int) -> bytes:
    """44-byte RIFF/WAVE header for mono PCM16. `None` samples: streaming, sizes 0xFFFFFFFF."""
    if num_samples is None:
        riff_size = data_size = 0xFFFFFFFF
    else:
        data_size = 2 * num_samples
        riff_size = 36 + data_size
    return struct.pack("<4sI4s4sIHHIIHH4sI", b"RIFF", riff_size, b"WAVE", b"fmt ", 16, 1, 1,
                       sample_rate, 2 * sample_rate, 2, 16, b"data", data_size)


def float_to_pcm16(x: np.ndarray) -> bytes:
    return (np.clip(x, -1.0, 1.0) * 32767.0).round().astype("<i2").tobytes()


class AudioEncoder:
    """Float32 chunks at the model rate -> AudioChunk messages in the requested encoding and rate.

    Resampling is one soxr stream per response, so chunk boundaries are seamless and the total
    length is round(n * out_rate / in_rate). `sample_offset` and `num_samples` count samples at
    the output rate. WAV non-stream collects everything so the header carries exact sizes.
    """

    def __init__(self, encoding: int, in_rate: int, out_rate: int, stream: bool,
                 max_chunk_bytes: int = MAX_CHUNK_BYTES):
        self.encoding = encoding or pb2.AUDIO_ENCODING_PCM16
        self.in_rate, self.out_rate = in_rate, out_rate
        self._resampler = None if in_rate == out_rate else soxr.ResampleStream(
            in_rate, out_rate, 1, dtype="float32", quality="HQ")
        self._wav = self.encoding == pb2.AUDIO_ENCODING_WAV
        self._collect = self._wav and not stream
        self._pending: list[np.ndarray] = []
        self._header_sent = False
        bytes_per_sample = 4 if self.encoding == pb2.AUDIO_ENCODING_FLOAT32 else 2
        self._max_samples = max(1, max_chunk_bytes // bytes_per_sample)
        self.index = 0
        self.samples = 0      # samples emitted, at out_rate
        self.finished = False

    @property
    def seconds(self) -> float:
        return self.samples / self.out_rate

    def _encode(self, x: np.ndarray) -> bytes:
        if self.encoding == pb2.AUDIO_ENCODING_FLOAT32:
            return x.astype("<f4", copy=False).tobytes()
        return float_to_pcm16(x)

    def push(self, samples: np.ndarray, final: bool) -> list[pb2.AudioChunk]:
        if self.finished:
            raise RuntimeError("push after the final chunk")
        x = np.asarray(samples, dtype=np.float32).reshape(-1)
        if self._resampler is not None:
            x = self._resampler.resample_chunk(x, last=final)
        header = b""
        if self._collect:
            self._pending.append(x)
            if not final:
                return []
            x = np.concatenate(self._pending)
            self._pending = []
            header = wav_header(len(x), self.out_rate)
        elif self._wav and not self._header_sent and (len(x) or final):
            header = wav_header(None, self.out_rate)
        if not len(x) and not final:
            return []
        self._header_sent = self._header_sent or bool(header)
        pieces = [x[i:i + self._max_samples] for i in range(0, len(x), self._max_samples)] or [x]
        out = []
        for k, piece in enumerate(pieces):
            last = k == len(pieces) - 1
            out.append(pb2.AudioChunk(
                audio=(header if k == 0 else b"") + self._encode(piece),
                encoding=self.encoding, sample_rate=self.out_rate, index=self.index,
                is_final=final and last, sample_offset=self.samples, num_samples=len(piece)))
            self.index += 1
            self.samples += len(piece)
        self.finished = final
        return out


# ---------------------------------------------------------------------------------------------
# StreamSynthesize: text pieces -> sentences

_SENTENCE_END = set("。！？；!?;…\n")
_TRAILING = set("。！？；!?;….\"'”’)）」』】》")
_SOFT_BREAK = set(",，、:：")


class SentenceSplitter:
    """Buffers text pieces and cuts complete sentences.

    A sentence ends at 。！？；!?;… or a newline (plus any closing quotes/brackets and repeated
    enders already received), or at '.' followed by whitespace (so "3.14" stays whole; a final
    '.' waits for the next piece or the end). Text longer than `max_chars` without an end is cut
    at the last comma or space (else hard) so latency stays bounded.
    """

    def __init__(self, max_chars: int = 200):
        self.max_chars = max(8, max_chars)
        self._buf = ""

    @property
    def pending(self) -> str:
        return self._buf

    def feed(self, piece: str) -> list[str]:
        self._buf += piece
        return self._cut()

    def flush(self) -> list[str]:
        out = self._cut()
        rest, self._buf = self._buf, ""
        return out + _keep([rest])

    def _end(self) -> int | None:
        buf = self._buf
        for i, ch in enumerate(buf):
            if ch in _SENTENCE_END or (ch == "." and i + 1 < len(buf) and buf[i + 1].isspace()):
                j = i + 1
                while j < len(buf) and buf[j] in _TRAILING:
                    j += 1
                return j
        return None

    def _cut(self) -> list[str]:
        out = []
        while (j := self._end()) is not None:
            out.append(self._buf[:j])
            self._buf = self._buf[j:]
        while len(self._buf) > self.max_chars:
            head = self._buf[:self.max_chars]
            cut = max((i + 1 for i, ch in enumerate(head) if ch in _SOFT_BREAK or ch.isspace()), default=0)
            if cut < self.max_chars // 2:
                cut = self.max_chars
            out.append(self._buf[:cut])
            self._buf = self._buf[cut:]
        return _keep(out)


def _keep(sentences: list[str]) -> list[str]:
    """Stripped sentences that have something to say (punctuation-only pieces are dropped)."""
    return [s.strip() for s in sentences if any(ch.isalnum() for ch in s)]


# ---------------------------------------------------------------------------------------------
# Auth


class BearerAuthInterceptor(grpc.aio.ServerInterceptor):
    """Requires `authorization: Bearer <token>` metadata on every RPC but health checks."""

    def __init__(self, token: str, exempt: tuple[str, ...] = HEALTH_EXEMPT):
        if not token:
            raise ValueError("auth token must not be empty")
        self._expected = f"Bearer {token}".encode()
        self._exempt = exempt

    def _check(self, metadata) -> str | None:
        values = [v for k, v in (metadata or ()) if k == "authorization"]
        if not values:
            return "missing 'authorization: Bearer <token>' metadata"
        value = values[0].encode() if isinstance(values[0], str) else values[0]
        if len(values) > 1 or not hmac.compare_digest(value, self._expected):
            return "invalid bearer token"
        return None

    async def intercept_service(self, continuation, details):
        if details.method.startswith(self._exempt):
            return await continuation(details)
        problem = self._check(details.invocation_metadata)
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


# ---------------------------------------------------------------------------------------------
# Per-RPC bookkeeping: one log line, metrics


class _Call:
    def __init__(self, method: str, context: grpc.aio.ServicerContext):
        self.method = method
        self.context = context
        self.start = time.perf_counter()
        self.mode = "-"
        self.request_id = "-"
        self.speaker_id = ""
        self.stream: bool | None = None
        self.status = "OK"
        self.detail = ""
        self.first_chunk_at: float | None = None
        self.clock_start = self.start  # first-chunk latency reference (StreamSynthesize: first text)
        self.tokens = 0
        self.audio_seconds = 0.0
        self.chunks = 0

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def wrote(self, chunk: pb2.AudioChunk) -> None:
        self.chunks += 1
        if self.first_chunk_at is None and chunk.num_samples:
            self.first_chunk_at = time.perf_counter()

    @property
    def first_chunk_latency(self) -> float | None:
        return None if self.first_chunk_at is None else self.first_chunk_at - self.clock_start

    def summary(self, audio_seconds: float) -> pb2.SynthesisSummary:
        now = time.perf_counter()
        total = now - self.start
        first = self.first_chunk_latency
        if first is None:  # the summary rides on the first chunk with audio (non-stream)
            first = now - self.clock_start
        return pb2.SynthesisSummary(
            request_id=self.request_id, speech_tokens=self.tokens, audio_seconds=audio_seconds,
            first_chunk_latency_seconds=first, total_seconds=total,
            rtf=total / audio_seconds if audio_seconds > 0 else 0.0)


# ---------------------------------------------------------------------------------------------
# Servicer


def _decode_audio(msg: pb2.AudioData, what: str, max_seconds: float, limit_name: str) -> Audio:
    from async_cosyvoice.frontend.audio import load_audio, pcm_to_audio

    which = msg.WhichOneof("source")
    try:
        if which == "file":
            audio = load_audio(msg.file)
        elif which == "pcm":
            pcm = msg.pcm
            encodings = {pb2.PCM_ENCODING_S16LE: "s16le", pb2.PCM_ENCODING_F32LE: "f32le"}
            if pcm.encoding not in encodings:
                raise InvalidRequest(f"{what}.pcm.encoding must be PCM_ENCODING_S16LE or "
                                     f"PCM_ENCODING_F32LE, got {pcm.encoding}")
            if pcm.sample_rate == 0:
                raise InvalidRequest(f"{what}.pcm.sample_rate is required (Hz)")
            audio = pcm_to_audio(pcm.data, pcm.sample_rate, encodings[pcm.encoding], pcm.channels or 1)
        else:
            raise InvalidRequest(f"{what} is missing: set {what}.file (wav/flac/ogg bytes) or "
                                 f"{what}.pcm (raw samples with encoding and sample_rate)")
    except InvalidRequest as e:
        msg_text = str(e)
        raise InvalidRequest(msg_text if msg_text.startswith(what) else f"{what}: {msg_text}") from None
    if audio.seconds > max_seconds:
        raise InvalidRequest(f"{what} is {audio.seconds:.2f} s long; the limit is {max_seconds:g} s "
                             f"(limits.{limit_name})")
    return audio


@dataclasses.dataclass
class _Output:
    encoding: int
    sample_rate: int
    stream: bool


class CosyVoiceServicer(pb2_grpc.CosyVoiceServicer):
    def __init__(self, config: Config, metrics: Metrics):
        self.config = config
        self.limits = config.limits
        self.metrics = metrics
        self.synth: Synthesizer | None = None
        self.closing = False
        self.active = 0
        self.idle = asyncio.Event()  # set while no synthesis stream runs
        self.idle.set()

    # ---- state ----

    def _synth(self) -> "Synthesizer":
        if self.closing:
            raise NotReady("the server is shutting down; retry on another instance")
        if self.synth is None or not getattr(self.synth, "ready", True):
            raise NotReady("the model is still loading; retry when health reports SERVING")
        return self.synth

    @contextlib.asynccontextmanager
    async def _stream_slot(self):
        if self.active >= self.limits.max_concurrent_streams:
            self.metrics.rejected.inc()
            raise Overloaded(f"{self.limits.max_concurrent_streams} synthesis streams are already "
                             "running (limits.max_concurrent_streams); retry later")
        self.active += 1
        self.idle.clear()
        self.metrics.active_streams.inc()
        try:
            yield
        finally:
            self.active -= 1
            self.metrics.active_streams.dec()
            if not self.active:
                self.idle.set()

    async def _fail(self, call: _Call, error: BaseException) -> None:
        """Turn an exception into a status (and re-raise what grpc must see)."""
        if isinstance(error, asyncio.CancelledError):
            try:
                remaining = call.context.time_remaining()
            except Exception:  # the call may already be torn down
                remaining = None
            call.status = "DEADLINE_EXCEEDED" if remaining is not None and remaining <= 0 else "CANCELLED"
            raise error
        if isinstance(error, grpc.aio.AbortError):
            raise error
        if isinstance(error, CosyVoiceError):
            code, message = status_for(error), str(error)
        else:
            log.exception("rpc method=%s id=%s failed", call.method, call.request_id)
            code = grpc.StatusCode.INTERNAL
            message = f"internal error (request id {call.request_id}); see the server log"
        call.status, call.detail = code.name, message
        await call.context.abort(code, message)

    def _finish(self, call: _Call) -> None:
        elapsed = call.elapsed()
        m = self.metrics
        m.requests.labels(call.method, call.mode, call.status).inc()
        m.request_duration.labels(call.method).observe(elapsed)
        first = call.first_chunk_latency
        stream = "-" if call.stream is None else str(call.stream).lower()
        if call.chunks and call.status == "OK":
            if first is not None:
                m.first_chunk_latency.labels(call.mode, stream).observe(first)
            if call.audio_seconds > 0:
                m.rtf.labels(call.mode, stream).observe(elapsed / call.audio_seconds)
            m.audio_seconds.labels(call.mode).inc(call.audio_seconds)
            m.speech_tokens.labels(call.mode).inc(call.tokens)
        level = logging.INFO if call.status in ("OK", "CANCELLED") else logging.WARNING
        log.log(level,
                "rpc method=%s id=%s mode=%s stream=%s status=%s latency_ms=%.1f first_chunk_ms=%s "
                "audio_s=%.3f tokens=%d chunks=%d peer=%s%s%s",
                call.method, call.request_id, call.mode, stream, call.status, elapsed * 1e3,
                "-" if first is None else f"{first * 1e3:.1f}", call.audio_seconds, call.tokens,
                call.chunks, call.context.peer(), f" speaker={call.speaker_id!r}" if call.speaker_id else "",
                f" detail={call.detail!r}" if call.detail else "")

    # ---- request conversion ----

    def _request_id(self, given: str) -> str:
        if not given:
            return uuid.uuid4().hex
        if not _REQUEST_ID_RE.fullmatch(given):
            raise InvalidRequest("request_id must be 1-64 characters from A-Z a-z 0-9 _ . -")
        return given

    def _options(self, o: pb2.SynthesisOptions) -> tuple[SynthesisOptions, _Output]:
        speed = o.speed if o.HasField("speed") else 1.0
        if not math.isfinite(speed) or not MIN_SPEED <= speed <= MAX_SPEED:
            raise InvalidRequest(f"options.speed must be in [{MIN_SPEED}, {MAX_SPEED}] "
                                 f"(leave it unset for 1.0), got {speed:g}")
        if speed != 1.0 and o.stream:
            raise InvalidRequest("options.speed != 1 needs options.stream = false: speed is applied "
                                 "to the mel of a whole utterance")
        if o.encoding not in pb2.AudioEncoding.values():
            raise InvalidRequest(f"options.encoding {o.encoding} is not a known AudioEncoding "
                                 f"(PCM16 = 1, FLOAT32 = 2, WAV = 3)")
        rate = o.sample_rate or self._native_rate()
        if not MIN_OUTPUT_RATE <= rate <= MAX_OUTPUT_RATE:
            raise InvalidRequest(f"options.sample_rate must be 0 (native {self._native_rate()} Hz) or "
                                 f"{MIN_OUTPUT_RATE}..{MAX_OUTPUT_RATE} Hz, got {rate}")
        options = SynthesisOptions(
            stream=o.stream, speed=speed,
            text_frontend=o.text_frontend if o.HasField("text_frontend") else True,
            seed=o.seed if o.HasField("seed") else None,
            max_tokens=self._max_tokens(o),
            first_hop=self.config.token2wav.first_hop)
        return options, _Output(o.encoding or pb2.AUDIO_ENCODING_PCM16, rate, o.stream)

    def _max_tokens(self, o) -> int | None:
        if not o.HasField("max_tokens"):
            return None
        limit = self.config.limits.max_forced_tokens
        if not 1 <= o.max_tokens <= limit:
            raise InvalidRequest(f"options.max_tokens must be in 1..{limit}, got {o.max_tokens}")
        return o.max_tokens

    def _native_rate(self) -> int:
        return getattr(self.synth, "sample_rate", None) or NATIVE_SAMPLE_RATE

    def _check_text(self, text: str, what: str = "text") -> str:
        if not text.strip():
            raise InvalidRequest(f"{what} is empty")
        if len(text) > self.limits.max_text_chars:
            raise InvalidRequest(f"{what} is {len(text)} characters long; the limit is "
                                 f"{self.limits.max_text_chars} (limits.max_text_chars)")
        return text

    def _prompt(self, msg: pb2.AudioData, what: str) -> Audio:
        return _decode_audio(msg, what, self.limits.max_prompt_seconds, "max_prompt_seconds")

    def _voice(self, mode: str, voice) -> dict:
        """SynthesisRequest fields for a mode message (decodes audio: call in a worker thread)."""
        if mode == "zero_shot":
            return dict(prompt_text=self._check_text(voice.prompt_text, "zero_shot.prompt_text"),
                        prompt_audio=self._prompt(voice.prompt_audio, "zero_shot.prompt_audio"))
        if mode == "cross_lingual":
            return dict(prompt_audio=self._prompt(voice.prompt_audio, "cross_lingual.prompt_audio"))
        if mode == "instruct2":
            return dict(instruct_text=self._check_text(voice.instruct_text, "instruct2.instruct_text"),
                        prompt_audio=self._prompt(voice.prompt_audio, "instruct2.prompt_audio"))
        if mode in ("sft", "zero_shot_by_spk_id"):
            return dict(speaker_id=validate_speaker_id(voice.speaker_id, f"{mode}.speaker_id"))
        if mode == "instruct2_by_spk_id":
            return dict(speaker_id=validate_speaker_id(voice.speaker_id, f"{mode}.speaker_id"),
                        instruct_text=self._check_text(voice.instruct_text, f"{mode}.instruct_text"))
        if mode == "vc":
            return dict(
                source_audio=_decode_audio(voice.source_audio, "vc.source_audio",
                                           self.limits.max_source_seconds, "max_source_seconds"),
                prompt_audio=self._prompt(voice.prompt_audio, "vc.prompt_audio"))
        raise InvalidRequest("no mode set: set one of zero_shot, cross_lingual, instruct2, sft, "
                             "zero_shot_by_spk_id, instruct2_by_spk_id, vc")

    def _synthesis_request(self, request: pb2.SynthesizeRequest, request_id: str
                           ) -> tuple[SynthesisRequest, _Output]:
        mode = request.WhichOneof("mode")
        options, output = self._options(request.options)
        fields = self._voice(mode, getattr(request, mode) if mode else None)
        if mode == "vc":
            if request.text:
                raise InvalidRequest("vc converts source_audio and takes no text; leave text empty")
        else:
            self._check_text(request.text)
        return SynthesisRequest(mode=Mode(mode), text=request.text, options=options,
                                request_id=request_id, **fields), output

    # ---- synthesis ----

    async def _emit(self, call: _Call, out: AudioEncoder, samples: np.ndarray, final: bool) -> None:
        for msg in out.push(samples, final):
            if msg.is_final:
                msg.summary.CopyFrom(call.summary(out.seconds))
                call.audio_seconds = out.seconds
            await call.context.write(msg)
            call.wrote(msg)

    async def _speak(self, synth: "Synthesizer", request: SynthesisRequest, call: _Call,
                     out: AudioEncoder, last: bool) -> None:
        """Write the chunks of one synthesis; the final one is final only when `last`."""
        chunks = synth.synthesize(request)
        try:
            async for chunk in chunks:
                if chunk.is_final:
                    call.tokens += int(chunk.n_tokens)
                await self._emit(call, out, chunk.samples, chunk.is_final and last)
                if chunk.is_final:
                    break
        finally:
            aclose = getattr(chunks, "aclose", None)
            if aclose is not None:
                await aclose()  # aborts the engine request when we stop early

    async def Synthesize(self, request: pb2.SynthesizeRequest, context) -> None:
        call = _Call("Synthesize", context)
        call.mode = request.WhichOneof("mode") or "-"
        call.stream = request.options.stream
        try:
            call.request_id = self._request_id(request.request_id)
            await context.send_initial_metadata((("x-request-id", call.request_id),))
            synth = self._synth()
            async with self._stream_slot():
                req, output = await asyncio.to_thread(self._synthesis_request, request, call.request_id)
                out = AudioEncoder(output.encoding, synth.sample_rate, output.sample_rate, output.stream,
                                   min(MAX_CHUNK_BYTES, self.limits.max_message_bytes - 4096))
                await self._speak(synth, req, call, out, last=True)
                if not out.finished:  # the synthesizer ended without a final chunk
                    await self._emit(call, out, np.zeros(0, np.float32), True)
        except BaseException as e:  # noqa: B036 - re-raised by _fail
            await self._fail(call, e)
        finally:
            self._finish(call)

    async def StreamSynthesize(self, request_iterator, context) -> None:
        call = _Call("StreamSynthesize", context)
        reader: asyncio.Task | None = None
        try:
            first = await anext(aiter(request_iterator), None)
            if first is None or first.WhichOneof("message") != "config":
                raise InvalidRequest("the first StreamSynthesize message must be a config "
                                     "(voice and options); text pieces follow it")
            config = first.config
            call.mode = config.WhichOneof("mode") or "-"
            call.stream = config.options.stream
            call.request_id = self._request_id(config.request_id)
            await context.send_initial_metadata((("x-request-id", call.request_id),))
            synth = self._synth()
            async with self._stream_slot():
                base, output = await asyncio.to_thread(self._stream_template, config, call.request_id)
                if base.speaker_id and not await asyncio.to_thread(synth.speakers.exists, base.speaker_id):
                    raise SpeakerNotFound(f"speaker {base.speaker_id!r} not found")
                out = AudioEncoder(output.encoding, synth.sample_rate, output.sample_rate, output.stream,
                                   min(MAX_CHUNK_BYTES, self.limits.max_message_bytes - 4096))
                sentences: asyncio.Queue = asyncio.Queue()
                reader = asyncio.create_task(self._read_pieces(request_iterator, sentences, call))
                n = 0
                while (item := await sentences.get()) is not None:
                    if isinstance(item, BaseException):
                        raise item
                    request = dataclasses.replace(base, text=item, request_id=f"{call.request_id}.{n}")
                    await self._speak(synth, request, call, out, last=False)
                    n += 1
                if n == 0:
                    raise InvalidRequest("no text was received (or only punctuation)")
                await self._emit(call, out, np.zeros(0, np.float32), True)
        except BaseException as e:  # noqa: B036 - re-raised by _fail
            await self._fail(call, e)
        finally:
            if reader is not None:
                reader.cancel()
                with contextlib.suppress(BaseException):
                    await reader
            self._finish(call)

    def _stream_template(self, config: pb2.StreamConfig, request_id: str) -> tuple[SynthesisRequest, _Output]:
        mode = config.WhichOneof("mode")
        options, output = self._options(config.options)
        fields = self._voice(mode, getattr(config, mode) if mode else None)
        return SynthesisRequest(mode=Mode(mode), text="", options=options, request_id=request_id,
                                **fields), output

    async def _read_pieces(self, request_iterator, sentences: asyncio.Queue, call: _Call) -> None:
        """Reader task: text pieces -> complete sentences on the queue; None at the end."""
        splitter = SentenceSplitter(min(200, self.limits.max_text_chars))
        total = 0
        try:
            async for msg in request_iterator:
                kind = msg.WhichOneof("message")
                if kind == "text":
                    if total == 0:
                        call.clock_start = time.perf_counter()
                    total += len(msg.text)
                    for s in splitter.feed(msg.text):
                        sentences.put_nowait(s)
                elif kind == "end":
                    break
                elif kind == "config":
                    raise InvalidRequest("config may be sent only once, as the first message")
                else:
                    raise InvalidRequest("empty StreamSynthesizeRequest: set text or end")
            for s in splitter.flush():
                sentences.put_nowait(s)
            sentences.put_nowait(None)
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # noqa: B036 - handed to the writer
            sentences.put_nowait(e)

    # ---- speakers ----

    def _speaker(self, item: SpeakerInfo | SpeakerRecord) -> pb2.Speaker:
        info = item.info if isinstance(item, SpeakerRecord) else item
        created = Timestamp()
        created.FromNanoseconds(int(info.created_at * 1e9))
        kind = pb2.SPEAKER_KIND_ZERO_SHOT if info.kind == "zero_shot" else pb2.SPEAKER_KIND_SFT
        return pb2.Speaker(speaker_id=info.speaker_id, kind=kind, prompt_text=info.prompt_text,
                           prompt_speech_tokens=info.n_speech_tokens,
                           prompt_seconds=info.n_speech_tokens / TOKENS_PER_SECOND, created_at=created)

    async def _unary(self, method: str, context, body: Callable[[_Call], Awaitable], speaker_id: str = ""):
        call = _Call(method, context)
        call.request_id = uuid.uuid4().hex
        call.speaker_id = speaker_id[:80]
        try:
            return await body(call)
        except BaseException as e:  # noqa: B036 - re-raised by _fail
            await self._fail(call, e)
        finally:
            self._finish(call)

    async def RegisterSpeaker(self, request: pb2.RegisterSpeakerRequest, context) -> pb2.Speaker:
        async def body(call: _Call):
            synth = self._synth()
            speaker_id = validate_speaker_id(request.speaker_id)
            prompt_text = self._check_text(request.prompt_text, "prompt_text")
            audio = await asyncio.to_thread(self._prompt, request.prompt_audio, "prompt_audio")
            record = await synth.register_speaker(speaker_id, prompt_text, audio, overwrite=request.overwrite)
            return self._speaker(record)
        return await self._unary("RegisterSpeaker", context, body, request.speaker_id)

    async def GetSpeaker(self, request: pb2.GetSpeakerRequest, context) -> pb2.Speaker:
        async def body(call: _Call):
            store = self._synth().speakers
            speaker_id = validate_speaker_id(request.speaker_id)
            return self._speaker(await asyncio.to_thread(store.get, speaker_id))
        return await self._unary("GetSpeaker", context, body, request.speaker_id)

    async def ListSpeakers(self, request: pb2.ListSpeakersRequest, context) -> pb2.ListSpeakersResponse:
        async def body(call: _Call):
            store = self._synth().speakers
            page = await asyncio.to_thread(store.list, request.page_size, request.page_token)
            return pb2.ListSpeakersResponse(speakers=[self._speaker(i) for i in page.speakers],
                                            next_page_token=page.next_page_token)
        return await self._unary("ListSpeakers", context, body)

    async def DeleteSpeaker(self, request: pb2.DeleteSpeakerRequest, context) -> pb2.DeleteSpeakerResponse:
        async def body(call: _Call):
            store = self._synth().speakers
            speaker_id = validate_speaker_id(request.speaker_id)
            await asyncio.to_thread(store.delete, speaker_id)
            return pb2.DeleteSpeakerResponse()
        return await self._unary("DeleteSpeaker", context, body, request.speaker_id)


# ---------------------------------------------------------------------------------------------
# Server lifecycle


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


class CosyVoiceServer:
    """Binds the port at once (health NOT_SERVING), loads the model in the background, then flips
    health to SERVING. `synthesizer` may be given (already created) instead of loading one."""

    def __init__(self, config: Config, synthesizer: "Synthesizer | None" = None,
                 synthesizer_factory: Callable[[Config], Awaitable["Synthesizer"]] | None = None):
        self.config = config
        self.metrics = Metrics()
        self.servicer = CosyVoiceServicer(config, self.metrics)
        self.health = grpc_health.aio.HealthServicer()
        self._given = synthesizer
        self._factory = synthesizer_factory
        self._loader: asyncio.Task | None = None
        self._server: grpc.aio.Server | None = None
        self.port: int | None = None
        self.metrics_port: int | None = None
        self._stopped = asyncio.Event()

    @property
    def synthesizer(self) -> "Synthesizer | None":
        return self.servicer.synth

    async def _set_health(self, status) -> None:
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status)

    async def start(self) -> int:
        cfg = self.config
        limits = cfg.limits
        interceptors = [BearerAuthInterceptor(cfg.server.auth_token)] if cfg.server.auth_token else []
        self._server = grpc.aio.server(interceptors=interceptors, options=[
            ("grpc.max_receive_message_length", limits.max_message_bytes),
            ("grpc.max_send_message_length", limits.max_message_bytes),
            ("grpc.so_reuseport", 0),
        ])
        pb2_grpc.add_CosyVoiceServicer_to_server(self.servicer, self._server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
             reflection.SERVICE_NAME), self._server)
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        address = f"{cfg.server.host}:{cfg.server.port}"
        creds = server_credentials(cfg)
        self.port = (self._server.add_secure_port(address, creds) if creds
                     else self._server.add_insecure_port(address))
        if not self.port:
            raise RuntimeError(f"cannot bind {address}")
        await self._server.start()
        log.info("listening on %s:%d (%s%s)", cfg.server.host, self.port, "TLS" if creds else "plaintext",
                 ", bearer auth" if interceptors else "")
        if cfg.server.metrics_port is not None:
            self.metrics_port = self.metrics.serve_http(cfg.server.metrics_port, cfg.server.host)
        self._loader = asyncio.create_task(self._load())
        return self.port

    async def _load(self) -> None:
        t0 = time.perf_counter()
        synth = self._given
        if synth is None:
            if self._factory is not None:
                synth = await self._factory(self.config)
            else:
                from async_cosyvoice.tts import Synthesizer
                synth = await Synthesizer.create(self.config)
        self.servicer.synth = synth
        self.metrics.bind_engine(synth.engine_stats)
        if self.servicer.closing:
            return
        self.metrics.ready.set(1)
        await self._set_health(health_pb2.HealthCheckResponse.SERVING)
        log.info("model ready in %.1f s; health SERVING", time.perf_counter() - t0)

    async def wait_ready(self, timeout: float | None = None) -> None:
        """Wait until the model is loaded (re-raises a loading failure)."""
        assert self._loader is not None, "start() first"
        await asyncio.wait_for(asyncio.shield(self._loader), timeout)

    async def stop(self, grace: float | None = None) -> None:
        """Graceful shutdown: NOT_SERVING, refuse new streams, drain in-flight ones for `grace`
        seconds (config server.grace_seconds), then cancel what is left and close the model."""
        if self._server is None or self.servicer.closing:
            await self._stopped.wait()
            return
        grace = self.config.server.grace_seconds if grace is None else grace
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        # 1. Health NOT_SERVING and UNAVAILABLE ("shutting down", retryable) for new synthesis
        #    while the in-flight streams finish; 2. then grpc's own stop with what is left of the
        #    grace (other RPCs finish, the rest is cancelled, which aborts their engine requests).
        self.servicer.closing = True
        self.metrics.ready.set(0)
        await self.health.enter_graceful_shutdown()
        log.info("shutting down: draining %d stream(s) for up to %.1f s", self.servicer.active, grace)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.servicer.idle.wait(), timeout=grace)
        await self._server.stop(max(0.0, deadline - loop.time()))
        if self._loader is not None and not self._loader.done():
            self._loader.cancel()
        if self._loader is not None:
            with contextlib.suppress(BaseException):
                await self._loader
        if self.servicer.synth is not None:
            await self.servicer.synth.close()
        self.metrics.close()
        self._stopped.set()
        log.info("stopped")

    async def wait_for_termination(self) -> None:
        await self._stopped.wait()


class ServerThread:
    """A CosyVoiceServer on its own event loop in a daemon thread, for synchronous programs
    (notebooks, tests): `with ServerThread(config) as st: ... st.port ...`."""

    def __init__(self, config: Config, ready_timeout: float | None = 600.0, **server_kwargs):
        import threading

        self.config = config
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="cosyvoice-server", daemon=True)
        self._thread.start()
        try:
            self.server: CosyVoiceServer = self.call(self._make(server_kwargs))
            self.port: int = self.call(self.server.start())
            if ready_timeout is not None:
                self.call(self.server.wait_ready(), timeout=ready_timeout)
        except BaseException:
            self.close(grace=0)
            raise

    async def _make(self, kwargs) -> CosyVoiceServer:
        return CosyVoiceServer(self.config, **kwargs)

    @property
    def target(self) -> str:
        return f"{self.config.server.host}:{self.port}"

    def call(self, coro, timeout: float | None = None):
        """Run a coroutine on the server's loop and return its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self, grace: float | None = 0) -> None:
        if self.loop.is_closed():
            return
        server = getattr(self, "server", None)
        if server is not None and server._server is not None:
            with contextlib.suppress(Exception):
                self.call(server.stop(grace), timeout=120)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=30)
        if not self._thread.is_alive():
            self.loop.close()

    def __enter__(self) -> "ServerThread":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


async def serve(config: Config, *, install_signal_handlers: bool = True) -> None:
    """Run the service until SIGINT/SIGTERM, then shut down gracefully."""
    server = CosyVoiceServer(config)
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    if install_signal_handlers:
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, stop.set)
    waiter = asyncio.create_task(stop.wait())
    try:
        done, _ = await asyncio.wait({waiter, server._loader}, return_when=asyncio.FIRST_COMPLETED)
        if server._loader in done and server._loader.exception() is not None:
            raise server._loader.exception()
        await waiter
    finally:
        waiter.cancel()
        await server.stop()


def run(config: Config) -> None:
    """Blocking entry point for `async-cosyvoice serve`."""
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(serve(config))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m grpc_async.server", description=__doc__.splitlines()[0])
    parser.add_argument("--config", help="YAML config (default: built-in defaults + env overrides)")
    parser.add_argument("--model-dir", help="CosyVoice2 model directory (overrides model.dir)")
    parser.add_argument("--host")
    parser.add_argument("--port", type=int)
    args = parser.parse_args(argv)
    config = Config.load(args.config)
    if args.model_dir:
        config.model.dir = Path(args.model_dir)
    if args.host:
        config.server.host = args.host
    if args.port is not None:
        config.server.port = args.port
    run(config)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
