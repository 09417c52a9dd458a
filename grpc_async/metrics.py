"""Prometheus metrics of the gRPC service, served on a side HTTP port (`server.metrics_port`).

Each server owns its registry (several servers in one process, as in tests, do not collide).
Engine gauges are read from `Synthesizer.engine_stats()` at scrape time, and so are the busy
counters the device stages keep themselves (`StageStats`: LLM steps, token2wav batches); the
process collector adds `process_resident_memory_bytes` & co. (what a soak watches). The port
answers `GET /metrics` only; every other path is 404.
"""
from __future__ import annotations

import dataclasses
import logging
import threading
from http.server import ThreadingHTTPServer
from typing import Callable, Iterable
from urllib.parse import urlsplit

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector
from prometheus_client.core import CounterMetricFamily
from prometheus_client.exposition import MetricsHandler

from async_cosyvoice.gc_pauses import GC_PAUSES, GCPauses
from async_cosyvoice.request import FirstChunkParts
from async_cosyvoice.stage_stats import StageStats
from async_cosyvoice.startup import StartupReport

log = logging.getLogger(__name__)

_LATENCY_BUCKETS = (0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0)
_RTF_BUCKETS = (0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0)
_DURATION_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "cosyvoice_requests", "RPCs handled, by method, synthesis mode and final status code",
            ["method", "mode", "status"], registry=r)
        self.active_streams = Gauge(
            "cosyvoice_active_streams", "Synthesis streams in progress (Synthesize + StreamSynthesize)",
            registry=r)
        self.rejected = Counter(
            "cosyvoice_rejected_streams", "Synthesis streams refused because the concurrency limit was reached",
            registry=r)
        self.first_chunk_latency = Histogram(
            "cosyvoice_first_chunk_latency_seconds", "Server-side time from request to first audio chunk",
            ["mode", "stream"], buckets=_LATENCY_BUCKETS, registry=r)
        self.first_chunk_parts = Histogram(
            "cosyvoice_first_chunk_part_seconds",
            "Where first chunks' time went: tokens (until the LM's speech tokens were there), wait (for a "
            "token2wav batch to take the chunk), t2w (its batch); first_token, a part of tokens (until the "
            "first speech token: waiting for the LM and its prefill)",
            ["part"], buckets=_LATENCY_BUCKETS, registry=r)
        self.rtf = Histogram(
            "cosyvoice_rtf", "Real-time factor of completed syntheses (wall time / audio time)",
            ["mode", "stream"], buckets=_RTF_BUCKETS, registry=r)
        self.request_duration = Histogram(
            "cosyvoice_request_duration_seconds", "Server-side wall time of RPCs",
            ["method"], buckets=_DURATION_BUCKETS, registry=r)
        self.audio_seconds = Counter(
            "cosyvoice_audio_seconds", "Seconds of audio produced", ["mode"], registry=r)
        self.speech_tokens = Counter(
            "cosyvoice_speech_tokens", "Speech tokens generated", ["mode"], registry=r)
        self.engine_running = Gauge(
            "cosyvoice_engine_running_requests", "LM engine requests being generated", registry=r)
        self.engine_waiting = Gauge(
            "cosyvoice_engine_waiting_requests", "LM engine requests queued", registry=r)
        self.engine_kv_usage = Gauge(
            "cosyvoice_engine_kv_usage_ratio", "Fraction of the LM KV cache in use", registry=r)
        self.ready = Gauge("cosyvoice_ready", "1 once the model is loaded and warmed up", registry=r)
        r.register(_GCPauseCollector(GC_PAUSES))
        self.startup_seconds = Gauge(
            "cosyvoice_startup_seconds", "Where the start went, by phase (set once SERVING; total: to SERVING)",
            ["phase"], registry=r)
        self.startup_graphs = Gauge(
            "cosyvoice_startup_cuda_graphs", "CUDA graphs captured during the start, by kind", ["kind"], registry=r)
        self.engine_alive = Gauge(
            "cosyvoice_engine_alive", "0 once the LM engine has died (the process is exiting)", registry=r)
        self.engine_alive.set(1)
        ProcessCollector(registry=r)
        self._http: ThreadingHTTPServer | None = None

    def record_request(self, method: str, mode: str, status: str, ok: bool, stream: str, elapsed: float,
                       first_chunk: float | None, audio_seconds: float, tokens: int, chunks: int,
                       first_chunk_parts: FirstChunkParts | None = None) -> None:
        """One finished request of either front door (gRPC or HTTP): its counters and, when it
        succeeded with audio, its latency (and where its first chunk's went), RTF, audio and
        token totals."""
        self.requests.labels(method, mode, status).inc()
        self.request_duration.labels(method).observe(elapsed)
        if chunks and ok:
            if first_chunk is not None:
                self.first_chunk_latency.labels(mode, stream).observe(first_chunk)
            if first_chunk_parts is not None:
                for part, seconds in dataclasses.asdict(first_chunk_parts).items():
                    self.first_chunk_parts.labels(part).observe(seconds)
            if audio_seconds > 0:
                self.rtf.labels(mode, stream).observe(elapsed / audio_seconds)
            self.audio_seconds.labels(mode).inc(audio_seconds)
            self.speech_tokens.labels(mode).inc(tokens)

    def record_startup(self, report: StartupReport) -> None:
        """The finished start's phases (startup.py) and graph counts."""
        for phase, seconds in report.phases.items():
            self.startup_seconds.labels(phase).set(seconds)
        self.startup_seconds.labels("total").set(report.total_s)
        for kind, n in report.captured.items():
            self.startup_graphs.labels(kind).set(n)

    def bind_engine(self, stats: Callable[[], object]) -> None:
        """Read the engine gauges from `stats()` (an EngineStats) at every scrape."""
        def field(name: str) -> Callable[[], float]:
            def read() -> float:
                try:
                    return float(getattr(stats(), name))
                except Exception:  # a scrape must never fail because the engine is gone
                    return float("nan")
            return read
        self.engine_running.set_function(field("running"))
        self.engine_waiting.set_function(field("waiting"))
        self.engine_kv_usage.set_function(field("kv_usage"))

    def bind_stages(self, stages: Callable[[], Iterable[StageStats]]) -> None:
        """Export the stages' own counters (read at every scrape) as
        cosyvoice_stage_{busy_seconds,calls,items,failed_calls}_total{stage=...}."""
        self.registry.register(_StageCollector(stages))

    def serve_http(self, port: int, host: str = "127.0.0.1") -> int:
        """Start the /metrics HTTP endpoint in a daemon thread; returns the bound port."""
        server = ThreadingHTTPServer((host, port), _metrics_only(self.registry))
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
        self._http = server
        bound = server.server_address[1]
        log.info("metrics on http://%s:%d/metrics", host, bound)
        return bound

    def close(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None


class _StageCollector:
    """Counters owned by the stages, copied into the scrape (never set from outside)."""

    FAMILIES = (("cosyvoice_stage_busy_seconds", "busy_s", "Seconds a device stage's thread spent in its calls"),
                ("cosyvoice_stage_calls", "calls", "Calls a device stage ran (LLM steps, token2wav batches)"),
                ("cosyvoice_stage_items", "items", "Rows / jobs in a device stage's calls"),
                ("cosyvoice_stage_failed_calls", "failed", "Calls of a device stage that raised"))

    def __init__(self, stages: Callable[[], Iterable[StageStats]]):
        self.stages = stages

    def describe(self):
        return [CounterMetricFamily(name, doc, labels=["stage"]) for name, _, doc in self.FAMILIES]

    def collect(self):
        try:
            stages = [s.copy() for s in self.stages()]
        except Exception:  # a scrape must never fail because the model is gone
            stages = []
        for name, attr, doc in self.FAMILIES:
            family = CounterMetricFamily(name, doc, labels=["stage"])
            for s in stages:
                family.add_metric([s.name], float(getattr(s, attr)))
            yield family


class _GCPauseCollector:
    """This process's garbage collections since the warm-up (gc_pauses.py): each stops every thread
    for its duration, a request's included."""

    def __init__(self, pauses: GCPauses):
        self.pauses = pauses

    def describe(self):
        return list(self.collect())

    def collect(self):
        count = CounterMetricFamily("cosyvoice_gc_collections", "Python garbage collections, by generation",
                                    labels=["generation"])
        seconds = CounterMetricFamily("cosyvoice_gc_pause_seconds",
                                      "Seconds every thread stood still in Python garbage collections, by generation",
                                      labels=["generation"])
        for generation in range(3):
            count.add_metric([str(generation)], float(self.pauses.count[generation]))
            seconds.add_metric([str(generation)], float(self.pauses.seconds[generation]))
        yield count
        yield seconds


def _metrics_only(registry: CollectorRegistry) -> type[MetricsHandler]:
    """prometheus_client's handler (content negotiation, gzip, name[] filters) on /metrics only."""
    base = MetricsHandler.factory(registry)

    class Handler(base):
        def do_GET(self) -> None:
            if urlsplit(self.path).path != "/metrics":
                self.send_error(404, "only /metrics is served here")
                return
            super().do_GET()

    return Handler
