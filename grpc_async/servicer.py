"""The CosyVoice RPCs: protobuf requests -> `SynthesisRequest`s -> `AudioChunk` messages.

The servicer iterates `Synthesizer.synthesize(...)` and writes `AudioChunk` messages. When a client
goes away or its deadline passes, grpc cancels the handler task; the CancelledError unwinds through
the `finally` that closes the synthesizer's iterator, which aborts the engine request. Errors map
to status codes (`status_for`); every RPC ends in one structured log line and its metrics.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
import uuid
from typing import Awaitable, Callable

import grpc
import numpy as np
from google.protobuf.timestamp_pb2 import Timestamp

from async_cosyvoice.config import Config
from async_cosyvoice.errors import ClientTimeout, CosyVoiceError, EngineDead, InvalidRequest, NotReady, status_of
from async_cosyvoice.frontend.audio import load_audio, pcm_to_audio
from async_cosyvoice.heap import HeapTrimmer
from async_cosyvoice.limiter import StreamLimiter
from async_cosyvoice.request import Audio, Mode, SynthesisOptions, SynthesisRequest, Timeline
from async_cosyvoice.speakers import SpeakerInfo, SpeakerRecord, validate_speaker_id
from async_cosyvoice.startup import Startup
from async_cosyvoice.tts import Synthesizer

from ._stubs import load as _load_stubs
from .encoding import ENCODING_FORMATS, MAX_CHUNK_BYTES, AudioEncoder, _Output, check_output
from .metrics import Metrics
from .server_info import TEXT_MODES, TEXT_NORMALIZATIONS, server_info
from .status_details import error_trailer

pb2, pb2_grpc = _load_stubs()
log = logging.getLogger("grpc_async.server")  # one logger for the whole service

NATIVE_SAMPLE_RATE = 24000
MIN_OUTPUT_RATE, MAX_OUTPUT_RATE = 8000, 192000
TOKENS_PER_SECOND = 25         # speech tokens per second of audio (CosyVoice2)
_REQUEST_ID_RE = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
# A client whose deadline passes cancels the call (RST_STREAM) at its own deadline; the server's
# copy of the deadline (arrival + grpc-timeout) is later by the request's one-way delay, so the
# cancel can arrive a few ms before it (measured: 4 of 40 deadlines on a loaded 2-core box, 2-7 ms
# early). A cancel this close to the deadline is logged and counted as DEADLINE_EXCEEDED.
DEADLINE_SLACK_SECONDS = 0.1

def status_for(error: BaseException) -> grpc.StatusCode:
    """The error's status (the library's one table, `async_cosyvoice.errors.status_of`)."""
    return grpc.StatusCode[status_of(error).grpc]


class _Call:
    """Per-RPC bookkeeping: what goes into the RPC's log line and metrics."""

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
        self.first_text_seen = False
        self.tokens = 0
        self.audio_seconds = 0.0
        self.chunks = 0
        self.first_timeline: Timeline | None = None  # the first text segment's (its log line's first_chunk_parts)

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


def _enum_option(value: int, names: dict[str, int], field: str, enum: str) -> str | None:
    """A StreamConfig enum as the library's name; None when unset (the library's default)."""
    if not value:
        return None
    for name, number in names.items():
        if number == value:
            return name
    raise InvalidRequest(f"{field} {value} is not a known {enum}")


def _decode_audio(msg: pb2.AudioData, what: str) -> Audio:
    """AudioData -> Audio (a worker-thread call: decoding is CPU work). Limits are the library's."""
    which = msg.WhichOneof("source")
    try:
        if which == "file":
            return load_audio(msg.file)
        if which == "pcm":
            pcm = msg.pcm
            encodings = {pb2.PCM_ENCODING_S16LE: "s16le", pb2.PCM_ENCODING_F32LE: "f32le"}
            if pcm.encoding not in encodings:
                raise InvalidRequest(f"{what}.pcm.encoding must be PCM_ENCODING_S16LE or "
                                     f"PCM_ENCODING_F32LE, got {pcm.encoding}")
            if pcm.sample_rate == 0:
                raise InvalidRequest(f"{what}.pcm.sample_rate is required (Hz)")
            return pcm_to_audio(pcm.data, pcm.sample_rate, encodings[pcm.encoding], pcm.channels or 1)
        raise InvalidRequest(f"{what} is missing: set {what}.file (wav/flac/ogg bytes) or "
                             f"{what}.pcm (raw samples with encoding and sample_rate)")
    except InvalidRequest as e:
        text = str(e)
        raise InvalidRequest(text if text.startswith(what) else f"{what}: {text}") from None


class CosyVoiceServicer(pb2_grpc.CosyVoiceServicer):
    def __init__(self, config: Config, metrics: Metrics):
        self.config = config
        self.limits = config.limits
        self.metrics = metrics
        self.synth: Synthesizer | None = None
        self.closing = False
        # shared with the HTTP front door: one limit for all synthesis streams of the process
        self.heap = HeapTrimmer(config.server.heap_trim_seconds)
        self.limiter = StreamLimiter(config.limits.max_concurrent_streams, on_reject=metrics.rejected.inc,
                                     on_release=self.heap.stream_ended)
        metrics.active_streams.set_function(lambda: self.limiter.active)
        self.startup = Startup()  # what the start is doing until SERVING, and its phase report after
        self.engine_failure: str | None = None  # set by the server when the LM engine died
        self._streams: set[asyncio.Task] = set()  # gRPC handler tasks holding a stream slot
        self._ending: str | None = None  # set by end_streams: the status message of cancelled streams

    # ---- state ----

    def _synth(self) -> "Synthesizer":
        if self.engine_failure is not None:
            raise self.engine_dead()
        if self.closing:
            raise NotReady("the server is shutting down; retry on another instance")
        if self.synth is None or not getattr(self.synth, "ready", True):
            raise NotReady(f"the server is warming up ({self.startup.status()}); retry when health reports SERVING")
        return self.synth

    @property
    def active(self) -> int:
        """Synthesis streams in progress, gRPC and HTTP together."""
        return self.limiter.active

    @property
    def idle(self) -> asyncio.Event:
        """Set while no synthesis stream runs (either front door)."""
        return self.limiter.idle

    @contextlib.asynccontextmanager
    async def _stream_slot(self):
        async with self.limiter.slot():
            task = asyncio.current_task()
            self._streams.add(task)
            try:
                yield
            finally:
                self._streams.discard(task)

    def engine_dead(self) -> EngineDead:
        return EngineDead(f"{self.engine_failure}; this server is exiting, retry on another instance")

    def end_streams(self, message: str) -> list[asyncio.Task]:
        """Cancel every synthesis stream still running (the drain grace ran out, the engine died);
        each ends with UNAVAILABLE and `message` (see `_fail`). Returns their handler tasks."""
        self._ending = message
        tasks = list(self._streams)
        for task in tasks:
            task.cancel()
        return tasks

    async def _fail(self, call: _Call, error: BaseException) -> None:
        """Turn an exception into a status (and re-raise what grpc must see)."""
        if isinstance(error, asyncio.CancelledError) and self._ending:
            call.status, call.detail = grpc.StatusCode.UNAVAILABLE.name, self._ending
            await call.context.abort(grpc.StatusCode.UNAVAILABLE, self._ending)
        if isinstance(error, asyncio.CancelledError):
            try:
                remaining = call.context.time_remaining()
            except Exception:  # the call may already be torn down
                remaining = None
            deadline_passed = remaining is not None and remaining <= DEADLINE_SLACK_SECONDS
            call.status = "DEADLINE_EXCEEDED" if deadline_passed else "CANCELLED"
            raise error
        if isinstance(error, grpc.aio.AbortError):
            raise error
        if isinstance(error, CosyVoiceError):
            code, message = status_for(error), str(error)
        elif self.engine_failure is not None:  # whatever a dying engine threw at its requests
            code, message = grpc.StatusCode.UNAVAILABLE, str(self.engine_dead())
        else:
            log.exception("rpc method=%s id=%s failed", call.method, call.request_id)
            code = grpc.StatusCode.INTERNAL
            message = f"internal error (request id {call.request_id}); see the server log"
        call.status, call.detail = code.name, message
        await call.context.abort(code, message, self._error_trailer(call, code, message, error))

    @staticmethod
    def _error_trailer(call: _Call, code: grpc.StatusCode, message: str, error: BaseException) -> tuple:
        """google.rpc details (BadRequest field / RetryInfo) for the status trailer."""
        method = pb2.DESCRIPTOR.services_by_name["CosyVoice"].methods_by_name.get(call.method)
        return error_trailer(code, message, method.input_type if method else None,
                             field=getattr(error, "field", None))

    def _finish(self, call: _Call) -> None:
        elapsed = call.elapsed()
        first = call.first_chunk_latency
        stream = "-" if call.stream is None else str(call.stream).lower()
        parts = call.first_timeline.first_chunk_parts() if call.first_timeline else None
        self.metrics.record_request(call.method, call.mode, call.status, call.status == "OK", stream, elapsed,
                                    first, call.audio_seconds, call.tokens, call.chunks, parts)
        level = logging.INFO if call.status in ("OK", "CANCELLED") else logging.WARNING
        log.log(level,
                "rpc method=%s id=%s mode=%s stream=%s status=%s latency_ms=%.1f first_chunk_ms=%s "
                "first_chunk_parts=%s audio_s=%.3f tokens=%d chunks=%d peer=%s%s%s",
                call.method, call.request_id, call.mode, stream, call.status, elapsed * 1e3,
                "-" if first is None else f"{first * 1e3:.1f}",
                parts or "-", call.audio_seconds,
                call.tokens, call.chunks, call.context.peer(),
                f" speaker={call.speaker_id!r}" if call.speaker_id else "", f" detail={call.detail!r}" if call.detail else "")

    # ---- request conversion ----

    def _request_id(self, given: str) -> str:
        if not given:
            return uuid.uuid4().hex
        if not _REQUEST_ID_RE.fullmatch(given):
            raise InvalidRequest("request_id must be 1-64 characters from A-Z a-z 0-9 _ . -")
        return given

    def _options(self, o: pb2.SynthesisOptions) -> tuple[SynthesisOptions, _Output]:
        """Proto options -> library options (their values are checked by the library's rules)."""
        rate = o.sample_rate or self._native_rate()
        self._check_output(o.encoding, rate)
        options = SynthesisOptions(
            stream=o.stream, speed=o.speed if o.HasField("speed") else 1.0,
            text_frontend=o.text_frontend if o.HasField("text_frontend") else True,
            seed=o.seed if o.HasField("seed") else None,
            max_tokens=o.max_tokens if o.HasField("max_tokens") else None)
        return options, _Output(o.encoding or pb2.AUDIO_ENCODING_PCM16, rate, o.stream)

    def _check_output(self, encoding: int, rate: int) -> None:
        if encoding not in ENCODING_FORMATS:
            known = ", ".join(f"{pb2.AudioEncoding.Name(v).removeprefix('AUDIO_ENCODING_')} = {v}"
                              for v in pb2.AudioEncoding.values() if v)
            raise InvalidRequest(f"options.encoding {encoding} is not a known AudioEncoding ({known})")
        if not MIN_OUTPUT_RATE <= rate <= MAX_OUTPUT_RATE:
            raise InvalidRequest(f"options.sample_rate must be 0 (native {self._native_rate()} Hz) or "
                                 f"{MIN_OUTPUT_RATE}..{MAX_OUTPUT_RATE} Hz, got {rate}")
        try:
            check_output(encoding, rate)
        except InvalidRequest as e:
            raise InvalidRequest(f"options.sample_rate: {e}") from None

    def _native_rate(self) -> int:
        return getattr(self.synth, "sample_rate", None) or NATIVE_SAMPLE_RATE

    def _voice(self, mode: str | None, voice) -> dict:
        """SynthesisRequest fields of a mode message (decodes audio: call in a worker thread)."""
        if mode in ("zero_shot", "cross_lingual", "instruct2", "vc"):
            fields = dict(prompt_audio=_decode_audio(voice.prompt_audio, f"{mode}.prompt_audio"))
            if mode == "vc":
                fields["source_audio"] = _decode_audio(voice.source_audio, "vc.source_audio")
        elif mode in ("sft", "zero_shot_by_spk_id", "instruct2_by_spk_id"):  # named by its own field
            fields = dict(speaker_id=validate_speaker_id(voice.speaker_id, f"{mode}.speaker_id"))
        else:
            raise InvalidRequest("no mode set: set one of zero_shot, cross_lingual, instruct2, sft, "
                                 "zero_shot_by_spk_id, instruct2_by_spk_id, vc")
        if mode == "zero_shot":
            fields["prompt_text"] = voice.prompt_text
        if mode in ("instruct2", "instruct2_by_spk_id"):
            fields["instruct_text"] = voice.instruct_text
        return fields

    def _synthesis_request(self, msg, text: str, request_id: str) -> tuple[SynthesisRequest, _Output]:
        """A SynthesizeRequest or StreamConfig -> (request, output format)."""
        mode = msg.WhichOneof("mode")
        options, output = self._options(msg.options)
        fields = self._voice(mode, getattr(msg, mode) if mode else None)
        return SynthesisRequest(mode=Mode(mode), text=text, options=options, request_id=request_id,
                                **fields), output

    # ---- synthesis ----

    def _encoder(self, synth: "Synthesizer", output: _Output) -> AudioEncoder:
        return AudioEncoder(output.encoding, synth.sample_rate, output.sample_rate, output.stream,
                            min(MAX_CHUNK_BYTES, self.limits.max_message_bytes - 4096))

    async def _emit(self, call: _Call, out: AudioEncoder, samples: np.ndarray, final: bool) -> None:
        for msg in await asyncio.to_thread(out.push, samples, final):  # resampling + packing is CPU work
            if msg.is_final:
                msg.summary.CopyFrom(call.summary(out.seconds))
                call.audio_seconds = out.seconds
            await call.context.write(msg)
            call.wrote(msg)

    async def _speak(self, chunks, call: _Call, out: AudioEncoder) -> None:
        """Write a synthesis's chunks. Leaving early closes `chunks`, which aborts the engine request."""
        async with contextlib.aclosing(chunks):
            async for chunk in chunks:
                if chunk.is_final:
                    call.tokens += int(chunk.n_tokens)
                call.first_timeline = call.first_timeline or chunk.first_segment_timeline
                await self._emit(call, out, chunk.samples, chunk.is_final)
                if chunk.is_final:
                    break
        if not out.finished:  # the synthesizer ended without a final chunk
            await self._emit(call, out, np.zeros(0, np.float32), True)

    async def Synthesize(self, request: pb2.SynthesizeRequest, context) -> None:
        call = _Call("Synthesize", context)
        call.mode = request.WhichOneof("mode") or "-"
        call.stream = request.options.stream
        try:
            call.request_id = self._request_id(request.request_id)
            await context.send_initial_metadata((("x-request-id", call.request_id),))
            synth = self._synth()
            async with self._stream_slot():
                req, output = await asyncio.to_thread(self._synthesis_request, request, request.text, call.request_id)
                await self._speak(synth.synthesize(req), call, self._encoder(synth, output))
        except BaseException as e:  # noqa: B036 - re-raised by _fail
            await self._fail(call, e)
        finally:
            self._finish(call)

    async def StreamSynthesize(self, request_iterator, context) -> None:
        """A StreamConfig, then text pieces, then `end` (a half-close without `end` also ends the
        text). A message after `end` is refused with INVALID_ARGUMENT."""
        call = _Call("StreamSynthesize", context)
        misuse: list[CosyVoiceError] = []
        watcher: asyncio.Task | None = None
        handler = asyncio.current_task()

        async def refuse_after_end() -> None:
            async for _ in request_iterator:
                misuse.append(InvalidRequest("a StreamSynthesize message arrived after `end`; "
                                             "send all text before `end`"))
                handler.cancel()
                return

        async def text_pieces():
            nonlocal watcher
            async for msg in request_iterator:
                kind = msg.WhichOneof("message")
                if kind == "text":
                    if not call.first_text_seen:
                        call.first_text_seen = True
                        call.clock_start = time.perf_counter()
                    yield msg.text
                elif kind == "end":
                    watcher = asyncio.create_task(refuse_after_end())
                    return
                elif kind == "config":
                    raise InvalidRequest("config may be sent only once, as the first message")
                else:
                    raise InvalidRequest("empty StreamSynthesizeRequest: set text or end")

        try:
            first = await self._first_message(request_iterator)
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
                template, output = await asyncio.to_thread(self._synthesis_request, config, "", call.request_id)
                try:
                    text_mode = _enum_option(config.text_mode, TEXT_MODES, "config.text_mode", "TextMode")
                    normalization = _enum_option(config.text_normalization, TEXT_NORMALIZATIONS,
                                                 "config.text_normalization", "TextNormalization")
                    chunks = synth.synthesize_stream(text_pieces(), template, text_mode=text_mode,
                                                     text_normalization=normalization)
                    await self._speak(chunks, call, self._encoder(synth, output))
                except asyncio.CancelledError:
                    if misuse:
                        raise misuse[0] from None
                    raise
                if watcher is not None:
                    watcher.cancel()
        except BaseException as e:  # noqa: B036 - re-raised by _fail
            await self._fail(call, e)
        finally:
            if watcher is not None:
                watcher.cancel()
                with contextlib.suppress(BaseException):
                    await watcher
            self._finish(call)

    async def _first_message(self, request_iterator):
        """The StreamConfig (or whatever came first; None: the client half-closed), within
        limits.first_message_seconds: a stream that never sends it must not hold its call."""
        seconds = self.limits.first_message_seconds
        try:
            return await asyncio.wait_for(anext(aiter(request_iterator), None), seconds)
        except TimeoutError:
            raise ClientTimeout(f"no StreamConfig arrived within {seconds:g} s of the call's start "
                                "(limits.first_message_seconds); send the config first") from None

    # ---- speakers ----

    def _speaker(self, item: SpeakerInfo | SpeakerRecord) -> pb2.Speaker:
        info = item.info if isinstance(item, SpeakerRecord) else item
        created = Timestamp()
        created.FromNanoseconds(int(info.created_at * 1e9))
        kind = pb2.SPEAKER_KIND_ZERO_SHOT if info.kind == "zero_shot" else pb2.SPEAKER_KIND_SFT
        return pb2.Speaker(speaker_id=info.speaker_id, kind=kind, prompt_text=info.prompt_text,
                           prompt_speech_tokens=info.n_speech_tokens,
                           prompt_seconds=info.n_speech_tokens / TOKENS_PER_SECOND, created_at=created,
                           model_kind=info.model_kind)

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
            audio = await asyncio.to_thread(_decode_audio, request.prompt_audio, "prompt_audio")
            record = await synth.register_speaker(request.speaker_id, request.prompt_text, audio,
                                                  overwrite=request.overwrite)
            return self._speaker(record)
        return await self._unary("RegisterSpeaker", context, body, request.speaker_id)

    async def GetSpeaker(self, request: pb2.GetSpeakerRequest, context) -> pb2.Speaker:
        async def body(call: _Call):
            store = self._synth().speakers
            return self._speaker(await asyncio.to_thread(store.get, request.speaker_id))
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
            await self._synth().delete_speaker(request.speaker_id)
            return pb2.DeleteSpeakerResponse()
        return await self._unary("DeleteSpeaker", context, body, request.speaker_id)

    async def GetServerInfo(self, request: pb2.GetServerInfoRequest, context) -> pb2.GetServerInfoResponse:
        async def body(call: _Call):
            return server_info(self.config, None if self.closing else self.synth, self.startup)
        return await self._unary("GetServerInfo", context, body)
