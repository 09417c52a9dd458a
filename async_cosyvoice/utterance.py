"""Utterance: one text segment, from its LM request to its last audio chunk.

It owns everything of that segment: the engine's token stream, the speech tokens (appended into
its Token2WavStream's buffer as the engine yields them), the token2wav stream itself (prompt on
the device, hop schedule, HiFT caches), the adaptive-hop decision and a `Timeline`. A request's
segments run one after another and share a `Playback`: the request's output position (chunk
index, samples sent, when the listener runs out of audio).

Thread use: an Utterance and its Playback live on the event loop. The token2wav device thread
touches only the Token2WavStream, and only while that stream's one job is in flight.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import AsyncIterator, Protocol

import numpy as np
from torch import Tensor

from .request import AudioChunk, Timeline
from .token2wav import Token2WavJob, Token2WavStream


class Token2WavSink(Protocol):
    """A token2wav batcher (or one device's worker of a pool). `stream_started` / `stream_ended`
    bracket each segment's stream (`Utterance.run`): the streams open on a device, which a pool's
    `pick` balances."""
    async def submit(self, job: Token2WavJob, deadline: float) -> Tensor: ...

    def stream_started(self, stream: Token2WavStream) -> None: ...

    def stream_ended(self, stream: Token2WavStream) -> None: ...


@dataclass
class Playback:
    """A request's output so far, shared by its segments in order."""
    started: float
    sample_rate: int
    first_chunk_at: float | None = None
    index: int = 0    # chunks emitted
    samples: int = 0  # samples emitted
    tokens: int = 0   # speech tokens of the finished segments

    def deadline(self) -> float:
        """When the listener runs out of the audio sent so far (now, before the first chunk)."""
        if self.first_chunk_at is None:
            return time.monotonic()
        return self.first_chunk_at + self.samples / self.sample_rate

    def lead(self, now: float) -> float:
        """Seconds of audio sent and not yet played."""
        return self.deadline() - now if self.first_chunk_at is not None else 0.0

    def emitted(self, now: float, n_samples: int) -> None:
        if self.first_chunk_at is None:
            self.first_chunk_at = now
        self.index += 1
        self.samples += n_samples

    def empty_final_chunk(self) -> AudioChunk:
        """The final chunk of a request whose end was known only after its last audio (text streams)."""
        return AudioChunk(samples=np.zeros(0, np.float32), sample_rate=self.sample_rate, index=self.index,
                          is_final=True, sample_offset=self.samples, n_tokens=self.tokens,
                          elapsed_s=time.monotonic() - self.started)


class Utterance:
    def __init__(self, segment: int, t2w: Token2WavStream, batcher: Token2WavSink, playback: Playback, *,
                 last: bool, adaptive: bool, speech: AsyncIterator[list[int]] | None = None, source_tokens=None):
        """batcher: where this segment's token2wav jobs run (its stream's caches live on that
        device). speech: the engine's token batches for this segment (None: `source_tokens` are
        given, VC). last: this is the request's last segment, so its last chunk is final."""
        self.segment = segment
        self.t2w = t2w
        self.batcher = batcher
        self.playback = playback
        self.last = last
        self.adaptive = adaptive
        self.speech = speech
        self.source_tokens = source_tokens
        self.timeline = Timeline(submitted=time.monotonic())

    async def run(self) -> AsyncIterator[AudioChunk]:
        """Chunks as they are rendered. Closing this iterator closes the engine's token stream
        (aborting the LM request) and drops this segment's pending token2wav job. The sink counts
        the stream as open from the first step of this iterator until it is closed or done."""
        self.batcher.stream_started(self.t2w)
        try:
            if self.speech is not None:
                async with contextlib.aclosing(self.speech) as speech:
                    async for batch in speech:
                        if not self.timeline.first_token:
                            self.timeline.first_token = time.monotonic()
                        self.t2w.append(batch)
                        async for chunk in self._render(llm_done=False):
                            yield chunk
            else:
                self.t2w.append(self.source_tokens)
            async for chunk in self._render(llm_done=True):
                yield chunk
        finally:
            self.batcher.stream_ended(self.t2w)

    async def _render(self, llm_done: bool) -> AsyncIterator[AudioChunk]:
        t2w, playback, timeline = self.t2w, self.playback, self.timeline
        while (job := t2w.next_job(llm_done)) is not None:
            timing = job.timing
            timing.queued = time.monotonic()
            samples = await self.batcher.submit(job, playback.deadline())
            now = timing.done = time.monotonic()
            timing.n_samples = len(samples)
            timeline.chunks.append(timing)
            final = self.last and t2w.finished
            chunk = AudioChunk(samples=samples.numpy(), sample_rate=playback.sample_rate, index=playback.index,
                               is_final=final, sample_offset=playback.samples, segment_index=self.segment,
                               n_tokens=playback.tokens + t2w.n_tokens if final else job.hop,
                               elapsed_s=now - playback.started,
                               segment_tokens=tuple(t2w.tokens.tolist()) if t2w.finished else (),
                               timeline=timeline if t2w.finished else None)
            playback.emitted(now, len(samples))
            if t2w.finished:
                timeline.finished, timeline.n_tokens = now, t2w.n_tokens
                playback.tokens += t2w.n_tokens
            elif self.adaptive:
                t2w.after_chunk(lead_s=playback.lead(now), chunk_s=now - timing.queued,
                                token_s=(now - timeline.submitted) / max(t2w.n_tokens, 1))
            yield chunk
