"""Synthesizer: one async generator per request, every mode as data.

The request types (Mode, Audio, SynthesisOptions, SynthesisRequest, AudioChunk) are what flows
in and out; `Synthesizer` wires text frontend -> engine -> token2wav batcher for each request, and
`SyncSynthesizer` runs one on a background event loop for scripts.
"""
from __future__ import annotations

import asyncio
import contextlib
import enum
import functools
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from dataclasses import replace as dataclasses_replace
from typing import TYPE_CHECKING, AsyncIterator, Iterator

import numpy as np

if TYPE_CHECKING:
    from .config import Config
    from .engine.base import EngineStats, SpeechTokenEngine
    from .frontend.prompt import PromptEncoder, PromptFeatures
    from .frontend.text import TextFrontend
    from .frontend.tokenizer import TextTokenizer
    from .model_dir import ModelDir, Models
    from .speakers import SpeakerRecord, SpeakerStore
    from .token2wav_batcher import Token2WavBatcher

log = logging.getLogger(__name__)


class Mode(str, enum.Enum):
    ZERO_SHOT = "zero_shot"                      # prompt text + prompt audio
    CROSS_LINGUAL = "cross_lingual"              # prompt audio
    INSTRUCT2 = "instruct2"                      # instruction + prompt audio
    SFT = "sft"                                  # stored speaker embedding only
    ZERO_SHOT_BY_SPK_ID = "zero_shot_by_spk_id"  # stored zero-shot speaker
    INSTRUCT2_BY_SPK_ID = "instruct2_by_spk_id"  # instruction + stored speaker
    VC = "vc"                                    # source audio + prompt audio, no LLM


@dataclass(frozen=True)
class Audio:
    """Mono float32 samples in [-1, 1] at `sample_rate`."""
    samples: np.ndarray
    sample_rate: int

    @property
    def seconds(self) -> float:
        return len(self.samples) / self.sample_rate


@dataclass(frozen=True)
class SynthesisOptions:
    stream: bool = False
    speed: float = 1.0           # non-streaming only (upstream rule)
    text_frontend: bool = True   # normalize + split the text like upstream
    seed: int | None = None
    first_hop: int = 15          # speech tokens in the first streamed chunk (upstream: 25)
    top_k: int | None = None     # RAS override (1 = greedy)
    max_tokens: int | None = None  # benchmarks: force a token count (EOS ignored until then)


@dataclass(frozen=True)
class SynthesisRequest:
    mode: Mode
    text: str = ""
    prompt_text: str = ""
    prompt_audio: Audio | None = None
    instruct_text: str = ""
    speaker_id: str = ""
    source_audio: Audio | None = None
    options: SynthesisOptions = field(default_factory=SynthesisOptions)
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)


@dataclass
class AudioChunk:
    samples: np.ndarray          # float32 mono
    sample_rate: int
    index: int                   # 0, 1, 2, ... across all text segments
    is_final: bool
    sample_offset: int           # samples emitted before this chunk
    segment_index: int = 0
    n_tokens: int = 0            # speech tokens this chunk covers (final chunk: total of the request)
    elapsed_s: float = 0.0       # seconds since the request started when this chunk was ready
    segment_tokens: tuple[int, ...] = ()  # on a segment's last chunk: the speech tokens it rendered


# ---------------------------------------------------------------------------------------------
# The synthesizer
# ---------------------------------------------------------------------------------------------

ENDOFPROMPT = "<|endofprompt|>"
SPEED_RANGE = (0.5, 2.0)
MAX_FIRST_HOP = 200


@dataclass(frozen=True)
class Voice:
    """A request's resolved voice: prompt features plus the LM's prompt text tokens."""
    features: "PromptFeatures"
    prompt_text_tokens: tuple[int, ...] = ()


@dataclass
class _Progress:
    """Per-request counters shared by all of its segments."""
    started: float
    index: int = 0
    samples: int = 0
    tokens: int = 0
    first_chunk_at: float | None = None

    def deadline(self, sample_rate: int) -> float:
        """When the listener runs out of audio sent so far (now, before the first chunk)."""
        if self.first_chunk_at is None:
            return time.monotonic()
        return self.first_chunk_at + self.samples / sample_rate


@dataclass
class _Pace:
    """One segment's recent speeds, for the adaptive chunk schedule."""
    started: float
    chunk_s: float = 0.0

    def token_s(self, n_tokens: int, now: float) -> float:
        return (now - self.started) / max(n_tokens, 1)


def validate_request(request: SynthesisRequest, max_text_chars: int | None = None) -> None:
    """Reject what no mode can serve, with a message the caller can act on."""
    from .frontend.model_input import MODE_SPECS

    if not isinstance(request.mode, Mode):
        raise _invalid(f"unknown mode {request.mode!r}; one of {[m.value for m in Mode]}")
    spec = MODE_SPECS[request.mode]
    opts = request.options
    if spec.runs_lm and not request.text.strip():
        raise _invalid("text is empty")
    if max_text_chars is not None and len(request.text) > max_text_chars:
        raise _invalid(f"text has {len(request.text)} characters; the limit is {max_text_chars}")
    if spec.voice == "audio" and request.prompt_audio is None:
        raise _invalid(f"mode {request.mode.value} needs prompt audio")
    if spec.voice == "speaker" and not request.speaker_id:
        raise _invalid(f"mode {request.mode.value} needs a speaker_id")
    if request.mode == Mode.ZERO_SHOT and not request.prompt_text.strip():
        raise _invalid("zero_shot needs the prompt audio's transcript (prompt_text)")
    if spec.lm_prompt_text == "instruction" and not request.instruct_text.replace(ENDOFPROMPT, "").strip():
        raise _invalid(f"mode {request.mode.value} needs an instruction (instruct_text)")
    if request.mode == Mode.VC and request.source_audio is None:
        raise _invalid("vc needs source audio")
    if not SPEED_RANGE[0] <= opts.speed <= SPEED_RANGE[1]:
        raise _invalid(f"speed must be in [{SPEED_RANGE[0]}, {SPEED_RANGE[1]}], got {opts.speed}")
    if opts.stream and opts.speed != 1.0:
        raise _invalid("speed != 1 is only supported without streaming (upstream rule)")
    if not 1 <= opts.first_hop <= MAX_FIRST_HOP:
        raise _invalid(f"first_hop must be in [1, {MAX_FIRST_HOP}], got {opts.first_hop}")
    if opts.top_k is not None and opts.top_k < 1:
        raise _invalid(f"top_k must be >= 1, got {opts.top_k}")
    if opts.max_tokens is not None and opts.max_tokens < 1:
        raise _invalid(f"max_tokens must be >= 1, got {opts.max_tokens}")
    for name in ("prompt_audio", "source_audio"):
        audio = getattr(request, name)
        if audio is not None and (audio.sample_rate <= 0 or np.asarray(audio.samples).ndim != 1
                                  or len(audio.samples) == 0):
            raise _invalid(f"{name} must be non-empty mono samples with a positive sample rate")


def _invalid(message: str):
    from .errors import InvalidRequest
    return InvalidRequest(message)


class Synthesizer:
    """Text (+ voice) -> streamed audio chunks. One instance per process and device.

    `async for chunk in synth.synthesize(request)` yields `AudioChunk`s for all text segments in
    order. The text frontend and ONNX prompt work run in a CPU thread pool, the LM in the engine,
    flow + HiFT in the token2wav batcher's device thread; the event loop only routes. Closing
    the iterator (or cancelling its task) aborts the LM request and drops pending chunk jobs.
    """

    def __init__(self, *, config: "Config", model_dir: "ModelDir", models: "Models",
                 tokenizer: "TextTokenizer", text_frontend: "TextFrontend", prompt_encoder: "PromptEncoder",
                 speakers: "SpeakerStore", engine: "SpeechTokenEngine", batcher: "Token2WavBatcher"):
        self.config = config
        self.model_dir = model_dir
        self.models = models
        self.dims = model_dir.dims
        self.sample_rate = self.dims.sample_rate
        self.tokenizer = tokenizer
        self.text_frontend = text_frontend
        self.prompt_encoder = prompt_encoder
        self.speakers = speakers
        self.engine = engine
        self.batcher = batcher
        self.ready = False
        self._cpu = ThreadPoolExecutor(max_workers=4, thread_name_prefix="frontend")

    # -- construction ---------------------------------------------------------------------------

    @classmethod
    async def create(cls, config: "Config", warmup: bool = True) -> "Synthesizer":
        """Load the model directory, start the engine and (optionally) warm up."""
        loop = asyncio.get_running_loop()
        synth = await loop.run_in_executor(None, cls._build, config)
        await synth.engine.start()
        if warmup:
            await synth.warmup()
        synth.ready = True
        return synth

    @classmethod
    def _build(cls, config: "Config") -> "Synthesizer":
        import torch

        from .demo import resolve_model_dir
        from .engine import create_engine
        from .estimator import estimator_from_config
        from .frontend.prompt import PromptEncoder
        from .frontend.text import TextFrontend
        from .model_dir import build_models, load_model_dir
        from .speaker_store import open_speaker_store
        from .token2wav import Token2WavRunner
        from .token2wav_batcher import Token2WavBatcher

        model_dir = load_model_dir(resolve_model_dir(config.model.dir))
        device = torch.device(config.model.device)
        # vLLM loads the LM itself (its export of llm.pt); only the native engine needs our module
        models = build_models(model_dir, device=device, dtype=getattr(torch, config.model.flow_dtype),
                              llm_dtype=getattr(torch, config.model.llm_dtype),
                              with_llm=config.engine.kind == "native")
        tokenizer = model_dir.tokenizer()
        try:
            text_frontend = TextFrontend(tokenizer)
        except ImportError as e:
            log.warning("wetext is not importable (%s): text normalization runs without it "
                        "(upstream's behaviour when no normalizer is installed)", e)
            text_frontend = TextFrontend(tokenizer, use_wetext=False)
        text_frontend.preload()
        prompt_encoder = PromptEncoder.from_model_dir(model_dir.path, mel=model_dir.dims.feat)
        speakers = open_speaker_store(config.speakers)
        engine = create_engine(config, models.llm, model_dir)
        estimator = estimator_from_config(config.token2wav, models.flow, flow_pt=model_dir.path / "flow.pt")
        runner = Token2WavRunner(models.flow, models.hift, estimator=estimator,
                                 length_bucket_ratio=config.token2wav.length_bucket_ratio)
        batcher = Token2WavBatcher(runner, max_batch=config.token2wav.max_batch,
                                   batching=config.token2wav.batching)
        return cls(config=config, model_dir=model_dir, models=models, tokenizer=tokenizer,
                   text_frontend=text_frontend, prompt_encoder=prompt_encoder, speakers=speakers,
                   engine=engine, batcher=batcher)

    async def warmup(self) -> None:
        """One short streamed synthesis through every stage, so the first request is not slow."""
        rng = np.random.default_rng(0)
        t = np.arange(self.sample_rate) / self.sample_rate
        wav = (0.3 * np.sin(2 * np.pi * 180 * t) + 0.01 * rng.standard_normal(t.size)).astype(np.float32)
        request = SynthesisRequest(Mode.CROSS_LINGUAL, text="Warm up.", prompt_audio=Audio(wav, self.sample_rate),
                                   options=SynthesisOptions(stream=True, seed=0, max_tokens=40))
        async for _ in self.synthesize(request):
            pass

    async def close(self) -> None:
        self.ready = False
        await self.engine.stop()
        await self.batcher.close()
        self._cpu.shutdown(wait=False, cancel_futures=True)

    def engine_stats(self) -> "EngineStats":
        return self.engine.stats()

    async def _in_cpu(self, fn, *args, **kwargs):
        return await asyncio.get_running_loop().run_in_executor(self._cpu, functools.partial(fn, *args, **kwargs))

    # -- speakers ------------------------------------------------------------------------------

    async def register_speaker(self, speaker_id: str, prompt_text: str, audio: Audio,
                               overwrite: bool = False) -> "SpeakerRecord":
        """Compute and store a zero-shot speaker (tokens, 24 kHz mel, embedding, prompt text tokens)."""
        from .speakers import SpeakerRecord, validate_speaker_id

        validate_speaker_id(speaker_id)
        if not prompt_text.strip():
            raise _invalid("prompt_text (the transcript of the prompt audio) is empty")
        self._check_prompt_audio(audio, "prompt_audio")
        if not overwrite and self.speakers.exists(speaker_id):
            from .errors import SpeakerExists
            raise SpeakerExists(f"speaker {speaker_id!r} exists; pass overwrite to replace it")
        features = await self._in_cpu(self.prompt_encoder.encode, audio)
        text = await self._in_cpu(self.text_frontend.normalize, prompt_text, split=False)
        tokens = self.tokenizer.encode(text)
        record = SpeakerRecord(speaker_id, "zero_shot", text, np.asarray(tokens, np.int32),
                               features.speech_tokens, features.speech_feat, features.embedding)
        await self._in_cpu(self.speakers.put, record, overwrite)
        return record

    def _check_prompt_audio(self, audio: Audio, name: str) -> None:
        limit = self.config.limits.max_prompt_seconds
        if audio.seconds > limit:
            raise _invalid(f"{name} is {audio.seconds:.1f} s; the limit is {limit:g} s")

    # -- synthesis -----------------------------------------------------------------------------

    async def synthesize(self, request: SynthesisRequest) -> AsyncIterator[AudioChunk]:
        from .frontend.model_input import MODE_SPECS, build_model_input

        validate_request(request, self.config.limits.max_text_chars)
        progress = _Progress(started=time.monotonic())
        spec = MODE_SPECS[request.mode]
        voice = await self._resolve_voice(request)
        if spec.runs_lm:
            segments = await self._in_cpu(self.text_frontend.normalize, request.text, split=True,
                                          enabled=request.options.text_frontend)
            segments = [s for s in segments if s.strip()]
            if not segments:
                raise _invalid("text has nothing to speak after normalization (only punctuation?)")
            token_lists = [self.tokenizer.encode(s) for s in segments]
            inputs = [build_model_input(request.mode, voice.features, text_tokens=tokens,
                                        prompt_text_tokens=voice.prompt_text_tokens) for tokens in token_lists]
        else:
            source = await self._in_cpu(self.prompt_encoder.source_tokens, request.source_audio)
            inputs = [build_model_input(request.mode, voice.features, source_speech_tokens=source)]
        for i, model_input in enumerate(inputs):
            last = i == len(inputs) - 1
            async for chunk in self._synthesize_segment(request, model_input, i, last, progress):
                yield chunk

    async def _resolve_voice(self, request: SynthesisRequest) -> Voice:
        from .frontend.model_input import MODE_SPECS
        from .frontend.prompt import PromptFeatures

        spec = MODE_SPECS[request.mode]
        opts = request.options
        if spec.voice == "audio":
            self._check_prompt_audio(request.prompt_audio, "prompt_audio")
            if request.source_audio is not None:
                self._check_prompt_audio(request.source_audio, "source_audio")
            # VC too gets the aligned prompt (upstream's frontend_vc skips the alignment, which makes
            # the flow's output length depend on the prompt's mel/token mismatch)
            features = await self._in_cpu(self.prompt_encoder.encode, request.prompt_audio)
            transcript: tuple[int, ...] = ()
            if spec.lm_prompt_text == "transcript":
                text = await self._in_cpu(self.text_frontend.normalize, request.prompt_text, split=False,
                                          enabled=opts.text_frontend)
                transcript = tuple(self.tokenizer.encode(text))
        else:
            record = await self._in_cpu(self.speakers.get, request.speaker_id)
            if request.mode == Mode.SFT or record.kind == "sft":
                if spec.flow_prompt:
                    from .errors import Unsupported
                    raise Unsupported(f"speaker {request.speaker_id!r} is an embedding-only (sft) speaker; "
                                      f"mode {request.mode.value} needs a zero-shot speaker")
                features = PromptFeatures.embedding_only(record.embedding)
            else:
                features = PromptFeatures(record.speech_tokens, record.speech_feat, record.embedding)
            transcript = tuple(int(t) for t in record.prompt_text_tokens)
        if spec.lm_prompt_text == "instruction":
            instruction = request.instruct_text
            if ENDOFPROMPT not in instruction:  # upstream HEAD requires the caller to add it
                instruction = instruction + ENDOFPROMPT
            return Voice(features, tuple(self.tokenizer.encode(instruction)))
        return Voice(features, transcript)

    async def _synthesize_segment(self, request: SynthesisRequest, model_input, segment: int, last: bool,
                                  progress: _Progress) -> AsyncIterator[AudioChunk]:
        import torch

        from .token2wav import ChunkSchedule, Token2WavStream, adaptive_hop

        opts = request.options
        t2w = Token2WavStream(
            torch.tensor(model_input.flow_prompt_speech_token, dtype=torch.int32).reshape(1, -1),
            torch.tensor(model_input.prompt_speech_feat, dtype=torch.float32)[None],
            torch.tensor(model_input.flow_embedding, dtype=torch.float32).reshape(1, -1),
            stream=opts.stream, speed=opts.speed, noise=self._noise(opts.seed, segment),
            schedule=ChunkSchedule(first_hop=opts.first_hop, max_hop_multiple=self.config.token2wav.max_hop_multiple,
                                   prompt_align=1, pre_lookahead=self.dims.flow.pre_lookahead_len,
                                   token_mel_ratio=self.dims.token_mel_ratio,
                                   samples_per_frame=self.dims.hift.samples_per_frame))
        tokens: list[int] = []
        pace = _Pace(started=time.monotonic())
        batcher = self.batcher.pick()  # one device's token2wav for the whole utterance (placement)

        async def render(llm_done: bool) -> AsyncIterator[AudioChunk]:
            while (job := t2w.next_job(tokens, llm_done)) is not None:
                submitted = time.monotonic()
                samples = await batcher.submit(job, progress.deadline(self.sample_rate))
                now = time.monotonic()
                pace.chunk_s = now - submitted
                if progress.first_chunk_at is None:
                    progress.first_chunk_at = now
                if self.config.token2wav.adaptive and not t2w.finished:
                    lead = progress.first_chunk_at + (progress.samples + len(samples)) / self.sample_rate - now
                    t2w.hop = adaptive_hop(t2w.schedule, t2w.hop, len(tokens) - t2w.token_offset, lead,
                                           pace.chunk_s, pace.token_s(len(tokens), now))
                final = last and t2w.finished
                chunk = AudioChunk(samples=samples.numpy(), sample_rate=self.sample_rate, index=progress.index,
                                   is_final=final, sample_offset=progress.samples, segment_index=segment,
                                   n_tokens=progress.tokens + len(tokens) if final else job.hop,
                                   elapsed_s=now - progress.started,
                                   segment_tokens=tuple(tokens) if t2w.finished else ())
                progress.index += 1
                progress.samples += len(chunk.samples)
                yield chunk

        if model_input.spec.runs_lm:
            async with contextlib.aclosing(self.engine.generate(self._generation_request(request, model_input, segment))) as gen:
                async for batch in gen:
                    tokens.extend(batch)
                    async for chunk in render(llm_done=False):
                        yield chunk
        else:
            tokens.extend(int(t) for t in model_input.source_speech_token)
        async for chunk in render(llm_done=True):
            yield chunk
        progress.tokens += len(tokens)

    def _generation_request(self, request: SynthesisRequest, model_input, segment: int):
        from .engine.base import GenerationRequest, length_limits

        opts = request.options
        lm = self.dims.lm
        min_len, max_len = length_limits(len(model_input.text), lm.min_token_text_ratio, lm.max_token_text_ratio)
        ras = self.engine_ras_params()
        if opts.top_k is not None:
            ras = dataclasses_replace(ras, top_k=opts.top_k)
        ignore_stops = opts.max_tokens is not None
        if ignore_stops:
            min_len = max_len = opts.max_tokens
        return GenerationRequest(
            request_id=f"{request.request_id}-{segment}",
            text_tokens=model_input.lm_text_tokens,
            prompt_speech_tokens=tuple(int(t) for t in model_input.llm_prompt_speech_token),
            min_tokens=min(min_len, max_len), max_tokens=max(max_len, 1), ras=ras,
            seed=None if opts.seed is None else opts.seed + segment,
            ignore_stop_tokens=ignore_stops)

    def engine_ras_params(self):
        """The model yaml's RAS parameters with the config's overrides."""
        s = self.config.sampling
        overrides = {k: v for k, v in (("top_p", s.top_p), ("top_k", s.top_k), ("win_size", s.win_size),
                                       ("tau_r", s.tau_r)) if v is not None}
        return dataclasses_replace(self.dims.sampling, **overrides)

    @staticmethod
    def _noise(seed: int | None, segment: int):
        import torch

        from .models.hift import NSFNoise
        if seed is None:
            return NSFNoise.random(torch.Generator().manual_seed(int(torch.randint(0, 2**62, ()).item())))
        return NSFNoise.random(torch.Generator().manual_seed(seed * 1000 + segment))



class SyncSynthesizer:
    """A Synthesizer for scripts without an event loop: it runs one in a background thread.

        with SyncSynthesizer(Config()) as synth:
            for chunk in synth.synthesize(request): ...
    """

    def __init__(self, config: "Config", warmup: bool = False):
        import threading

        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="synthesizer-loop", daemon=True)
        self._thread.start()
        self.synth: Synthesizer = self._call(Synthesizer.create(config, warmup=warmup))

    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def synthesize(self, request: SynthesisRequest) -> Iterator[AudioChunk]:
        """Chunks as they are produced; leaving the loop early cancels the request."""
        import queue

        chunks: queue.Queue = queue.Queue()
        done = object()

        async def pump():
            try:
                async for chunk in self.synth.synthesize(request):
                    chunks.put(chunk)
            except BaseException as e:  # handed to the caller's thread
                chunks.put(e)
            finally:
                chunks.put(done)

        future = asyncio.run_coroutine_threadsafe(pump(), self._loop)
        try:
            while (item := chunks.get()) is not done:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            future.cancel()

    def register_speaker(self, speaker_id: str, prompt_text: str, audio: Audio, overwrite: bool = False):
        return self._call(self.synth.register_speaker(speaker_id, prompt_text, audio, overwrite))

    def close(self) -> None:
        self._call(self.synth.close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()

    def __enter__(self) -> "SyncSynthesizer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

