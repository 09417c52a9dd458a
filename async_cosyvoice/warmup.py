"""Warm-up: run what serving will run before health turns SERVING, so no user pays for a compile
or a CUDA-graph capture.

Captured work is keyed by shape: the LLM's decode graphs by batch size (captured by the engine's
start), the flow's and HiFT's graphs by (streams, length) bucket (token2wav/flow_graphs.py,
hift_graphs.py). A recomputing flow call renders a stream's prompt plus every token so far, so its
bucket depends on the prompt's length and how far the utterance has got; a HiFT call's frames
depend only on the chunk's hop. So the warm-up
1. where shapes are captured (`Warmup.coverage`), captures a fixed set of graphs derived from the
   config alone (`capture_plan`), the same at every start whichever speakers exist: at 1 stream,
   the flow graph of every token bucket up to `warmup.capture_prompt_tokens` +
   `warmup.capture_speech_tokens` (every chunk of a request whose
   prompt and speech are at most that long) and HiFT's of every streaming chunk's mel length; at
   2, 4, … up to `warmup.capture_streams` streams (default 1: none), the flow graphs of the first
   chunks of such prompts and HiFT's chunks; and at 2, 4, … up to `warmup.cover_streams` (8) streams
   the buckets of the longest call and of half of it, first: until a call's own bucket is captured
   it runs in the smallest of these that covers it at little extra work
   (graph_buckets.GraphBuckets.cover) instead of without a graph. CosyVoice3's causal vocoder re-vocodes all the mel so
   far: its HiFT graphs at 1 stream are every frame bucket up to the speech tokens' mel, at more
   streams a first chunk's. Rarer buckets (more streams, longer utterances) are not captured on
   the request that first meets them: that call runs padded without a graph and the bucket is
   captured later, one graph at a time, by the token2wav stage's capture thread beside its batches
   (graph_buckets.py, token2wav/batcher.py). Captured on first use, a compiled flow graph cost
   the listener ~2 s: the first time two or three streams overlapped at a new length. With
   `warmup.capture_before_serving: covering` (the default) only the shortest and the longest of
   the set's first-chunk buckets are captured here (the longest covers every first chunk, padded,
   until its own graph is captured), with `first_chunks` every first-chunk bucket; the rest is
   left to that thread, after SERVING (`Warmup.run`);
2. runs short streamed syntheses through every stage (`Warmup.requests`): where shapes are
   captured, two zero-shot ones, with a prompt as long as the capture set covers
   (`capture_prompt_tokens`, 10 s) and with half of it, so that the LM has prefilled a long and a
   mid-length prompt and replayed the decode graphs that users' first chunks use before a user
   comes: the LM's decode graphs are per attention-length bucket (256, 512, ... positions); the
   5-s request's first chunk decodes in the 256 one, the 10-s request's in the 512 one, the two
   buckets that the first chunk of any prompt of up to 10 s with a sentence or two of text reaches
   (with the 10-s request alone, a 6-s speaker's first request was the first to prefill that short
   a prompt and to replay the 256 graph); else one cross-lingual request with a 1-s prompt; then
   captures what those requests met beyond the plan (they ran it without a graph), or with
   `first_chunks` leaves it, with the rest of the plan, to the capture thread;
3. collects and freezes the heap (`settle_heap`, after the speakers' flow prefixes): a start leaves
   hundreds of thousands of objects (on the CPU box 356 k eager, 501 k with the estimator compiled;
   a full collection of them took 0.2-0.3 s there), and every full collection after it, a stop of
   all threads for as long as it scans them, could fall into a request; frozen, they are never
   scanned again.
What is compiled is kept across restarts by compile_cache.py (`use_compile_cache`, re-exported here).
"""
from __future__ import annotations

import gc
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, AsyncIterator, Awaitable, Callable

import numpy as np

from .compile_cache import compile_cache_dir, compile_in_use, use_compile_cache  # noqa: F401 (re-exported)
from .gc_pauses import unwatch_gc_pauses, watch_gc_pauses
from .graph_buckets import CapturePlan, batch_sizes
from .request import Audio, AudioChunk, Mode, SynthesisOptions, SynthesisRequest
from .token2wav import ChunkSchedule

if TYPE_CHECKING:
    from .config import Config

log = logging.getLogger(__name__)

WARM_TEXT = "Warm up."
WARM_PROMPT_TEXT = "A steady tone, held for a while, to warm the server up before it serves."
SPEECH_TOKENS_PER_SECOND = 25  # CosyVoice2 and 3's speech tokenizers


def chunk_mel_frames(config: Config) -> range:
    """Mel frame counts of HiFT's streaming calls, in steps of 16: up to the cached frames plus a
    final chunk's (the longest hop and its look-ahead)."""
    t2w = config.token2wav
    s = ChunkSchedule(first_hop=t2w.first_hop, max_hop_multiple=t2w.max_hop_multiple)
    longest = s.mel_cache_len + s.token_mel_ratio * (max(s.max_hop, 2 * s.first_hop) + s.pre_lookahead)
    return range(16, longest + 16, 16)


def capture_plan(config: Config, before_serving: bool = False) -> CapturePlan:
    """The fixed capture set of this config (see the module docstring); steps of 16 tokens / frames
    reach every bucket (the flow's are >= 32 tokens wide, HiFT's >= 16 frames). `before_serving`:
    the part of it that `warmup.capture_before_serving` captures before SERVING: `first_chunks`,
    the buckets of first chunks (and HiFT's chunks); `covering`, of those only the shortest and
    the longest at each stream count (the longest covers every other first chunk by padding until
    its own graph is captured: GraphBuckets.cover; the shortest keeps the length extremes that
    compile_shapes runs); `all`, the whole set."""
    w, t2w = config.warmup, config.token2wav
    part = w.capture_before_serving if before_serving else "all"
    s = ChunkSchedule(first_hop=t2w.first_hop, max_hop_multiple=t2w.max_hop_multiple)
    frames = chunk_mel_frames(config)
    whole = range(16, w.capture_prompt_tokens + w.capture_speech_tokens + 16, 16)
    # CosyVoice3's causal vocoder re-vocodes the whole target mel so far (and its look-ahead)
    causal = range(16, s.token_mel_ratio * (w.capture_speech_tokens + s.pre_lookahead) + 16, 16)
    # a first chunk: the prompt, a first hop padded to align prompt + hop (< 2 first hops), the look-ahead
    first = range(16, w.capture_prompt_tokens + 2 * s.first_hop + s.pre_lookahead + 16, 16)
    first_causal = range(16, s.token_mel_ratio * (2 * s.first_hop + s.pre_lookahead) + 16, 16)
    more = tuple(batch_sizes(w.capture_streams)[1:])
    if part != "all":
        def ends(lengths: Sequence[int]) -> Sequence[int]:
            return (lengths[0], lengths[-1]) if part == "covering" else lengths
        streams = (1, *more)
        return CapturePlan(((streams, ends(first)),), ((streams, ends(frames)),), ((streams, ends(first_causal)),))
    flow, hift, causal_hift = [((1,), whole)], [((1,), frames)], [((1,), causal)]
    if more:
        flow.append((more, first))
        hift.append((more, frames))
        causal_hift.append((more, first_causal))
    return CapturePlan(tuple(flow), tuple(hift), tuple(causal_hift), covers=tuple(batch_sizes(w.cover_streams)[1:]))


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
    """The warm-up of one Synthesizer (`synthesize(request)` is all it uses of it)."""
    config: Config
    sample_rate: int
    max_tokens: int                     # speech tokens of the warm-up request (its first and final chunks)
    # (plan, defer=, and_wanted=) -> graphs captured: the token2wav stage's capture_graphs
    capture: Callable[..., Awaitable[int]] | None = None
    captured: int | None = None         # graphs the last run captured (None: no capture ran)

    @property
    def coverage(self) -> bool:
        c = self.config.warmup.coverage
        return compile_in_use(self.config) if c is None else c

    @property
    def plan(self) -> CapturePlan:
        return capture_plan(self.config)

    def requests(self) -> list[SynthesisRequest]:
        """The warm-up requests. Where shapes are captured, zero-shot ones with half of and with a
        prompt as long as the capture set covers (`capture_prompt_tokens`): the LM's prefill lengths
        and decode graphs that such prompts reach run (the module docstring), and the allocator
        meets the longest common prompt, before a user's request; else one cross-lingual request
        with a 1-s prompt."""
        options = SynthesisOptions(stream=True, seed=0, max_tokens=self.max_tokens)
        if not self.coverage:
            return [SynthesisRequest(Mode.CROSS_LINGUAL, text=WARM_TEXT, prompt_audio=sine_prompt(self.sample_rate),
                                     options=options)]
        longest = self.config.warmup.capture_prompt_tokens / SPEECH_TOKENS_PER_SECOND
        return [SynthesisRequest(Mode.ZERO_SHOT, text=WARM_TEXT, prompt_text=WARM_PROMPT_TEXT,
                                 prompt_audio=sine_prompt(self.sample_rate, seconds), options=options)
                for seconds in sorted({min(longest, max(1.0, longest / 2)), longest})]

    @property
    def defers(self) -> bool:
        """Whether part of the plan is left to the capture thread, after SERVING."""
        return self.config.warmup.capture_before_serving != "all"

    async def run(self, synthesize) -> None:
        t = time.monotonic()
        if self.coverage and self.capture is not None:
            self.captured = await self.capture(capture_plan(self.config, before_serving=True))
            log.info("warm-up captured %d planned CUDA graph(s) in %.1f s (%s at 1..%d streams; prompt <= %d + "
                     "speech <= %d tokens at 1 stream)", self.captured, time.monotonic() - t,
                     {"first_chunks": "first chunks", "covering": "the shortest and longest first chunks",
                      "all": "all chunks"}[self.config.warmup.capture_before_serving], self.plan.max_streams,
                     self.config.warmup.capture_prompt_tokens, self.config.warmup.capture_speech_tokens)
        for request in self.requests():
            await drain(synthesize(request))
        if self.captured is not None:
            # the plan's other buckets and those of the requests it did not hold (they ran without a graph
            # and are wanted): with `capture_before_serving: first_chunks` or `covering` left to the capture thread, which
            # captures them beside the first requests after SERVING; with `all` captured now
            if self.defers:
                await self.capture(self.plan, defer=True)
            else:
                self.captured += await self.capture(self.plan, and_wanted=True)
        log.info("warm-up done in %.1f s", time.monotonic() - t)


def settle_heap() -> int:
    """A full garbage collection now, then everything alive frozen (`gc.freeze`): later collections
    never scan the start's objects (modules, compiled programs, graphs), and the full collection
    that the start's allocations made due runs here, not in the first request. Returns how many
    objects were frozen. Objects of the start that later become cyclic garbage are not freed: the
    start's objects live as long as the process. From here on, long full collections are logged
    (gc_pauses.py)."""
    t = time.monotonic()
    watch_gc_pauses()
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info("heap settled: a full collection, then %d objects frozen, in %.2f s", frozen, time.monotonic() - t)
    return frozen


def release_heap() -> None:
    """Undo `settle_heap` (a synthesizer's close): the frozen objects are collectable again, so the
    interpreter's last collection frees them (else native extensions, Triton's, report them leaked
    at exit); that collection and the others of the shutdown are not logged as pauses."""
    unwatch_gc_pauses()
    gc.unfreeze()
