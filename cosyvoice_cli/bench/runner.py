"""The closed loop: one request timed chunk by chunk, a level of C workers, the warm-up round and
the sweep over levels."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import time
from typing import Mapping, Sequence

from .metrics import RequestResult, summarize_level
from .progress import Progress
from .stages import StageCounters, stage_delta
from .targets import Target
from .workload import Workload, requests_per_level


async def run_request(target: Target, workload: Workload, index: int, level_start: float) -> RequestResult:
    seed = workload.seed + index
    t_send = time.monotonic()
    result = RequestResult(index=index, seed=seed, start_s=t_send - level_start, total_s=0.0)
    try:
        async with contextlib.aclosing(target.stream(workload, seed)) as chunks:
            async for seconds in chunks:
                now = time.monotonic()
                if seconds > 0:  # an empty chunk (end marker) carries nothing to play
                    result.arrivals_s.append(now - t_send)
                    result.chunk_audio_s.append(seconds)
    except asyncio.CancelledError:
        raise
    except Exception as e:  # counted per request; the level goes on
        result.error = f"{type(e).__name__}: {e}"
    result.total_s = time.monotonic() - t_send
    if result.error is None and not result.arrivals_s:
        result.error = "no audio"
    return result


async def run_level(target: Target, workload: Workload, concurrency: int, requests: int, *,
                    progress: Progress | None = None, max_seconds: float | None = None,
                    stages: StageCounters | None = None, label: str | None = None,
                    detail: bool = True) -> dict:
    """Closed loop: `concurrency` workers send requests 0..max(requests, concurrency)-1 one after
    another; after `max_seconds` no new request is sent. Returns `summarize_level`'s dict, with
    the stages' busy counters over the level when `stages` is given."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    n = max(requests, concurrency)
    indices = iter(range(n))
    results: list[RequestResult] = []
    if progress:
        progress.start(label or f"concurrency {concurrency}", n)
    before = await stages.read() if stages else None
    t0 = time.monotonic()
    stop_at = t0 + max_seconds if max_seconds else math.inf

    async def worker():
        for i in indices:  # shared by all workers: each takes the next request
            if time.monotonic() >= stop_at:
                break
            r = await run_request(target, workload, i, t0)
            results.append(r)
            if progress:
                progress.update(r)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.monotonic() - t0
    busy = stage_delta(before, await stages.read(), wall) if stages else None
    results.sort(key=lambda r: r.index)
    level = summarize_level(concurrency, results, wall, stream=workload.stream, stages=busy, detail=detail)
    if len(results) < n:
        level["stopped_early"] = {"planned": n, "sent": len(results), "after_s": max_seconds}
    if progress:
        progress.end(_level_brief(level))
    return level


def _level_brief(level: dict) -> str:
    rtf = level["rtf"]
    ur = level["underruns"]
    return (f"RTF {rtf:.3f}" if rtf is not None else "RTF -") + \
        f"  underruns {ur['late_chunks']} ({ur['requests_with_underruns']} req)"


async def warm_up(target: Target, workload: Workload, levels: Sequence[int], progress: Progress | None = None,
                  max_tokens: int | None = 60) -> float:
    """One untimed round of short requests (at most `max_tokens` forced tokens; None: the
    workload's) at each of `levels` concurrent streams, so the batch shapes the sweep meets have
    run once: a server runs a shape it has no CUDA graph for without one and captures the graph in
    a capture thread beside its batches (a server bench waits for those captures before it times
    anything), and a speaker registered while serving is warmed at a few stream counts only.
    Returns the wall time."""
    tokens = workload.tokens if max_tokens is None or not workload.tokens else min(workload.tokens, max_tokens)
    short = dataclasses.replace(workload, tokens=tokens)
    t = time.monotonic()
    for concurrency in sorted(set(levels)):
        await run_level(target, short, concurrency, concurrency, progress=progress, label=f"warm-up x{concurrency}",
                        detail=False)
    return time.monotonic() - t


async def run_sweep(target: Target, workload: Workload, levels: Sequence[int],
                    requests: int | Sequence[int] | Mapping[int, int], *, progress: Progress | None = None,
                    max_level_seconds: float | None = None, stages: StageCounters | None = None,
                    detail: bool = True) -> list[dict]:
    counts = requests_per_level(levels, requests)
    out = []
    for c in levels:
        out.append(await run_level(target, workload, c, counts[c], progress=progress, max_seconds=max_level_seconds,
                                   stages=stages, detail=detail))
    return out
