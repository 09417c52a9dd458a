"""Whole benchmark runs, in-process or against a server over gRPC: register the speaker, warm up,
the closed-loop sweep, the open-loop levels and the capacity search, and (in-process) token2wav
batched vs one at a time. Returns the results dict the CLI writes."""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping, Sequence

from ..options import DEFAULT_WAIT_SECONDS
from .open_loop import MIN_REQUESTS, CapacityCriteria, capacity_search, run_open_loop
from .progress import Progress
from .report import environment
from .runner import run_sweep, warm_up
from .stages import PrometheusStages, StageCounters, SynthesizerStages
from .t2w_compare import token2wav_compare
from .targets import GrpcTarget, InProcessTarget, Target, register_grpc, register_in_process
from .workload import SpeakerSpec, Workload

if TYPE_CHECKING:
    from async_cosyvoice.config import Config

DEFAULT_WARMUP_CONCURRENCY = 4  # when no closed-loop level says how many streams to warm up with


@dataclass(frozen=True)
class OpenLoopPlan:
    """Open-loop levels at `rates` (requests/s) for `duration_s` each and at least `min_requests`
    requests, and/or a capacity search of such trials starting at `start_rate` (see open_loop.py)."""
    rates: tuple[float, ...] = ()
    duration_s: float = 30.0
    min_requests: int = MIN_REQUESTS
    capacity: bool = False
    start_rate: float = 0.5
    max_rate: float = float("inf")
    refine: int = 2
    criteria: CapacityCriteria = CapacityCriteria()
    drain_timeout_s: float = 120.0

    def __post_init__(self):
        if any(not r > 0 for r in self.rates) or not self.start_rate > 0:
            raise ValueError(f"open-loop rates must be > 0, got {list(self.rates) or self.start_rate}")
        if not self.duration_s > 0:
            raise ValueError(f"open-loop duration must be > 0, got {self.duration_s}")
        if self.min_requests < 0:
            raise ValueError(f"open-loop min_requests must be >= 0, got {self.min_requests}")

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["criteria"] = self.criteria.to_json()
        d["max_rate"] = None if self.max_rate == float("inf") else self.max_rate
        return d


async def bench_in_process(config: "Config", workload: Workload, levels: Sequence[int],
                           requests: int | Sequence[int] | Mapping[int, int], *, speaker: SpeakerSpec = SpeakerSpec(),
                           t2w_compare: int | None = None, t2w_tokens: int | None = None, warmup: bool = True,
                           max_level_seconds: float | None = None, progress: Progress | None = None,
                           detail: bool = True, open_loop: OpenLoopPlan | None = None) -> dict:
    """Build a Synthesizer from `config`, register the speaker, sweep (closed and/or open loop),
    and optionally compare token2wav batched vs sequential. Returns the results dict."""
    from async_cosyvoice.tts import Synthesizer

    progress = progress or Progress(enabled=False)
    t = time.monotonic()
    synth = await Synthesizer.create(config, warmup=warmup)
    load_s = time.monotonic() - t
    progress.note(f"synthesizer ready in {load_s:.1f} s ({config.model.device})")
    try:
        prompt_tokens = await register_in_process(synth, speaker)
        workload = dataclasses.replace(workload, speaker_id=speaker.speaker_id)
        target = InProcessTarget(synth)
        results = _header("in-process", workload, levels, speaker, config, open_loop)
        results["meta"].update(load_s=load_s, prompt_tokens=prompt_tokens)
        await _run_levels(results, target, workload, levels, requests, warmup=warmup, progress=progress,
                          max_level_seconds=max_level_seconds, stages=SynthesizerStages(synth), detail=detail,
                          open_loop=open_loop)
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
                     detail: bool = True, metrics_url: str | None = None,
                     open_loop: OpenLoopPlan | None = None, wait_s: float = DEFAULT_WAIT_SECONDS) -> dict:
    """The sweep (closed and/or open loop) against a server (once it reports SERVING, within
    `wait_s` seconds); with `metrics_url` (its Prometheus endpoint) each level also reports the
    server's stage busy counters."""
    from grpc_async.client import CosyVoiceClient

    progress = progress or Progress(enabled=False)
    async with CosyVoiceClient(target_addr, token=token) as client:
        await client.wait_ready(timeout=wait_s)
        prompt_seconds = await register_grpc(client, speaker)
        workload = dataclasses.replace(workload, speaker_id=speaker.speaker_id)
        target = GrpcTarget(client)
        results = _header("grpc", workload, levels, speaker, None, open_loop)
        results["meta"].update(target=target_addr, prompt_seconds=prompt_seconds, metrics_url=metrics_url)
        await _run_levels(results, target, workload, levels, requests, warmup=warmup, progress=progress,
                          max_level_seconds=max_level_seconds, detail=detail, open_loop=open_loop,
                          stages=PrometheusStages(metrics_url) if metrics_url else None)
        return results


async def _run_levels(results: dict, target: Target, workload: Workload, levels: Sequence[int], requests, *,
                      warmup: bool, progress: Progress, max_level_seconds: float | None,
                      stages: StageCounters | None = None, detail: bool = True,
                      open_loop: OpenLoopPlan | None = None) -> None:
    """The part every target shares: an untimed round at each closed-loop level, the
    closed-loop sweep, then the open-loop levels and the capacity search."""
    if warmup:
        results["meta"]["warmup_s"] = await warm_up(target, workload, levels or [DEFAULT_WARMUP_CONCURRENCY], progress)
    results["levels"] = await run_sweep(target, workload, levels, requests, progress=progress,
                                        max_level_seconds=max_level_seconds, stages=stages, detail=detail)
    if open_loop is None:
        return
    common = dict(min_requests=open_loop.min_requests, progress=progress, stages=stages,
                  drain_timeout_s=open_loop.drain_timeout_s)
    results["open_loop"] = [await run_open_loop(target, workload, rate, open_loop.duration_s, detail=detail, **common)
                            for rate in open_loop.rates]
    if open_loop.capacity:
        results["capacity"] = await capacity_search(
            target, workload, start_rate=open_loop.start_rate, duration_s=open_loop.duration_s,
            max_rate=open_loop.max_rate, refine=open_loop.refine, criteria=open_loop.criteria, **common)


def _header(mode: str, workload: Workload, levels: Sequence[int], speaker: SpeakerSpec,
            config: "Config | None", open_loop: OpenLoopPlan | None) -> dict:
    meta = {"mode": mode, "levels": list(levels), "workload": workload.to_json(),
            "speaker": {"speaker_id": speaker.speaker_id, "registered": speaker.register,
                        "prompt_wav": str(speaker.prompt_wav) if speaker.prompt_wav else None,
                        "prompt_seconds": None if speaker.prompt_wav else speaker.prompt_seconds},
            "environment": environment(config.model.device if config else None),
            "open_loop": open_loop.to_json() if open_loop else None}
    if config is not None:
        meta["config"] = config.model_dump(mode="json")
    return {"title": "async_cosyvoice", "meta": meta}
