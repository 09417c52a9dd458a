"""Where a start's seconds go, and what the server is doing until it serves.

`Startup` is handed to `Synthesizer.create` (through `placement.create_synthesizer`) by whoever
waits for it: the server reads `status()` for its "warming up" answers while it runs, and the
`report()` after it (the phase table in the log, GetServerInfo, the metrics, the server bench).

Phases of the report (seconds; they add up to the start's wall time):
  load weights       the model directory, modules, tokenizer, prompt encoder, engine and token2wav
                     stage built (and the persistent compile cache loaded)
  compile            torch.compile (Dynamo + inductor), by torch's own accounting
  capture            CUDA graph captures (LLM decode steps, flow, HiFT, estimator), without the
                     compiling that happened inside them
  warm-up requests   the rest of the engine start and the warm-up requests (the first runs of
                     every stage: kernel selection, allocator growth, speakers' flow prefixes)
  save compile cache writing the persistent compile cache
Compile and capture happen inside the engine start and the warm-up (torch compiles lazily; the
warm-up captures its plan's graphs, and the token2wav stage those its warm-up requests wanted once
they end), so they are measured where they happen and taken out of those.

`CAPTURES` is the process's log of CUDA graph captures (like torch's own counters): the graph
owners (graph_buckets.GraphBuckets, engine/model_runner.ModelRunner) add each capture's seconds
and the compile seconds inside it. A token2wav stage in a child process (token2wav.process)
captures in that process; its graphs are not in this process's log.
"""
from __future__ import annotations

import sys
import threading
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

PHASES = ("load weights", "compile", "capture", "warm-up requests", "save compile cache")
DYNAMO_UTILS = "torch._dynamo.utils"  # torch's own compile-time accounting (private; absent in some builds)


def compile_seconds() -> float:
    """Seconds this process has spent in torch.compile so far (Dynamo + inductor, torch's accounting).
    Read where torch.compile has loaded it: a process that never imported torch._dynamo compiled
    nothing, and importing it only to read 0 would cost a start that compiles nothing over a second."""
    calculate_time_spent = getattr(sys.modules.get(DYNAMO_UTILS), "calculate_time_spent", None)
    if calculate_time_spent is None:
        return 0.0
    try:
        return float(calculate_time_spent().get("entire_frame_compile", 0.0))
    except Exception:  # noqa: BLE001 — an accounting gap is not worth a failed start
        return 0.0


@dataclass
class CaptureTotals:
    graphs: Counter = field(default_factory=Counter)     # what -> graphs captured
    seconds: Counter = field(default_factory=Counter)    # what -> seconds, compile inside excluded
    compile_seconds: float = 0.0                         # compiling that happened inside captures

    def minus(self, before: "CaptureTotals") -> "CaptureTotals":
        return CaptureTotals(self.graphs - before.graphs, Counter({k: v - before.seconds[k] for k, v in
                                                                   self.seconds.items() if v > before.seconds[k]}),
                             self.compile_seconds - before.compile_seconds)


class CaptureLog:
    """Every CUDA graph capture of this process: graphs, seconds and compile seconds inside, by kind."""

    def __init__(self):
        self._lock = threading.Lock()
        self._totals = CaptureTotals()

    @contextmanager
    def capturing(self, what: str) -> Iterator[None]:
        t, c = time.perf_counter(), compile_seconds()
        yield
        compiled = compile_seconds() - c
        with self._lock:
            self._totals.graphs[what] += 1
            self._totals.seconds[what] += max(0.0, time.perf_counter() - t - compiled)
            self._totals.compile_seconds += compiled

    def snapshot(self) -> CaptureTotals:
        with self._lock:
            t = self._totals
            return CaptureTotals(Counter(t.graphs), Counter(t.seconds), t.compile_seconds)


CAPTURES = CaptureLog()


@dataclass(frozen=True)
class StartupReport:
    phases: dict[str, float]            # PHASES -> seconds
    total_s: float
    captured: dict[str, int]            # graph kind -> graphs captured during the start
    capture_s: dict[str, float]         # graph kind -> seconds
    compile_cache: str                  # the persistent compile cache: off | hit | miss | mismatch | corrupt

    def table(self) -> str:
        lines = [f"start-up: {self.total_s:.1f} s (compile cache: {self.compile_cache})"]
        lines += [f"  {name:<20}{self.phases.get(name, 0.0):8.1f} s" for name in PHASES]
        for what, n in sorted(self.captured.items()):
            lines.append(f"  captured {n} {what} CUDA graph(s) in {self.capture_s.get(what, 0.0):.1f} s")
        return "\n".join(lines)


class Startup:
    """One start: its current step (`status`) while it runs, the phase report after. See the module docstring."""

    def __init__(self):
        self.started = time.monotonic()
        self.step = "loading the model"  # until the first span names its step
        self.compile_cache = "off"
        self._spans: Counter = Counter()   # "load weights" | "warm-up" | "save compile cache" -> wall seconds
        self._compile0 = compile_seconds()
        self._captures0 = CAPTURES.snapshot()
        self._report: StartupReport | None = None

    @contextmanager
    def span(self, name: str, step: str) -> Iterator[None]:
        """Time a wall-clock span of the start; `step` is what `status` says meanwhile."""
        self.step = step
        t = time.monotonic()
        try:
            yield
        finally:
            self._spans[name] += time.monotonic() - t

    def status(self) -> str:
        return f"{self.step}, {time.monotonic() - self.started:.0f} s since the start"

    def finish(self) -> StartupReport:
        """The report of the start so far (call once it is done; later calls return the same report)."""
        if self._report is not None:
            return self._report
        captures = CAPTURES.snapshot().minus(self._captures0)
        compiled = compile_seconds() - self._compile0
        capture_s = sum(captures.seconds.values())
        warm = self._spans["warm-up"]
        phases = {
            "load weights": self._spans["load weights"],
            "compile": compiled,
            "capture": capture_s,
            # compile outside the spans (none that we know of) must not make this negative
            "warm-up requests": max(0.0, warm - capture_s - compiled),
            "save compile cache": self._spans["save compile cache"],
        }
        self._report = StartupReport(phases, time.monotonic() - self.started, dict(captures.graphs),
                                     dict(captures.seconds), self.compile_cache)
        self.step = "serving"
        return self._report

    @property
    def report(self) -> StartupReport | None:
        return self._report
