"""The closed loop: one request timed chunk by chunk, a level of C workers, the warm-up round, the
sweep over levels, and whole runs in-process or over gRPC."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import time
from typing import TYPE_CHECKING, Mapping, Sequence

from .metrics import RequestResult, summarize_level
from .progress import Progress
from .report import environment
from .stages import PrometheusStages, StageCounters, SynthesizerStages, stage_delta
from .t2w_compare import token2wav_compare
from .targets import GrpcTarget, InProcessTarget, Target, register_grpc, register_in_process
from .workload import SpeakerSpec, Workload, requests_per_level

if TYPE_CHECKING:
    from ..config import Config


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


async def warm_up(target: Target, workload: Workload, concurrency: int, progress: Progress | None = None) -> float:
    """One untimed round at `concurrency` with short requests (so every batch shape the sweep
    meets has run once). Returns its wall time."""
    short = dataclasses.replace(workload, tokens=min(workload.tokens, 60) if workload.tokens else None)
    t = time.monotonic()
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


async def bench_in_process(config: "Config", workload: Workload, levels: Sequence[int],
                           requests: int | Sequence[int] | Mapping[int, int], *, speaker: SpeakerSpec = SpeakerSpec(),
                           t2w_compare: int | None = None, t2w_tokens: int | None = None, warmup: bool = True,
                           max_level_seconds: float | None = None, progress: Progress | None = None,
                           detail: bool = True) -> dict:
    """Build a Synthesizer from `config`, register the speaker, sweep, and optionally compare
    token2wav batched vs sequential. Returns the results dict."""
    from ..tts import Synthesizer

    progress = progress or Progress(enabled=False)
    t = time.monotonic()
    synth = await Synthesizer.create(config, warmup=warmup)
    load_s = time.monotonic() - t
    progress.note(f"synthesizer ready in {load_s:.1f} s ({config.model.device})")
    try:
        prompt_tokens = await register_in_process(synth, speaker)
        workload = dataclasses.replace(workload, speaker_id=speaker.speaker_id)
        target = InProcessTarget(synth)
        results = _header("in-process", workload, levels, speaker, config)
        results["meta"].update(load_s=load_s, prompt_tokens=prompt_tokens)
        await _warm_and_sweep(results, target, workload, levels, requests, warmup=warmup, progress=progress,
                              max_level_seconds=max_level_seconds, stages=SynthesizerStages(synth), detail=detail)
        if t2w_compare:
            results["t2w_compare"] = await token2wav_compare(
                synth, t2w_compare, t2w_tokens or workload.tokens or 250, speaker.speaker_id, seed=workload.seed,
                first_hop=workload.first_hop, warmup=warmup, progress=progress)
        return results
    finally:
        await synth.close()


async def bench_grpc(target_addr: str, workload: Workload, levels: Sequence[int],
                     requests: int | Sequence[int] | Mapping[int, int], *, token: str | None = None,
                     speaker: SpeakerSpec = SpeakerSpec(), warmup: bool = True,
                     max_level_seconds: float | None = None, progress: Progress | None = None,
                     detail: bool = True, metrics_url: str | None = None) -> dict:
    """The sweep against a server; with `metrics_url` (its Prometheus endpoint) each level also
    reports the server's stage busy counters."""
    from grpc_async.client import CosyVoiceClient

    progress = progress or Progress(enabled=False)
    async with CosyVoiceClient(target_addr, token=token) as client:
        await client.wait_ready()
        prompt_seconds = await register_grpc(client, speaker)
        workload = dataclasses.replace(workload, speaker_id=speaker.speaker_id)
        target = GrpcTarget(client)
        results = _header("grpc", workload, levels, speaker, None)
        results["meta"].update(target=target_addr, prompt_seconds=prompt_seconds, metrics_url=metrics_url)
        await _warm_and_sweep(results, target, workload, levels, requests, warmup=warmup, progress=progress,
                              max_level_seconds=max_level_seconds, detail=detail,
                              stages=PrometheusStages(metrics_url) if metrics_url else None)
        return results


async def _warm_and_sweep(results: dict, target: Target, workload: Workload, levels: Sequence[int], requests, *,
                          warmup: bool, progress: Progress, max_level_seconds: float | None,
                          stages: StageCounters | None = None, detail: bool = True) -> None:
    """The part every target shares: an untimed round at the highest level, then the sweep."""
    if warmup and levels:
        results["meta"]["warmup_s"] = await warm_up(target, workload, max(levels), progress)
    results["levels"] = await run_sweep(target, workload, levels, requests, progress=progress,
                                        max_level_seconds=max_level_seconds, stages=stages, detail=detail)


def _header(mode: str, workload: Workload, levels: Sequence[int], speaker: SpeakerSpec,
            config: "Config | None") -> dict:
    meta = {"mode": mode, "levels": list(levels), "workload": workload.to_json(),
            "speaker": {"speaker_id": speaker.speaker_id, "registered": speaker.register,
                        "prompt_wav": str(speaker.prompt_wav) if speaker.prompt_wav else None,
                        "prompt_seconds": None if speaker.prompt_wav else speaker.prompt_seconds},
            "environment": environment(config.model.device if config else None)}
    if config is not None:
        meta["config"] = config.model_dump(mode="json")
    return {"title": "async_cosyvoice", "meta": meta}
