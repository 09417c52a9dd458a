"""Synthesizer: text (+ voice) in, streamed audio chunks out; every mode is data.

    request = rules.check(request)            options resolved from the config
    voice = await prepare_voice(request)      prompt audio encoded once, or a stored speaker
    for each text segment: Utterance(...)     its engine request, tokens, token2wav stream, timeline
        async for chunk in utterance.run(batcher): yield chunk

`synthesize_stream` does the same for text that arrives in pieces, with the voice prepared once per
stream: one LM request fed the text as it comes (bistream, where the engine can) or one per
sentence. `SyncSynthesizer` runs a Synthesizer for scripts without a loop.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import AsyncIterable, AsyncIterator, Callable, Iterator

import numpy as np
import torch

from .compile_cache import PersistentCompileCache, open_compile_cache, use_compile_cache
from .config import Config
from .cost import device_memory
from .demo import resolve_model_dir
from .devices import check_device
from .engine import create_engine
from .engine.base import (
    BistreamRequest,
    EngineStats,
    GenerationRequest,
    SpeechTokenEngine,
    first_death,
    length_limits,
)
from .engine.silence import SilenceCap, cap_silences
from .errors import (
    InvalidRequest,
    SpeakerCorrupt,
    SpeakerNotFound,
    StoreUnavailable,
)
from .frontend.model_input import MODE_SPECS, ModelInput
from .loop_thread import LoopThread
from .model_dir import ModelDir, Models, build_models, load_model_dir
from .models.dims import RASParams
from .offline import segments_at_once
from .request import (
    Audio,
    AudioChunk,
    SynthesisOptions,
    SynthesisRequest,
    Voice,
    derived_seed,
)
from .request_front import RequestFront, TextMode, TextNormalization
from .speakers import SpeakerRecord, SpeakerStoreBase
from .stage_stats import StageStats, totals
from .startup import Startup
from .token2wav import ChunkSchedule
from .token2wav.batcher import Token2WavBatcher
from .token2wav.flow_cache import speaker_prefix_tokens, state_nbytes
from .token2wav.process import token2wav_worker
from .utterance import Playback, Utterance
from .warmup import Warmup, compile_in_use, release_heap, settle_heap

log = logging.getLogger(__name__)


@dataclass
class TextFed:
    """How much text a bistream request has been given, and whether that is all of it."""
    n_tokens: int = 0
    ended: bool = False


async def counted_text(tokens: AsyncIterator[list[int]], fed: TextFed) -> AsyncIterator[list[int]]:
    """Bistream: the text's token ids passed on, counted in `fed` (ended once they are all there)."""
    async for batch in tokens:
        fed.n_tokens += len(batch)
        yield batch
    if fed.n_tokens == 0:
        raise InvalidRequest("no text was received (or only whitespace)")
    fed.ended = True


async def read_ahead(items: AsyncIterator, queue: asyncio.Queue) -> None:
    """Reader task: `items` onto the queue, then None (or the error)."""
    try:
        async for item in items:
            queue.put_nowait(item)
        queue.put_nowait(None)
    except asyncio.CancelledError:
        raise
    except BaseException as e:  # noqa: B036 - handed to the consumer
        queue.put_nowait(e)


class Synthesizer:
    """One instance per process and device. The text frontend and ONNX prompt work run in a CPU
    thread pool, the LM in the engine, flow + HiFT in the token2wav batcher's device thread; the
    event loop only routes. Closing a synthesis iterator (or cancelling its task) aborts the LM
    request and drops its pending chunk jobs."""

    def __init__(self, *, config: Config, model_dir: ModelDir, models: Models, front: RequestFront,
                 engine: SpeechTokenEngine, batcher: Token2WavBatcher):
        self.config = config
        self.front = front
        self.rules = front.rules
        self.model_dir = model_dir
        self.models = models
        self.dims = model_dir.dims
        self.sample_rate = self.dims.sample_rate
        self.tokenizer = front.tokenizer
        self.text_frontend = front.text_frontend
        self.prompt_encoder = front.prompt_encoder
        self.engine = engine
        self.batcher = batcher
        self.ready = False
        self.compile_cache: PersistentCompileCache | None = None  # saved after the warm-up
        self.warming = Warmup(config, self.sample_rate,
                              max_tokens=min(40, self.rules.max_forced_tokens), capture=batcher.capture_graphs)
        self._engine_serial = itertools.count()  # see _engine_request_id

    @property
    def speakers(self) -> SpeakerStoreBase:
        return self.front.speakers

    @speakers.setter
    def speakers(self, store: SpeakerStoreBase) -> None:  # placement's replicas share one store
        self.front.speakers = store

    # -- construction ---------------------------------------------------------------------------

    @classmethod
    async def create(cls, config: Config, warmup: bool = True,
                     token2wav: Callable[[ModelDir], Token2WavBatcher] | None = None,
                     startup: Startup | None = None, serve_captures: bool = True) -> "Synthesizer":
        """Load the model directory, start the engine and (optionally) warm up, then
        `serve_captures` (`serve_captures=False`: the caller does, once every synthesizer of the
        process has warmed up: placement's replicas). `token2wav` builds the token2wav stage
        elsewhere (placement's disaggregated pool): this device then loads only the LM. `startup`
        (startup.py) is told each step and times it; without one, the phase table of this start
        is logged here."""
        own = startup is None
        startup = startup or Startup()
        with startup.span("load weights", "loading weights"):
            synth = await asyncio.get_running_loop().run_in_executor(None, cls._build, config, token2wav)
        if synth.compile_cache is not None:
            startup.compile_cache = synth.compile_cache.outcome
        with startup.span("warm-up", "warming up: starting the engine (compile, CUDA graphs)"):
            await synth.engine.start()
        if warmup:
            await synth.warm_start(startup)
            if serve_captures:
                await synth.serve_captures()
            if own:
                log.info("%s", startup.finish().table())
        synth.ready = True
        return synth

    async def serve_captures(self) -> None:
        """After the warm-up: the token2wav stage's capture thread captures, beside the batches, the
        CUDA graphs calls want from now on, and nothing compiles in this process any more
        (Token2WavBatcher.serve_captures). Without a warm-up it is never called: wanted graphs
        are then not captured."""
        await self.batcher.serve_captures()

    async def warm_start(self, startup: Startup, rounds: int = 1) -> None:
        """`warmup(rounds)`, then the persistent compile cache saved, both timed in `startup`."""
        with startup.span("warm-up", "warming up: warm-up requests and CUDA graph captures"):
            await self.warmup(rounds)
        if self.compile_cache is not None:
            with startup.span("save compile cache", "warming up: saving the compile cache"):
                await asyncio.to_thread(self.compile_cache.save)

    @classmethod
    def _build(cls, config: Config, token2wav: Callable[[ModelDir], Token2WavBatcher] | None) -> "Synthesizer":
        device = check_device(config.model.device)
        model_dir = load_model_dir(resolve_model_dir(config.model.dir))
        # The request front loads beside the compile cache and the LM: its imports (inflect, which
        # typeguard instruments for seconds; wetext's FSTs) are Python, the LM's loading mostly torch
        # work that releases the GIL, and its ONNX sessions are built in C++. All is done before
        # anything starts a process or a device stage, so a failure leaves nothing running.
        with ThreadPoolExecutor(1, thread_name_prefix="load-front") as loader:
            loading_front = loader.submit(RequestFront.load, config, model_dir)
            try:
                compile_cache = None
                if compile_in_use(config):
                    use_compile_cache(config)
                    compile_cache = open_compile_cache(config, model_dir.path, device)
                # vLLM loads the LM itself (its export of llm.pt); only the native engine needs our module.
                # Flow and HiFT belong to the token2wav stage (token2wav_worker), loaded there.
                models = build_models(model_dir, device=device, llm_dtype=getattr(torch, config.model.llm_dtype),
                                      with_llm=config.engine.kind == "native", with_token2wav=False)
            except BaseException:  # the front that loaded beside a failed build is closed, not left behind
                loading_front.add_done_callback(lambda f: f.exception() is None and f.result().close())
                raise
            front = loading_front.result()
        front.limit_to_device(device_memory(config.model.device))
        engine = create_engine(config, models.llm, model_dir)
        batcher = token2wav_worker(config, model_dir, config.model.device) if token2wav is None else token2wav(model_dir)
        synth = cls(config=config, model_dir=model_dir, models=models, front=front, engine=engine, batcher=batcher)
        synth.compile_cache = compile_cache
        return synth

    async def warmup(self, rounds: int = 1) -> None:
        """Before SERVING: every stage once, where shapes are captured the fixed set of CUDA graphs
        (warmup.capture_plan), and the flow prompt prefixes of the speakers registered last (`prepare_stored_speakers`, on every token2wav device at once);
        then the heap collected and frozen (warmup.settle_heap), so the full collection the start made
        due is not paid by the first request.
        rounds: how often the warm-up requests run (a token2wav pool's sequential streams go round
        its workers: one round per worker warms each)."""
        for _ in range(rounds):
            await self.warming.run(self.synthesize)
        await self.prepare_stored_speakers()
        settle_heap()

    async def prepare_stored_speakers(self) -> int:
        """The flow cache's prompt prefixes of the most recently registered zero-shot speakers, as
        many as `token2wav.flow_cache_speaker_bytes` holds (at most `warmup.max_speakers`), so
        their first requests after a start do not compute them. Returns how many were computed."""
        t2w = self.config.token2wav
        if not t2w.flow_cache:
            return 0
        dtype = getattr(torch, self.config.model.flow_dtype)
        flow = self.dims.flow
        chosen, size = [], 0
        try:
            infos = await self._in_cpu(self.speakers.infos)
        except StoreUnavailable as e:  # health stays NOT_SERVING until the store answers (the server's watch)
            log.warning("no speaker prompt prefixes computed at start: %s", e)
            return 0
        for info in sorted(infos, key=lambda i: -i.created_at):
            if len(chosen) >= self.config.warmup.max_speakers:
                break
            tokens = speaker_prefix_tokens(info.n_speech_tokens, flow.chunk_tokens, flow.pre_lookahead_len)
            if info.kind == "sft" or tokens == 0 or info.model_kind != self.dims.kind:
                continue
            size += state_nbytes(flow, tokens, dtype)
            if size > t2w.flow_cache_speaker_bytes:
                break
            chosen.append(info.speaker_id)
        t = time.monotonic()
        for speaker_id in reversed(chosen):  # the newest last: the most recently used in the LRU
            try:
                record = await self._in_cpu(self.speakers.get, speaker_id)
            except SpeakerNotFound:  # deleted since the listing
                continue
            except (SpeakerCorrupt, StoreUnavailable) as e:  # logged by the store; the others still start
                log.warning("start-up skips speaker %r: %s", speaker_id, e)
                continue
            await self._prepare_prefix(record)
        if chosen:
            log.info("flow prompt prefixes of %d registered speaker(s) computed in %.1f s", len(chosen),
                     time.monotonic() - t)
        return len(chosen)

    async def wait_dead(self) -> str:
        """Returns (a one-line sentence) once the LM engine or a token2wav process has died: this
        instance can serve no more. Never while both run, or after close()."""
        async def engine() -> str:
            return f"the speech-token engine died ({await self.engine.wait_dead()})"

        return await first_death(engine(), self.batcher.wait_dead())

    async def close(self) -> None:
        self.ready = False
        await self.engine.stop()
        await self.batcher.close()
        self.front.close()
        release_heap()

    def engine_stats(self) -> EngineStats:
        return self.engine.stats()

    def stage_stats(self) -> list[StageStats]:
        """The device stages' own busy-time counters (the engine's steps, token2wav batches)."""
        stats = [s for s in (self.engine.stage_stats, self.engine.prefill_stats) if s is not None]
        return totals(stats + self.batcher.stage_stats_list())

    @property
    def supports_bistream(self) -> bool:
        return self.engine.supports_bistream

    async def _in_cpu(self, fn, *args, **kwargs):
        return await self.front.in_cpu(fn, *args, **kwargs)

    # -- voices -----------------------------------------------------------------------------------

    async def prepare_voice(self, request: SynthesisRequest) -> Voice:
        """The request's voice, resolved once (RequestFront.prepare_voice)."""
        return await self.front.prepare_voice(request)

    async def register_speaker(self, speaker_id: str, prompt_text: str, audio: Audio,
                               overwrite: bool = False) -> SpeakerRecord:
        """Compute and store a zero-shot speaker (RequestFront.new_speaker), then `prepare_speaker`:
        it returns once the speaker's first request would pay for nothing that can be done ahead."""
        record = await self.front.new_speaker(speaker_id, prompt_text, audio, overwrite)
        try:
            await self.prepare_speaker(record)
        except Exception as e:  # noqa: BLE001 — stored and usable: its first request does what this could not
            log.warning("speaker %r is stored, but preparing it failed (%s: %s); its first request will compute "
                        "what preparing would have", speaker_id, type(e).__name__, e)
        return record

    async def prepare_speaker(self, record: SpeakerRecord) -> None:
        """What a stored speaker's first request would otherwise compute: its flow prompt prefix on
        every token2wav device (the exact flow cache, token2wav/flow_cache.py). Its graphs are not
        captured here: the warm-up's fixed set covers a prompt of up to warmup.capture_prompt_tokens
        at 1 stream (warmup.py), whichever speaker it is."""
        await self._prepare_prefix(record)

    async def _prepare_prefix(self, record: SpeakerRecord) -> None:
        voice = record.voice
        if voice.n_tokens == 0:  # an sft speaker (embedding only) has no prompt to cache
            return
        voice = voice.aligned(self.dims.token_mel_ratio)
        await self.batcher.prepare_speaker(torch.from_numpy(voice.speech_tokens.copy()).reshape(1, -1),
                                           torch.from_numpy(voice.speech_feat.copy())[None],
                                           torch.from_numpy(voice.embedding.copy()).reshape(1, -1), record.speaker_id)

    async def delete_speaker(self, speaker_id: str) -> None:
        """Delete a stored speaker and drop what the flow cached for it (its prompt prefix)."""
        await self._in_cpu(self.speakers.delete, speaker_id)
        self.batcher.forget_speaker(speaker_id)

    # -- synthesis ------------------------------------------------------------------------------

    async def synthesize(self, request: SynthesisRequest, voice: Voice | None = None) -> AsyncIterator[AudioChunk]:
        """Chunks of every text segment in order; the last one has is_final set."""
        request = self.rules.check(request)
        inputs = await self.model_inputs(request, voice or await self.prepare_voice(request))
        async with self.front.admit(request, inputs), contextlib.aclosing(self.speak(request, inputs)) as chunks:
            async for chunk in chunks:
                yield chunk

    async def speak(self, request: SynthesisRequest, inputs: list[ModelInput]) -> AsyncIterator[AudioChunk]:
        """A checked request's model inputs (`model_inputs`) -> its chunks: the devices' part of
        `synthesize`, which a device worker process runs for the server's front (worker_pool.py)."""
        playback = Playback(time.monotonic(), self.sample_rate)
        t2w = self.config.token2wav
        if not request.options.stream and t2w.offline and len(inputs) > 1:  # no listener between segments
            def make(i: int, own: Playback) -> Utterance:
                return self._utterance(request, inputs[i], i, own, last=i == len(inputs) - 1)
            async with contextlib.aclosing(segments_at_once(make, len(inputs), playback,
                                                            t2w.offline_segments_ahead)) as chunks:
                async for chunk in chunks:
                    yield chunk
            return
        for i, model_input in enumerate(inputs):
            utterance = self._utterance(request, model_input, i, playback, last=i == len(inputs) - 1)
            async with contextlib.aclosing(utterance.run()) as chunks:  # closed now, not when collected
                async for chunk in chunks:
                    yield chunk

    async def model_inputs(self, request: SynthesisRequest, voice: Voice) -> list[ModelInput]:
        """What the LM and the flow receive for each text segment of a checked request."""
        return await self.front.model_inputs(request, voice)

    async def synthesize_stream(self, text: AsyncIterable[str | object], request: SynthesisRequest, *,
                                text_mode: TextMode | None = None,
                                text_normalization: TextNormalization | None = None) -> AsyncIterator[AudioChunk]:
        """Text that arrives in pieces (a token, a word, a sentence) -> chunks. The voice and
        options come from `request` (its text stays empty); the voice is prepared once.

        text_mode "bistream" (the default where the engine `supports_bistream`): one LM request
        for the whole stream, fed the text's tokens as they arrive (CosyVoice2's bistream mode:
        speech starts after the first 10 text tokens). text_normalization "safe" (the default):
        the text is normalized like a whole text, released up to the last safe boundary
        (frontend/stream_text.py: one word late in English, a clause in Chinese; `FLUSH` releases
        what is held); "raw": each piece tokenized on its own without normalization, exactly as
        upstream, for token-for-token parity (RequestFront.stream_tokens). Upstream's bistream loop
        has no length rule, so a model that never emits EOS would speak to max_model_len:
        `_length_rule` applies upstream's max_token_text_ratio once the text has ended.
        "sentence" (the default otherwise): each sentence is normalized and synthesized as soon as
        it is complete (`FLUSH` cuts what is buffered), with upstream's length rules.
        Either way the stream ends with a final chunk, which carries no audio when the end of the
        text was known only after the last audio. A pause of more than `limits.text_idle_seconds`
        between pieces raises TextTimeout."""
        request = self.rules.check(request, streamed_text=True)
        mode, normalization = self.front.stream_modes(text_mode, text_normalization, self.supports_bistream)
        voice = await self.prepare_voice(request)
        instruction = await self._in_cpu(self.front.instruction_tokens, request)
        tokens = self.front.stream_tokens(text, request, mode, normalization)
        async with (self.front.admit_stream(request, voice, instruction),
                    contextlib.aclosing(self.speak_stream(request, voice, instruction, mode, tokens)) as chunks):
            async for chunk in chunks:
                yield chunk

    async def speak_stream(self, request: SynthesisRequest, voice: Voice, instruction: list[int], mode: TextMode,
                           text_tokens: AsyncIterator[list[int]]) -> AsyncIterator[AudioChunk]:
        """A text stream's token ids (`RequestFront.stream_tokens`) -> its chunks: the devices' part
        of `synthesize_stream`, which a device worker process runs for the server's front
        (worker_pool.py). bistream: one LM request fed the token ids as they arrive; sentence: an
        utterance per list (a text segment), read ahead while the earlier ones speak."""
        playback = Playback(time.monotonic(), self.sample_rate)
        if mode == "bistream":
            model_input = self.front.model_input(request.mode, voice, instruction_tokens=instruction)
            fed = TextFed()
            utterance = self._utterance(request, model_input, 0, playback, last=True,
                                        text_tokens=counted_text(text_tokens, fed), fed=fed)
            async with contextlib.aclosing(utterance.run()) as chunks:
                async for chunk in chunks:
                    yield chunk
            return
        segments: asyncio.Queue = asyncio.Queue()
        reader = asyncio.create_task(read_ahead(text_tokens, segments))
        try:
            n = 0
            while (item := await segments.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                model_input = self.front.model_input(request.mode, voice, text_tokens=item,
                                                     instruction_tokens=instruction)
                utterance = self._utterance(request, model_input, n, playback, last=False)
                async with contextlib.aclosing(utterance.run()) as chunks:
                    async for chunk in chunks:
                        yield chunk
                n += 1
            if n == 0:
                raise InvalidRequest("no text was received (or only punctuation)")
            yield playback.empty_final_chunk()
        finally:
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)

    async def _length_rule(self, speech: AsyncIterator[list[int]], fed: TextFed) -> AsyncIterator[list[int]]:
        """Bistream: upstream's length rule for text it has all of (at most max_token_text_ratio
        speech tokens per text token), applied once the text has ended. Upstream's bistream loop has
        none, so a model that never emits EOS would speak to max_model_len. Stopping early closes
        `speech`, which aborts the LM request."""
        ratio = self.dims.lm.max_token_text_ratio
        n = 0
        async with contextlib.aclosing(speech):
            async for batch in speech:
                if fed.ended and n + len(batch) >= (limit := int(fed.n_tokens * ratio)):
                    if limit > n:
                        yield batch[:limit - n]
                    return
                n += len(batch)
                yield batch

    def _utterance(self, request: SynthesisRequest, model_input: ModelInput, segment: int, playback: Playback,
                   *, last: bool, text_tokens: AsyncIterator[list[int]] | None = None,
                   fed: TextFed | None = None) -> Utterance:
        """text_tokens: a bistream utterance's target text as it arrives, `fed` counting it (None:
        the model input's text)."""
        opts = request.options
        batcher = self.batcher.pick()  # one device's token2wav for the whole utterance (placement)
        t2w = batcher.open_stream(
            torch.tensor(model_input.flow_prompt_speech_token).reshape(1, -1),
            torch.tensor(model_input.prompt_speech_feat)[None],
            torch.tensor(model_input.flow_embedding).reshape(1, -1),
            seed=opts.seed, segment=segment, stream=opts.stream, speed=opts.speed,
            prompt_key=request.speaker_id if MODE_SPECS[request.mode].voice == "speaker" else None,
            schedule=ChunkSchedule(first_hop=opts.first_hop, max_hop_multiple=self.config.token2wav.max_hop_multiple,
                                   prompt_align=1, pre_lookahead=self.dims.flow.pre_lookahead_len,
                                   token_mel_ratio=self.dims.token_mel_ratio,
                                   samples_per_frame=self.dims.hift.samples_per_frame))
        adaptive = self.config.token2wav.adaptive
        if not model_input.spec.runs_lm:
            return Utterance(segment, t2w, batcher, playback, last=last, adaptive=adaptive,
                             source_tokens=model_input.source_speech_token)
        if text_tokens is not None:
            speech = self._length_rule(
                self.engine.generate_bistream(self._bistream_request(request, model_input), text_tokens), fed)
        else:
            speech = self.engine.generate(self._generation_request(request, model_input, segment))
        if self.dims.lm.silent_tokens:  # CosyVoice3: long silences never reach the flow (the LM saw them)
            speech = cap_silences(speech, SilenceCap(self.dims.lm.silent_tokens))
        return Utterance(segment, t2w, batcher, playback, last=last, adaptive=adaptive, speech=speech)

    def _bistream_request(self, request: SynthesisRequest, model_input: ModelInput) -> BistreamRequest:
        opts = request.options
        # the LM text known up front: the prompt text, and CosyVoice3's system prompt where a mode
        # without prompt text carries it in front of its (streamed) text
        prompt = np.concatenate([model_input.prompt_text, model_input.text])
        system_len = 0
        if self.front.system_prompt is not None:  # CosyVoice3: through the first <|endofprompt|> goes in with sos
            system_len = int(np.flatnonzero(prompt == self.front.system_prompt.endofprompt)[0]) + 1
        return BistreamRequest(
            request_id=self._engine_request_id(request, 0),
            prompt_text_tokens=tuple(int(t) for t in prompt), system_prompt_len=system_len,
            prompt_speech_tokens=tuple(int(t) for t in model_input.llm_prompt_speech_token),
            # the engine's own bound; the length rule proper is _length_rule
            max_tokens=opts.max_tokens or self.config.engine.max_model_len, ras=self._ras(opts), seed=opts.seed)

    def _generation_request(self, request: SynthesisRequest, model_input: ModelInput, segment: int) -> GenerationRequest:
        opts = request.options
        lm = self.dims.lm
        min_len, max_len = length_limits(len(model_input.text), lm.min_token_text_ratio, lm.max_token_text_ratio)
        ras = self._ras(opts)
        forced = opts.max_tokens is not None
        if forced:
            min_len = max_len = opts.max_tokens
        return GenerationRequest(
            request_id=self._engine_request_id(request, segment),
            text_tokens=model_input.lm_text_tokens,
            prompt_speech_tokens=tuple(int(t) for t in model_input.llm_prompt_speech_token),
            min_tokens=min(min_len, max_len), max_tokens=max(max_len, 1), ras=ras,
            seed=None if opts.seed is None else derived_seed(opts.seed, 1, segment),
            ignore_stop_tokens=forced)

    def _engine_request_id(self, request: SynthesisRequest, segment: int) -> str:
        """The LM engine's id for one segment. The caller's request_id only labels logs and the
        summary, so two syntheses may share it; the serial keeps their engine requests apart
        (a duplicate engine id would be refused by the native engine and merged by vLLM's abort)."""
        return f"{request.request_id}-{segment}.{next(self._engine_serial)}"

    def _ras(self, opts: SynthesisOptions) -> RASParams:
        ras = self.ras_params()
        return ras if opts.top_k is None else dataclasses.replace(ras, top_k=opts.top_k)

    def ras_params(self) -> RASParams:
        """The model yaml's RAS parameters with the config's overrides."""
        s = self.config.sampling
        overrides = {k: v for k, v in (("top_p", s.top_p), ("top_k", s.top_k), ("win_size", s.win_size),
                                       ("tau_r", s.tau_r)) if v is not None}
        return dataclasses.replace(self.dims.sampling, **overrides)


class SyncSynthesizer:
    """A Synthesizer for scripts without an event loop: it runs one on a `LoopThread`.

        with SyncSynthesizer(Config()) as synth:
            for chunk in synth.synthesize(request): ...
    """

    def __init__(self, config: Config, warmup: bool = False):
        self._loop = LoopThread("synthesizer-loop")
        self.synth: Synthesizer = self._loop.call(Synthesizer.create(config, warmup=warmup))

    def synthesize(self, request: SynthesisRequest) -> Iterator[AudioChunk]:
        """Chunks as they are produced; leaving the loop early cancels the request."""
        return self._loop.iterate(self.synth.synthesize(request))

    def call(self, coro):
        """Run a coroutine (of the synthesizer's methods) on its loop and return the result."""
        return self._loop.call(coro)

    def register_speaker(self, speaker_id: str, prompt_text: str, audio: Audio, overwrite: bool = False):
        return self._loop.call(self.synth.register_speaker(speaker_id, prompt_text, audio, overwrite))

    def close(self) -> None:
        self._loop.call(self.synth.close())
        self._loop.close()

    def __enter__(self) -> "SyncSynthesizer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
