"""What one request measured (chunk arrival times, underruns) and a level's aggregate: percentiles
of every latency over the level's requests."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

import numpy as np

PERCENTILES = (50, 90, 95, 99)
_EPS = 1e-9


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
    """The level's aggregate (see the package docstring) plus, with `detail`, every request."""
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
