"""Benchmark client: a closed-loop concurrency sweep of streaming synthesis, in-process or over gRPC.

    async-cosyvoice bench --in-process --concurrency 1,2,4,8 --requests 8 --tokens 250 --out r.json
    async-cosyvoice bench --target 127.0.0.1:50051 --concurrency 1,4,16 --requests 32 --out r.json
    async-cosyvoice bench --in-process --t2w-compare 32 --tokens 250 --out r.json

Workload. Every request speaks the same text with a registered speaker (by default "bench",
registered first from a generated 6 s prompt wav, or from `--prompt-wav`), streaming, with seed
`--seed + i` for the i-th request of a level (so every level runs the same requests) and, with
`--tokens N`, exactly N speech tokens (EOS ignored until then): random-weight models give
reproducible workloads, N x 40 ms of audio per request.

Closed loop. At concurrency C, C workers each send a request, wait for its last chunk and send
the next, until the level's requests (at least C) are done; `--max-level-seconds` stops sending
new ones after that long.

Per request (times from sending the request):
- first chunk: until the first chunk with audio arrives;
- second chunk: between the first and the second chunk's arrival (the Triton client's metric);
- total: until the last chunk arrives;
- underruns: playback starts when the first chunk arrives and plays without pausing, so chunk
  k is due at first_arrival + (audio seconds in chunks 0..k-1); a chunk that arrives after
  its due time is an underrun. `stall_s` is the silence a listener hears, with a player that
  pauses while it has nothing to play: the largest lateness of any chunk;
- audio seconds and RTF (total / audio seconds).
Per level: avg/std/min/p50/p90/p95/p99/max of each latency and of the per-request RTF; the
aggregate RTF (level wall time / audio seconds of all requests), audio seconds per second, and
the underrun totals. In-process, also where the device time went: busy seconds and calls of the
LLM engine's steps and of the token2wav batches (`stages`).

`--t2w-compare C` (in-process only): the token2wav stage alone on fixed random token lists,
C streams at once on the streaming chunk schedule, no LLM: once through a batching
`Token2WavBatcher` and once one job at a time (`batching=False`), in the same run; reports both
throughputs (audio seconds per second) and their ratio.

Output: a JSON file (`--out`), PNG plots next to it (latency and throughput vs concurrency,
matplotlib with the Agg backend, skipped with a message when matplotlib is missing), a table on
stdout and a progress line on stderr.

Over gRPC, `--tokens` travels as `SynthesisOptions.max_tokens` (the server caps it with
`limits.max_forced_tokens`); a server without that field refuses `--tokens`.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import math
import os
import platform
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, AsyncIterator, Callable, Iterable, Mapping, Protocol, Sequence

import numpy as np

if TYPE_CHECKING:
    from .config import Config
    from .tts import Audio, Synthesizer

log = logging.getLogger(__name__)

SECONDS_PER_TOKEN = 0.04  # 25 speech tokens per second
DEFAULT_TEXT = ("The quick brown fox jumps over the lazy dog, and the morning train "
                "leaves the station on time.")
DEFAULT_PROMPT_TEXT = "This is a synthetic prompt recorded for the benchmark, nothing more."
DEFAULT_SPEAKER = "bench"
PERCENTILES = (50, 90, 95, 99)
_EPS = 1e-9


# ---------------------------------------------------------------------------------------------
# Metrics


def underruns(arrivals: Sequence[float], durations: Sequence[float]) -> tuple[int, float]:
    """(late chunks, stall seconds) for chunks arriving at `arrivals` (seconds, any origin)
    carrying `durations` seconds of audio each.

    Playback starts at the first arrival; chunk k is due at arrivals[0] + sum(durations[:k]) and
    is late if it arrives after that. The stall is the silence heard by a player that pauses when
    it runs dry: max over k of the lateness (0 when nothing is late)."""
    if len(arrivals) != len(durations):
        raise ValueError(f"{len(arrivals)} arrival times for {len(durations)} durations")
    late, stall, before = 0, 0.0, 0.0
    for k, (t, d) in enumerate(zip(arrivals, durations)):
        lateness = t - (arrivals[0] + before)
        if k > 0 and lateness > _EPS:
            late += 1
            stall = max(stall, lateness)
        before += d
    return late, stall


def summarize(values: Iterable[float | None]) -> dict:
    """n, avg, std, min, p50, p90, p95, p99, max of the values that are not None (None when empty)."""
    x = np.asarray([v for v in values if v is not None], dtype=np.float64)
    if x.size == 0:
        return {"n": 0, "avg": None, "std": None, "min": None,
                **{f"p{p}": None for p in PERCENTILES}, "max": None}
    return {"n": int(x.size), "avg": float(x.mean()), "std": float(x.std()), "min": float(x.min()),
            **{f"p{p}": float(np.percentile(x, p)) for p in PERCENTILES}, "max": float(x.max())}


@dataclass
class RequestResult:
    index: int
    seed: int
    start_s: float                     # when it was sent, seconds after the level started
    total_s: float
    arrivals_s: list[float] = field(default_factory=list)   # per chunk with audio, since sending
    chunk_audio_s: list[float] = field(default_factory=list)
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.arrivals_s)

    @property
    def first_chunk_s(self) -> float | None:
        return self.arrivals_s[0] if self.arrivals_s else None

    @property
    def second_chunk_s(self) -> float | None:
        return self.arrivals_s[1] - self.arrivals_s[0] if len(self.arrivals_s) > 1 else None

    @property
    def audio_s(self) -> float:
        return float(sum(self.chunk_audio_s))

    @property
    def underrun_stats(self) -> tuple[int, float]:
        return underruns(self.arrivals_s, self.chunk_audio_s)

    @property
    def rtf(self) -> float | None:
        return self.total_s / self.audio_s if self.audio_s > 0 else None

    def to_json(self) -> dict:
        late, stall = self.underrun_stats
        return {"index": self.index, "seed": self.seed, "ok": self.ok, "error": self.error,
                "start_s": _r(self.start_s), "first_chunk_s": _r(self.first_chunk_s),
                "second_chunk_s": _r(self.second_chunk_s), "total_s": _r(self.total_s),
                "audio_s": _r(self.audio_s), "rtf": _r(self.rtf), "chunks": len(self.arrivals_s),
                "underruns": late, "stall_s": _r(stall),
                "arrivals_s": [_r(t) for t in self.arrivals_s],
                "chunk_audio_s": [_r(d) for d in self.chunk_audio_s]}


def _r(x: float | None, nd: int = 6) -> float | None:
    return None if x is None else round(float(x), nd)


def summarize_level(concurrency: int, results: Sequence[RequestResult], wall_s: float, *, stream: bool = True,
                    stages: Mapping | None = None, detail: bool = True) -> dict:
    """The level's aggregate (see the module docstring) plus, with `detail`, every request."""
    ok = [r for r in results if r.ok]
    audio = sum(r.audio_s for r in ok)
    late = [r.underrun_stats for r in ok]
    out = {
        "concurrency": concurrency,
        "stream": stream,
        "requests": len(results),
        "ok": len(ok),
        "errors": len(results) - len(ok),
        "wall_s": wall_s,
        "audio_s": audio,
        "rtf": wall_s / audio if audio > 0 else None,
        "audio_s_per_s": audio / wall_s if wall_s > 0 else None,
        "first_chunk_s": summarize(r.first_chunk_s for r in ok),
        "second_chunk_s": summarize(r.second_chunk_s for r in ok),
        "total_s": summarize(r.total_s for r in ok),
        "rtf_per_request": summarize(r.rtf for r in ok),
        "audio_s_per_request": summarize(r.audio_s for r in ok),
        "chunks_per_request": summarize(len(r.arrivals_s) for r in ok),
        "underruns": {
            "late_chunks": int(sum(n for n, _ in late)),
            "requests_with_underruns": int(sum(1 for n, _ in late if n)),
            "stall_s": summarize(s for _, s in late),
        },
        "error_messages": sorted({r.error for r in results if r.error})[:10],
    }
    if stages is not None:
        out["stages"] = dict(stages)
    if detail:
        out["detail"] = [r.to_json() for r in results]
    return out


# ---------------------------------------------------------------------------------------------
# Workload and targets


@dataclass(frozen=True)
class Workload:
    text: str = DEFAULT_TEXT
    speaker_id: str = DEFAULT_SPEAKER
    tokens: int | None = None     # forced speech tokens per request (EOS ignored), None: model decides
    stream: bool = True
    seed: int = 0                 # request i of a level uses seed + i
    first_hop: int | None = None  # None: the synthesizer's default

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


class Target(Protocol):
    """Where requests go. `stream` yields the audio seconds of each chunk as it arrives."""
    name: str

    def stream(self, workload: Workload, seed: int) -> AsyncIterator[float]: ...


class InProcessTarget:
    """Requests straight into a Synthesizer in this process (same event loop)."""
    name = "in-process"

    def __init__(self, synth: "Synthesizer"):
        self.synth = synth

    async def stream(self, workload: Workload, seed: int) -> AsyncIterator[float]:
        from .tts import Mode, SynthesisOptions, SynthesisRequest

        opts = SynthesisOptions(stream=workload.stream, seed=seed, max_tokens=workload.tokens,
                                **({"first_hop": workload.first_hop} if workload.first_hop else {}))
        request = SynthesisRequest(Mode.ZERO_SHOT_BY_SPK_ID, text=workload.text, speaker_id=workload.speaker_id,
                                   options=opts)
        async with contextlib.aclosing(self.synth.synthesize(request)) as chunks:
            async for chunk in chunks:
                yield len(chunk.samples) / chunk.sample_rate


class GrpcTarget:
    """Requests over gRPC with `grpc_async.client.CosyVoiceClient` (pcm16 chunks)."""
    name = "grpc"

    def __init__(self, client):
        self.client = client

    @staticmethod
    def supports_forced_tokens() -> bool:
        from grpc_async.client import pb2
        return "max_tokens" in pb2.SynthesisOptions.DESCRIPTOR.fields_by_name

    async def stream(self, workload: Workload, seed: int) -> AsyncIterator[float]:
        if workload.first_hop:
            raise ValueError("first_hop is a server setting over gRPC (token2wav.first_hop)")
        request = self.client.synthesize_request(workload.text, speaker_id=workload.speaker_id,
                                                 stream=workload.stream, seed=seed, encoding="pcm16")
        if workload.tokens is not None:
            if not self.supports_forced_tokens():
                raise ValueError("this server's API has no forced token count (SynthesisOptions.max_tokens)")
            request.options.max_tokens = workload.tokens
        async for chunk in self.client.synthesize(request=request):
            yield chunk.num_samples / chunk.sample_rate if chunk.sample_rate else 0.0


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


# ---------------------------------------------------------------------------------------------
# Stage timing (in-process): busy seconds of the engine's steps and the token2wav batches


class StageTimer:
    """Wraps methods of model-facing objects (on the instance only) to add up their wall time.

    Each wrapped call runs in its stage's executor thread and ends by copying results to the
    CPU, so its wall time includes the device time. Stages share the device, so busy fractions
    of different stages may add up to more than 1."""

    def __init__(self):
        self.totals: dict[str, list[float]] = {}  # name -> [calls, seconds, items]
        self._restore: list[tuple[object, str]] = []

    def wrap(self, name: str, obj: object, method: str, items: Callable[..., int] | None = None) -> bool:
        fn = getattr(obj, method, None) if obj is not None else None
        if fn is None:
            return False
        acc = self.totals.setdefault(name, [0, 0.0, 0])

        # names the stage in a torch.profiler trace (next to nothing otherwise); torch is loaded
        # wherever there is a model to time
        record_function = sys.modules["torch"].profiler.record_function if "torch" in sys.modules \
            else contextlib.nullcontext

        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                with record_function(name):
                    return fn(*args, **kwargs)
            finally:
                acc[0] += 1
                acc[1] += time.perf_counter() - t
                if items is not None:
                    with contextlib.suppress(Exception):
                        acc[2] += int(items(*args, **kwargs))

        setattr(obj, method, timed)
        self._restore.append((obj, method))
        return True

    def snapshot(self) -> dict[str, tuple[int, float, int]]:
        return {k: (int(v[0]), float(v[1]), int(v[2])) for k, v in self.totals.items()}

    @staticmethod
    def delta(before: Mapping, after: Mapping, wall_s: float) -> dict:
        out = {}
        for name, (calls, secs, items) in after.items():
            c0, s0, i0 = before.get(name, (0, 0.0, 0))
            calls, secs, items = calls - c0, secs - s0, items - i0
            out[name] = {"calls": calls, "busy_s": secs, "busy_fraction": secs / wall_s if wall_s > 0 else None,
                         "ms_per_call": 1e3 * secs / calls if calls else None}
            if items:
                out[name]["items"] = items
                out[name]["items_per_call"] = items / calls if calls else None
        return out

    def close(self) -> None:
        for obj, method in reversed(self._restore):
            with contextlib.suppress(AttributeError):
                delattr(obj, method)
        self._restore.clear()


def time_synthesizer_stages(synth: "Synthesizer") -> StageTimer:
    """A StageTimer on the native engine's step and the token2wav runner (whatever exists)."""
    timer = StageTimer()
    if not timer.wrap("llm_step", getattr(synth.engine, "runner", None), "step"):
        log.info("stage timing: this engine has no runner.step; LLM busy time is not measured")
    t2w = getattr(synth.batcher, "runner", None)
    if not any(timer.wrap("token2wav_batch", t2w, name, items=lambda jobs, *a, **k: len(jobs))
               for name in ("run_many", "run_batch")):
        log.info("stage timing: the token2wav runner has no run_many; its busy time is not measured")
    return timer


# ---------------------------------------------------------------------------------------------
# Progress on stderr


class Progress:
    """One live line per level on a terminal (`\\r`), one line per finished level otherwise."""

    def __init__(self, stream=None, enabled: bool = True):
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.live = enabled and hasattr(self.stream, "isatty") and self.stream.isatty()
        self._label, self._total, self._done, self._errors, self._first = "", 0, 0, 0, []
        self._t0 = 0.0
        self._last_draw = 0.0

    def start(self, label: str, total: int) -> None:
        self._label, self._total, self._done, self._errors, self._first = label, total, 0, 0, []
        self._t0 = time.monotonic()
        self._draw(force=True)

    def update(self, result: RequestResult) -> None:
        self._done += 1
        self._errors += 0 if result.ok else 1
        if result.first_chunk_s is not None:
            self._first.append(result.first_chunk_s)
        self._draw()

    def _line(self) -> str:
        first = f"  first p50 {1e3 * float(np.median(self._first)):7.1f} ms" if self._first else ""
        errors = f"  errors {self._errors}" if self._errors else ""
        return (f"[bench] {self._label}: {self._done}/{self._total} requests{first}{errors}  "
                f"{time.monotonic() - self._t0:6.1f} s")

    def _draw(self, force: bool = False) -> None:
        now = time.monotonic()
        if not self.live or (not force and now - self._last_draw < 0.1 and self._done < self._total):
            return
        self._last_draw = now
        self.stream.write("\r\033[K" + self._line())
        self.stream.flush()

    def end(self, summary: str = "") -> None:
        if not self.enabled:
            return
        line = self._line() + (f"  {summary}" if summary else "")
        self.stream.write(("\r\033[K" if self.live else "") + line + "\n")
        self.stream.flush()

    def note(self, message: str) -> None:
        if self.enabled:
            self.stream.write(f"[bench] {message}\n")
            self.stream.flush()


# ---------------------------------------------------------------------------------------------
# Levels and sweeps


async def run_level(target: Target, workload: Workload, concurrency: int, requests: int, *,
                    progress: Progress | None = None, max_seconds: float | None = None,
                    stage_timer: StageTimer | None = None, label: str | None = None,
                    detail: bool = True) -> dict:
    """Closed loop: `concurrency` workers send requests 0..max(requests, concurrency)-1 one after
    another; after `max_seconds` no new request is sent. Returns `summarize_level`'s dict."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    n = max(requests, concurrency)
    indices = iter(range(n))
    results: list[RequestResult] = []
    if progress:
        progress.start(label or f"concurrency {concurrency}", n)
    before = stage_timer.snapshot() if stage_timer else None
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
    stages = StageTimer.delta(before, stage_timer.snapshot(), wall) if stage_timer else None
    results.sort(key=lambda r: r.index)
    level = summarize_level(concurrency, results, wall, stream=workload.stream, stages=stages, detail=detail)
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


def requests_per_level(levels: Sequence[int], requests: int | Sequence[int] | Mapping[int, int]) -> dict[int, int]:
    """An int (the same for every level), a list matching `levels`, or a mapping level -> count;
    a level always gets at least `concurrency` requests."""
    if isinstance(requests, int):
        counts = {c: requests for c in levels}
    elif isinstance(requests, Mapping):
        counts = {c: int(requests[c]) for c in levels}
    else:
        requests = list(requests)
        if len(requests) != len(levels):
            raise ValueError(f"{len(requests)} request counts for {len(levels)} concurrency levels")
        counts = dict(zip(levels, requests))
    return {c: max(int(n), c) for c, n in counts.items()}


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
                    max_level_seconds: float | None = None, stage_timer: StageTimer | None = None,
                    detail: bool = True) -> list[dict]:
    counts = requests_per_level(levels, requests)
    out = []
    for c in levels:
        out.append(await run_level(target, workload, c, counts[c], progress=progress, max_seconds=max_level_seconds,
                                   stage_timer=stage_timer, detail=detail))
    return out


# ---------------------------------------------------------------------------------------------
# token2wav alone: batched vs one at a time


def _t2w_schedule(synth: "Synthesizer", first_hop: int | None):
    """The chunk schedule `Synthesizer` uses for a streamed request."""
    from .token2wav import ChunkSchedule
    from .tts import SynthesisOptions

    dims = synth.dims
    return ChunkSchedule(first_hop=first_hop or SynthesisOptions().first_hop,
                         max_hop_multiple=synth.config.token2wav.max_hop_multiple, prompt_align=1,
                         pre_lookahead=dims.flow.pre_lookahead_len, token_mel_ratio=dims.token_mel_ratio,
                         samples_per_frame=dims.hift.samples_per_frame)


async def _t2w_round(synth: "Synthesizer", batcher, voice, token_lists: Sequence[np.ndarray], schedule,
                     seed: int) -> dict:
    import torch

    from .token2wav import Token2WavStream

    prompt_token = torch.from_numpy(np.array(voice.flow_prompt_speech_token, np.int32)).reshape(1, -1)
    prompt_feat = torch.from_numpy(np.array(voice.prompt_speech_feat, np.float32))[None]
    embedding = torch.from_numpy(np.array(voice.flow_embedding, np.float32)).reshape(1, -1)
    rate = synth.sample_rate
    t0 = time.monotonic()

    async def drive(i: int, tokens: np.ndarray) -> RequestResult:
        stream = Token2WavStream(prompt_token, prompt_feat, embedding, stream=True, schedule=schedule,
                                 noise=synth._noise(seed + i, 0))
        token_list = tokens.tolist()
        start = time.monotonic()
        result = RequestResult(index=i, seed=seed + i, start_s=start - t0, total_s=0.0)
        first_at, samples = None, 0
        while (job := stream.next_job(token_list, llm_done=True)) is not None:
            deadline = time.monotonic() if first_at is None else first_at + samples / rate
            out = await batcher.submit(job, deadline)
            now = time.monotonic()
            first_at = now if first_at is None else first_at
            samples += int(out.numel())
            if out.numel():
                result.arrivals_s.append(now - start)
                result.chunk_audio_s.append(out.numel() / rate)
        result.total_s = time.monotonic() - start
        return result

    results = await asyncio.gather(*(drive(i, t) for i, t in enumerate(token_lists)))
    wall = time.monotonic() - t0
    level = summarize_level(len(token_lists), results, wall, detail=False)
    level["batcher"] = _batcher_stats(batcher)
    return level


def _batcher_stats(batcher) -> dict:
    stats = getattr(batcher, "stats", None)
    if stats is None:
        return {}
    if dataclasses.is_dataclass(stats):
        stats = dataclasses.asdict(stats)
    elif not isinstance(stats, Mapping):
        stats = vars(stats)
    out = {k: v for k, v in stats.items() if isinstance(v, (int, float))}
    if out.get("batches"):
        out["mean_batch"] = out.get("jobs", 0) / out["batches"]
    return out


async def token2wav_compare(synth: "Synthesizer", concurrency: int, tokens: int, speaker_id: str, *,
                            seed: int = 0, first_hop: int | None = None, max_batch: int | None = None,
                            warmup: bool = True, progress: Progress | None = None,
                            target_speedup: float = 8.0) -> dict:
    """The token2wav stage alone at `concurrency` streams of `tokens` random speech tokens each
    (prompt: the registered speaker's), batched vs one job at a time, in this run.

    Both modes use the synthesizer's own Token2WavRunner through a fresh Token2WavBatcher; the
    synthesizer must be idle meanwhile. Throughput = audio seconds rendered / wall seconds."""
    from .frontend.model_input import build_model_input
    from .frontend.prompt import PromptFeatures
    from .token2wav_batcher import Token2WavBatcher
    from .tts import Mode

    record = synth.speakers.get(speaker_id)
    voice = build_model_input(Mode.ZERO_SHOT_BY_SPK_ID,
                              PromptFeatures(record.speech_tokens, record.speech_feat, record.embedding),
                              text_tokens=(0,), prompt_text_tokens=tuple(int(t) for t in record.prompt_text_tokens))
    rng = np.random.default_rng(seed)
    vocab = synth.dims.flow.vocab_size
    token_lists = [rng.integers(0, vocab, tokens, dtype=np.int64) for _ in range(concurrency)]
    schedule = _t2w_schedule(synth, first_hop)
    runner = synth.batcher.runner
    batch_size = max_batch or max(concurrency, synth.config.token2wav.max_batch)
    modes = {"batched": dict(max_batch=batch_size, batching=True), "sequential": dict(max_batch=1, batching=False)}
    out: dict = {"concurrency": concurrency, "tokens": tokens, "prompt_tokens": int(record.speech_tokens.size),
                 "first_hop": schedule.first_hop, "max_batch": batch_size}
    warm_tokens = schedule.first_hop + schedule.pre_lookahead + 2 * schedule.first_hop
    for name, kwargs in modes.items():
        if warmup:  # a throw-away batcher: first calls of each shape allocate and tune
            if progress:
                progress.note(f"token2wav {name}: warm-up")
            batcher = Token2WavBatcher(runner, **kwargs)
            try:
                await _t2w_round(synth, batcher, voice, [t[:warm_tokens] for t in token_lists], schedule, seed)
            finally:
                await batcher.close()
        if progress:
            progress.note(f"token2wav {name}: {concurrency} streams x {tokens} tokens")
        batcher = Token2WavBatcher(runner, **kwargs)
        try:
            out[name] = await _t2w_round(synth, batcher, voice, token_lists, schedule, seed)
        finally:
            await batcher.close()
        if progress:
            progress.note(f"token2wav {name}: {out[name]['audio_s_per_s']:.2f} audio s/s, "
                          f"wall {out[name]['wall_s']:.2f} s")
    b, s = out["batched"]["audio_s_per_s"], out["sequential"]["audio_s_per_s"]
    out["speedup"] = b / s if b and s else None
    out["target_speedup"] = target_speedup
    out["met"] = out["speedup"] is not None and out["speedup"] >= target_speedup
    return out


# ---------------------------------------------------------------------------------------------
# Prompt audio and setup


def synthetic_prompt(seconds: float = 6.0, sample_rate: int = 16000, seed: int = 0) -> "Audio":
    """A speech-like test signal: a harmonic voice with a wandering pitch, syllable-rate
    amplitude bursts and a little noise. Deterministic for a seed."""
    from .tts import Audio

    rng = np.random.default_rng(seed)
    n = int(round(seconds * sample_rate))
    t = np.arange(n) / sample_rate
    f0 = 150 + 30 * np.sin(2 * np.pi * 0.7 * t) + 10 * np.sin(2 * np.pi * 3.1 * t + 1.0)
    phase = 2 * np.pi * np.cumsum(f0) / sample_rate
    voice = sum(np.sin(k * phase) / k for k in range(1, 12))
    envelope = np.clip(np.sin(2 * np.pi * 4.0 * t + rng.uniform(0, 2 * np.pi)), 0, None) ** 0.5
    x = 0.25 * voice * envelope + 0.01 * rng.standard_normal(n)
    x = 0.5 * x / max(1e-6, float(np.abs(x).max()))
    return Audio(x.astype(np.float32), sample_rate)


@dataclass(frozen=True)
class SpeakerSpec:
    speaker_id: str = DEFAULT_SPEAKER
    register: bool = True            # False: use a speaker already in the store / on the server
    prompt_wav: Path | None = None   # None: a generated prompt of prompt_seconds
    prompt_text: str = DEFAULT_PROMPT_TEXT
    prompt_seconds: float = 6.0
    seed: int = 0

    def audio(self) -> "Audio":
        if self.prompt_wav is not None:
            from .frontend.audio import load_audio
            return load_audio(self.prompt_wav)
        return synthetic_prompt(self.prompt_seconds, seed=self.seed)


async def register_in_process(synth: "Synthesizer", spec: SpeakerSpec) -> int:
    """Register (overwriting) or look up the speaker; returns its prompt speech token count."""
    if spec.register:
        record = await synth.register_speaker(spec.speaker_id, spec.prompt_text, spec.audio(), overwrite=True)
    else:
        record = synth.speakers.get(spec.speaker_id)
    return int(record.speech_tokens.size)


async def register_grpc(client, spec: SpeakerSpec) -> float | None:
    """Register (overwriting) or look up the speaker on the server; returns its prompt seconds."""
    if spec.register:
        a = spec.audio()
        s = await client.register_speaker(spec.speaker_id, spec.prompt_text, (a.samples, a.sample_rate),
                                          overwrite=True)
    else:
        s = await client.get_speaker(spec.speaker_id)
    return float(s.prompt_seconds) if s.prompt_seconds else None


def environment(device: str | None = None) -> dict:
    """Versions and hardware for the results file."""
    info = {"python": platform.python_version(), "platform": platform.platform(), "host": platform.node(),
            "cpu_count": os.cpu_count(), "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    try:
        import torch
        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
        if device and device.startswith("cuda") and torch.cuda.is_available():
            d = torch.device(device)
            props = torch.cuda.get_device_properties(d)
            info["gpu"] = props.name
            info["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
            info["cuda"] = torch.version.cuda
    except ImportError:
        pass
    return info


# ---------------------------------------------------------------------------------------------
# Report: table and plots


def _ms(x: float | None) -> str:
    return f"{1e3 * x:8.1f}" if x is not None else f"{'-':>8}"


def format_table(levels: Sequence[dict]) -> str:
    head = (f"{'conc':>5} {'reqs':>5} {'first avg':>9} {'p50':>8} {'p90':>8} {'p99':>8} {'2nd p50':>8} "
            f"{'total p50':>9} {'RTF':>7} {'audio s/s':>9} {'late':>5} {'req late':>8} {'max stall':>9} {'err':>4}")
    lines = [head, "-" * len(head)]
    for lv in levels:
        f, s, t, u = lv["first_chunk_s"], lv["second_chunk_s"], lv["total_s"], lv["underruns"]
        rtf = f"{lv['rtf']:7.4f}" if lv["rtf"] is not None else f"{'-':>7}"
        aps = f"{lv['audio_s_per_s']:9.2f}" if lv["audio_s_per_s"] is not None else f"{'-':>9}"
        lines.append(f"{lv['concurrency']:5d} {lv['requests']:5d} {_ms(f['avg']):>9} {_ms(f['p50'])} {_ms(f['p90'])} "
                     f"{_ms(f['p99'])} {_ms(s['p50'])} {_ms(t['p50']):>9} {rtf} {aps} {u['late_chunks']:5d} "
                     f"{u['requests_with_underruns']:8d} {_ms(u['stall_s']['max']):>9} {lv['errors']:4d}")
    lines.append("latencies in ms; RTF = level wall / audio seconds; late = chunks that arrived after the audio "
                 "before them had played")
    return "\n".join(lines)


def format_t2w(cmp: dict) -> str:
    b, s = cmp["batched"], cmp["sequential"]
    speed = f"{cmp['speedup']:.2f}x" if cmp.get("speedup") else "-"
    return (f"token2wav alone, {cmp['concurrency']} streams x {cmp['tokens']} tokens "
            f"(prompt {cmp['prompt_tokens']} tokens, first hop {cmp['first_hop']}):\n"
            f"  batched    {b['audio_s_per_s']:9.2f} audio s/s  wall {b['wall_s']:7.2f} s  "
            f"first chunk p50 {_ms(b['first_chunk_s']['p50']).strip()} ms  "
            f"mean batch {b.get('batcher', {}).get('mean_batch', float('nan')):.1f}\n"
            f"  sequential {s['audio_s_per_s']:9.2f} audio s/s  wall {s['wall_s']:7.2f} s  "
            f"first chunk p50 {_ms(s['first_chunk_s']['p50']).strip()} ms\n"
            f"  speedup {speed} (target >= {cmp['target_speedup']:g}x: {'met' if cmp.get('met') else 'NOT met'})")


def write_plots(results: dict, out_dir: str | Path, prefix: str = "", targets: Mapping | None = None) -> list[Path]:
    """latency.png and throughput.png (vs concurrency; t2w.png with a comparison). Needs
    matplotlib; without it, logs a message and returns []."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed: no plots (pip install matplotlib)")
        print("[bench] matplotlib is not installed: skipping the plots (pip install matplotlib)", file=sys.stderr)
        return []
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    levels = results.get("levels") or []
    written = []
    title = results.get("title", "async_cosyvoice")
    if levels:
        c = [lv["concurrency"] for lv in levels]

        def series(metric, stat):
            return [1e3 * lv[metric][stat] if lv[metric][stat] is not None else np.nan for lv in levels]

        fig, ax = plt.subplots(figsize=(7.5, 4.8))
        ax.plot(c, series("first_chunk_s", "p50"), "o-", label="first chunk p50")
        ax.plot(c, series("first_chunk_s", "p99"), "o--", label="first chunk p99")
        ax.plot(c, series("second_chunk_s", "p50"), "s-", label="second chunk p50 (gap)")
        ax.plot(c, series("total_s", "p50"), "^-", label="total p50")
        for label, ms in (targets or {}).items():
            ax.axhline(ms, color="grey", lw=0.8, ls=":")
            ax.text(c[0], ms, f" {label}", va="bottom", fontsize=8, color="grey")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(c, [str(x) for x in c])
        ax.set_xlabel("concurrent streams")
        ax.set_ylabel("latency (ms)")
        ax.set_title(f"{title}: latency vs concurrency")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        p = out_dir / f"{prefix}latency.png"
        fig.savefig(p, dpi=120)
        plt.close(fig)
        written.append(p)

        fig, ax = plt.subplots(figsize=(7.5, 4.8))
        aps = [lv["audio_s_per_s"] or np.nan for lv in levels]
        ax.plot(c, aps, "o-", color="C0", label="audio seconds / second")
        ax.plot(c, c, ":", color="grey", label="real time for every stream")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(c, [str(x) for x in c])
        ax.set_xlabel("concurrent streams")
        ax.set_ylabel("audio seconds per wall second")
        ax2 = ax.twinx()
        ax2.bar(c, [lv["underruns"]["requests_with_underruns"] for lv in levels],
                width=[x * 0.3 for x in c], alpha=0.3, color="C3", label="requests with underruns")
        ax2.set_ylabel("requests with underruns", color="C3")
        ax2.yaxis.get_major_locator().set_params(integer=True)
        ax.set_zorder(ax2.get_zorder() + 1)  # the line over the bars
        ax.patch.set_visible(False)
        h1, l1 = ax.get_legend_handles_labels()
        h2, l2 = ax2.get_legend_handles_labels()
        ax.legend(h1 + h2, l1 + l2, fontsize=8, loc="upper left")
        ax.set_title(f"{title}: throughput vs concurrency")
        ax.grid(True, which="both", alpha=0.3)
        fig.tight_layout()
        p = out_dir / f"{prefix}throughput.png"
        fig.savefig(p, dpi=120)
        plt.close(fig)
        written.append(p)
    cmp = results.get("t2w_compare")
    if cmp:
        fig, ax = plt.subplots(figsize=(5, 4))
        vals = [cmp["sequential"]["audio_s_per_s"], cmp["batched"]["audio_s_per_s"]]
        ax.bar(["one at a time", "batched"], vals, color=["C7", "C2"])
        for i, v in enumerate(vals):
            ax.text(i, v, f"{v:.1f}", ha="center", va="bottom")
        speed = f"{cmp['speedup']:.1f}x" if cmp.get("speedup") else "-"
        ax.set_title(f"token2wav, {cmp['concurrency']} streams: {speed}")
        ax.set_ylabel("audio seconds per wall second")
        fig.tight_layout()
        p = out_dir / f"{prefix}t2w.png"
        fig.savefig(p, dpi=120)
        plt.close(fig)
        written.append(p)
    return written


def write_json(results: dict, path: str | Path) -> Path:
    """Atomic write (temporary file + rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=1, default=str)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path


# ---------------------------------------------------------------------------------------------
# Whole runs


async def bench_in_process(config: "Config", workload: Workload, levels: Sequence[int],
                           requests: int | Sequence[int] | Mapping[int, int], *, speaker: SpeakerSpec = SpeakerSpec(),
                           t2w_compare: int | None = None, t2w_tokens: int | None = None, warmup: bool = True,
                           max_level_seconds: float | None = None, progress: Progress | None = None,
                           detail: bool = True) -> dict:
    """Build a Synthesizer from `config`, register the speaker, sweep, and optionally compare
    token2wav batched vs sequential. Returns the results dict."""
    from .tts import Synthesizer

    progress = progress or Progress(enabled=False)
    t = time.monotonic()
    synth = await Synthesizer.create(config, warmup=warmup)
    load_s = time.monotonic() - t
    progress.note(f"synthesizer ready in {load_s:.1f} s ({config.model.device})")
    timer = time_synthesizer_stages(synth)
    try:
        prompt_tokens = await register_in_process(synth, speaker)
        workload = dataclasses.replace(workload, speaker_id=speaker.speaker_id)
        target = InProcessTarget(synth)
        results = _header("in-process", workload, levels, speaker, config)
        results["meta"].update(load_s=load_s, prompt_tokens=prompt_tokens)
        if warmup and levels:
            results["meta"]["warmup_s"] = await warm_up(target, workload, max(levels), progress)
        results["levels"] = await run_sweep(target, workload, levels, requests, progress=progress,
                                            max_level_seconds=max_level_seconds, stage_timer=timer, detail=detail)
        if t2w_compare:
            results["t2w_compare"] = await token2wav_compare(
                synth, t2w_compare, t2w_tokens or workload.tokens or 250, speaker.speaker_id, seed=workload.seed,
                first_hop=workload.first_hop, warmup=warmup, progress=progress)
        return results
    finally:
        timer.close()
        await synth.close()


async def bench_grpc(target_addr: str, workload: Workload, levels: Sequence[int],
                     requests: int | Sequence[int] | Mapping[int, int], *, token: str | None = None,
                     speaker: SpeakerSpec = SpeakerSpec(), warmup: bool = True,
                     max_level_seconds: float | None = None, progress: Progress | None = None,
                     detail: bool = True) -> dict:
    from grpc_async.client import CosyVoiceClient

    progress = progress or Progress(enabled=False)
    if workload.tokens is not None and not GrpcTarget.supports_forced_tokens():
        raise ValueError("--tokens needs a forced token count in the gRPC API (SynthesisOptions.max_tokens), "
                         "which this version lacks; run without --tokens (the seed fixes the workload) "
                         "or use --in-process")
    async with CosyVoiceClient(target_addr, token=token) as client:
        await client.wait_ready()
        prompt_seconds = await register_grpc(client, speaker)
        workload = dataclasses.replace(workload, speaker_id=speaker.speaker_id)
        target = GrpcTarget(client)
        results = _header("grpc", workload, levels, speaker, None)
        results["meta"].update(target=target_addr, prompt_seconds=prompt_seconds)
        if warmup and levels:
            results["meta"]["warmup_s"] = await warm_up(target, workload, max(levels), progress)
        results["levels"] = await run_sweep(target, workload, levels, requests, progress=progress,
                                            max_level_seconds=max_level_seconds, detail=detail)
        return results


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


# ---------------------------------------------------------------------------------------------
# CLI (`async-cosyvoice bench`)


def parse_int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise ValueError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise ValueError(f"expected positive integers, got {text!r}")
    return values


def add_arguments(p) -> None:
    """The `bench` subcommand's own arguments (cli.py adds --config/--model-dir/--device/...)."""
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--target", help="host:port of a running server (gRPC)")
    where.add_argument("--in-process", action="store_true", help="run a Synthesizer in this process")
    p.add_argument("--token", default=os.environ.get("ASYNC_COSYVOICE_TOKEN"),
                   help="bearer token for --target (env ASYNC_COSYVOICE_TOKEN)")
    p.add_argument("--concurrency", default="1,2,4,8", help="levels, e.g. 1,2,4,8,16,32,64 (default 1,2,4,8)")
    p.add_argument("--requests", default="8",
                   help="requests per level: one number, or one per level (each level gets at least its "
                        "concurrency); default 8")
    p.add_argument("--tokens", type=int, help="force this many speech tokens per request (EOS ignored); "
                                              "in-process only")
    p.add_argument("--text", default=DEFAULT_TEXT, help="text every request speaks")
    p.add_argument("--seed", type=int, default=0, help="request i of a level uses seed + i (default 0)")
    p.add_argument("--first-hop", type=int, help="tokens in the first streamed chunk (in-process)")
    p.add_argument("--no-stream", action="store_true", help="non-streaming requests (offline throughput)")
    p.add_argument("--speaker", default=DEFAULT_SPEAKER, help=f"speaker id (default {DEFAULT_SPEAKER})")
    p.add_argument("--no-register", action="store_true",
                   help="use the speaker as already registered instead of registering it first")
    p.add_argument("--prompt-wav", type=Path, help="register the speaker from this file (default: a generated "
                                                    "speech-like prompt)")
    p.add_argument("--prompt-text", default=DEFAULT_PROMPT_TEXT, help="transcript of the prompt")
    p.add_argument("--prompt-seconds", type=float, default=6.0,
                   help="length of the generated prompt (default 6 s = 150 prompt tokens)")
    p.add_argument("--llm-dtype", choices=["float32", "bfloat16", "float16"], help="in-process LLM dtype")
    p.add_argument("--flow-dtype", choices=["float32", "bfloat16", "float16"], help="in-process flow dtype")
    p.add_argument("--t2w-compare", type=int, metavar="C",
                   help="also run token2wav alone at C streams, batched vs one at a time (in-process)")
    p.add_argument("--t2w-tokens", type=int, help="tokens per stream for --t2w-compare (default --tokens or 250)")
    p.add_argument("--max-level-seconds", type=float, help="stop sending new requests of a level after this long")
    p.add_argument("--no-warmup", action="store_true", help="skip the warm-up round")
    p.add_argument("--out", type=Path, help="results JSON (plots are written next to it)")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--no-detail", action="store_true", help="leave per-request records out of the JSON")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")


def _bench_config(config: "Config", args, scratch: Path) -> "Config":
    updates = {}
    model = {k: v for k, v in (("llm_dtype", args.llm_dtype), ("flow_dtype", args.flow_dtype)) if v}
    if model:
        updates["model"] = config.model.model_copy(update=model)
    if not args.speakers_dir and not args.no_register:  # keep the bench speaker out of the user's store
        updates["speakers"] = config.speakers.model_copy(update={"dir": scratch})
    return config.model_copy(update=updates)


def main(args, config_factory: Callable[[object], "Config"]) -> int:
    """`async-cosyvoice bench`: run, print the table, write JSON and plots."""
    try:
        levels = parse_int_list(args.concurrency)
        requests = parse_int_list(args.requests)
        requests = requests[0] if len(requests) == 1 else requests
        requests_per_level(levels, requests)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.target and (args.t2w_compare or args.first_hop or args.llm_dtype or args.flow_dtype):
        print("error: --t2w-compare, --first-hop, --llm-dtype and --flow-dtype need --in-process", file=sys.stderr)
        return 2
    workload = Workload(text=args.text, speaker_id=args.speaker, tokens=args.tokens, stream=not args.no_stream,
                        seed=args.seed, first_hop=args.first_hop)
    speaker = SpeakerSpec(args.speaker, register=not args.no_register, prompt_wav=args.prompt_wav,
                          prompt_text=args.prompt_text, prompt_seconds=args.prompt_seconds, seed=args.seed)
    progress = Progress(enabled=not args.quiet)
    common = dict(speaker=speaker, warmup=not args.no_warmup, max_level_seconds=args.max_level_seconds,
                  progress=progress, detail=not args.no_detail)
    try:
        if args.in_process:
            with tempfile.TemporaryDirectory(prefix="async-cosyvoice-bench-spk-") as scratch:
                config = _bench_config(config_factory(args), args, Path(scratch))
                results = asyncio.run(bench_in_process(config, workload, levels, requests,
                                                       t2w_compare=args.t2w_compare, t2w_tokens=args.t2w_tokens,
                                                       **common))
        else:
            results = asyncio.run(bench_grpc(args.target, workload, levels, requests, token=args.token, **common))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(format_table(results["levels"]))
    if "t2w_compare" in results:
        print(format_t2w(results["t2w_compare"]))
    if args.out:
        write_json(results, args.out)
        print(f"wrote {args.out}", file=sys.stderr)
        if not args.no_plots:
            for p in write_plots(results, args.out.parent, prefix=f"{args.out.stem}-"):
                print(f"wrote {p}", file=sys.stderr)
    return 1 if any(lv["errors"] for lv in results["levels"]) else 0
