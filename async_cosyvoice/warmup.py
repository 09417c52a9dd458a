"""Warm-up: run what serving will run before health turns SERVING, so no user pays for a compile
or a CUDA-graph capture.

Captured work is keyed by shape: the LLM's decode graphs by batch size, the compiled flow
estimator's graphs by (batch, length) bucket, and a first chunk's length is its speaker's prompt
plus the first hop. So the warm-up
1. runs one short streamed synthesis through every stage (a generated 1-s prompt), then, where
   shapes are captured (`Warmup.coverage`),
2. for each registered zero-shot speaker's prompt length (the most recent `max_speakers` distinct
   lengths), runs short requests by that speaker at 1, 2, 4, … concurrent streams up to
   `max_batch` (default: the smallest of limits.max_concurrent_streams, token2wav.max_batch and
   engine.max_num_seqs): every batch bucket of that prompt's first and final chunks, and every
   LLM decode batch size on the way; then, with whole-flow CUDA graphs (token2wav.flow_graphs),
   captures the flow graphs of that prompt length plus 1 .. `GRAPH_TARGET_TOKENS` target tokens
   at the same stream counts (the later chunks' calls, which short requests do not reach), and
   with HiFT graphs (token2wav.hift_graphs) HiFT's at every streaming chunk's mel length.
A speaker registered while serving gets step 2 before its registration returns (once per prompt
length), up to `register_max_batch` (8) streams: those requests run beside live traffic, so the
larger batch buckets of a new prompt length are captured on first use (or at the next start).

What is compiled is kept across restarts by compile_cache.py (`use_compile_cache`, re-exported here).
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, AsyncIterator, Awaitable, Callable

import numpy as np

from .compile_cache import compile_cache_dir, compile_in_use, use_compile_cache  # noqa: F401 (re-exported)
from .errors import SpeakerCorrupt, SpeakerNotFound, StoreUnavailable
from .request import Audio, AudioChunk, Mode, SynthesisOptions, SynthesisRequest
from .token2wav import ChunkSchedule

if TYPE_CHECKING:
    from .config import Config
    from .speakers import SpeakerStoreBase

log = logging.getLogger(__name__)

WARM_TEXT = "Warm up."
GRAPH_TARGET_TOKENS = 300  # target tokens (12 s of speech) a prompt length's flow graphs are captured for


def chunk_mel_frames(config: Config) -> range:
    """Mel frame counts of HiFT's streaming calls, in steps of 16: up to the cached frames plus a
    final chunk's (the longest hop and its look-ahead)."""
    t2w = config.token2wav
    s = ChunkSchedule(first_hop=t2w.first_hop, max_hop_multiple=t2w.max_hop_multiple)
    longest = s.mel_cache_len + s.token_mel_ratio * (max(s.max_hop, 2 * s.first_hop) + s.pre_lookahead)
    return range(16, longest + 16, 16)


def batch_sizes(largest: int) -> list[int]:
    """1, 2, 4, … and `largest` itself."""
    sizes, n = [], 1
    while n < largest:
        sizes.append(n)
        n *= 2
    return sizes + [largest]


def sine_prompt(sample_rate: int, seconds: float = 1.0) -> Audio:
    rng = np.random.default_rng(0)
    t = np.arange(int(sample_rate * seconds)) / sample_rate
    wav = (0.3 * np.sin(2 * np.pi * 180 * t) + 0.01 * rng.standard_normal(t.size)).astype(np.float32)
    return Audio(wav, sample_rate)


async def drain(chunks: AsyncIterator[AudioChunk]) -> None:
    async for _ in chunks:
        pass


@dataclass
class Warmup:
    """What has been warmed on one Synthesizer (`synthesize(request)` is all it uses of it)."""
    config: Config
    speakers: SpeakerStoreBase
    sample_rate: int
    max_tokens: int                     # speech tokens per warm-up request (its first and final chunks)
    # (max streams, flow token counts, HiFT mel frame counts) -> graphs captured: the token2wav
    # stage's capture_graphs
    capture: Callable[[int, range, range], Awaitable[int]] | None = None
    warmed: dict[int, list[int]] = field(default_factory=dict)  # prompt length (speech tokens) -> batch sizes run

    @property
    def coverage(self) -> bool:
        c = self.config.warmup.coverage
        return compile_in_use(self.config) if c is None else c

    @property
    def max_batch(self) -> int:
        c = self.config
        return c.warmup.max_batch or min(c.limits.max_concurrent_streams, c.token2wav.max_batch, c.engine.max_num_seqs)

    async def run(self, synthesize) -> None:
        t = time.monotonic()
        request = SynthesisRequest(Mode.CROSS_LINGUAL, text=WARM_TEXT, prompt_audio=sine_prompt(self.sample_rate),
                                   options=SynthesisOptions(stream=True, seed=0, max_tokens=self.max_tokens))
        await drain(synthesize(request))
        if self.coverage:
            try:
                stored = await asyncio.to_thread(self.speakers.infos)
            except StoreUnavailable as e:
                log.warning("warm-up skips the registered speakers: %s", e)
                stored = []
            infos = sorted((i for i in stored if i.kind != "sft"), key=lambda i: -i.created_at)
            done: set[int] = set()
            for info in infos:
                if len(done) >= self.config.warmup.max_speakers:
                    break
                if info.n_speech_tokens not in done:
                    try:
                        await self.speaker(synthesize, info.speaker_id, info.n_speech_tokens)
                    except (SpeakerNotFound, SpeakerCorrupt, StoreUnavailable) as e:  # a bad record is skipped, never fatal
                        log.warning("warm-up skips speaker %r: %s", info.speaker_id, e)
                        continue
                    done.add(info.n_speech_tokens)
        log.info("warm-up done in %.1f s (%d prompt lengths at up to %d streams)", time.monotonic() - t,
                 len(self.warmed), self.max_batch if self.coverage else 1)

    async def registered(self, synthesize, speaker_id: str, prompt_tokens: int) -> None:
        """A speaker registered while serving: `speaker` up to warmup.register_max_batch streams."""
        limit = min(self.max_batch, self.config.warmup.register_max_batch)
        if limit > 0:
            await self.speaker(synthesize, speaker_id, prompt_tokens, limit)

    async def speaker(self, synthesize, speaker_id: str, prompt_tokens: int, max_batch: int | None = None) -> None:
        """Short requests by this speaker at every batch size up to max_batch (default: all), once
        per prompt length."""
        if not self.coverage or prompt_tokens in self.warmed:
            return
        max_batch = max_batch or self.max_batch
        t = time.monotonic()
        def request() -> SynthesisRequest:  # each with its own request id
            return SynthesisRequest(Mode.ZERO_SHOT_BY_SPK_ID, text=WARM_TEXT, speaker_id=speaker_id,
                                    options=SynthesisOptions(stream=True, seed=0, max_tokens=self.max_tokens))
        done = []
        for n in batch_sizes(max_batch):
            await asyncio.gather(*(drain(synthesize(request())) for _ in range(n)))
            done.append(n)
        graphs = 0
        if self.capture is not None:  # steps of 16: every length bucket (>= 32 tokens, >= 16 frames wide) once
            graphs = await self.capture(max_batch, range(prompt_tokens + 1, prompt_tokens + GRAPH_TARGET_TOKENS + 1, 16),
                                        chunk_mel_frames(self.config))
        self.warmed[prompt_tokens] = done
        log.info("warmed speaker %r (%d prompt tokens) at 1..%d streams in %.1f s (%d CUDA graphs captured)",
                 speaker_id, prompt_tokens, max_batch, time.monotonic() - t, graphs)
