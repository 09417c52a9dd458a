"""A non-streaming request's text segments, all at once.

The streaming dispatch runs a request's segments one after another: segment 2's LM request
starts when segment 1's audio is out, because a listener is waiting for segment 1. A
non-streaming request has no listener in between, so its segments run concurrently, at most
`ahead` at a time: their LM requests join the engine's batch together and their token2wav jobs
reach the offline collector together, where they batch with each other and with other requests.
The chunks still come out in segment order and are numbered exactly as the sequential dispatch
numbers them (index, sample offset, the final chunk's token total, the request's playback).
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from typing import AsyncIterator, Callable

from .request import AudioChunk
from .utterance import Playback, Utterance

# make(segment index, the segment's own Playback) -> its Utterance (last=True for the last segment)
UtteranceFactory = Callable[[int, Playback], Utterance]


async def segments_at_once(make: UtteranceFactory, n_segments: int, playback: Playback,
                           ahead: int) -> AsyncIterator[AudioChunk]:
    """The chunks of segments 0..n_segments-1 in order, with up to `ahead` segments running at once.
    Closing this iterator cancels the running segments (aborting their LM requests and dropping
    their pending token2wav jobs)."""
    if ahead < 1:
        raise ValueError(f"ahead must be >= 1, got {ahead}")

    async def render(i: int) -> list[AudioChunk]:
        utterance = make(i, Playback(playback.started, playback.sample_rate))
        async with contextlib.aclosing(utterance.run()) as chunks:
            return [c async for c in chunks]

    running: dict[int, asyncio.Task] = {}
    try:
        for i in range(n_segments):
            for j in range(i, min(n_segments, i + ahead)):
                if j not in running:
                    running[j] = asyncio.ensure_future(render(j))
            for chunk in await running.pop(i):
                yield _in_request_order(chunk, playback)
    finally:
        for task in running.values():
            task.cancel()
        await asyncio.gather(*running.values(), return_exceptions=True)


def _in_request_order(chunk: AudioChunk, playback: Playback) -> AudioChunk:
    """A segment's chunk (numbered within its segment) renumbered within the request."""
    now = time.monotonic()
    out = dataclasses.replace(chunk, index=playback.index, sample_offset=playback.samples,
                              n_tokens=playback.tokens + chunk.n_tokens if chunk.is_final else chunk.n_tokens,
                              elapsed_s=now - playback.started)
    playback.emitted(now, len(chunk.samples))
    playback.tokens += len(chunk.segment_tokens)
    return out
