"""Per-request bookkeeping of the HTTP front door: one log line and the shared metrics per request."""
from __future__ import annotations

import asyncio
import logging
import time
import uuid

from async_cosyvoice.request import Timeline

from .errors import INTERNAL, status_for

log = logging.getLogger("http_api")


class HttpCall:
    """What one request did: what goes into its log line and metrics (same metrics as gRPC)."""

    def __init__(self, method: str, peer: str, request_id: str | None = None):
        self.method = method          # e.g. "POST /v1/audio/speech" (the metrics' method label)
        self.peer = peer
        self.start = time.perf_counter()
        self.clock_start = self.start  # first-chunk latency reference (WebSocket: the first text)
        self.request_id = request_id or uuid.uuid4().hex  # HTTP: the id the RequestId middleware gave it
        self.mode = "-"
        self.voice = ""
        self.stream: bool | None = None
        self.format = ""
        self.status = "200"
        self.detail = ""
        self.first_chunk_at: float | None = None
        self.audio_seconds = 0.0
        self.tokens = 0
        self.chunks = 0
        self.bytes_out = 0
        self.first_timeline: Timeline | None = None  # the first text segment's (first_chunk_parts)

    def chunk(self, num_samples: int, sample_rate: int, encoded: int, timeline: Timeline | None = None) -> None:
        """One chunk sent; timeline: the chunk's `first_segment_timeline`."""
        self.first_timeline = self.first_timeline or timeline
        self.chunks += 1
        self.bytes_out += encoded
        self.audio_seconds += num_samples / sample_rate
        if self.first_chunk_at is None and num_samples:
            self.first_chunk_at = time.perf_counter()

    @property
    def first_chunk_latency(self) -> float | None:
        return None if self.first_chunk_at is None else self.first_chunk_at - self.clock_start

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def failed(self, error: BaseException) -> None:
        if isinstance(error, asyncio.CancelledError):
            self.status = "CANCELLED"  # the client went away
            return
        status = status_for(error)
        self.status = str(status.http)
        self.detail = str(getattr(error, "message", None) or error)
        if status is INTERNAL:
            log.error("http method=%r id=%s failed", self.method, self.request_id, exc_info=error)

    def summary(self) -> dict:
        total = self.elapsed()
        first = self.first_chunk_latency
        return {"request_id": self.request_id, "audio_seconds": round(self.audio_seconds, 4),
                "first_chunk_latency_seconds": None if first is None else round(first, 4),
                "total_seconds": round(total, 4),
                "rtf": round(total / self.audio_seconds, 4) if self.audio_seconds else None,
                "chunks": self.chunks, "speech_tokens": self.tokens}

    def finish(self, metrics) -> None:
        elapsed = self.elapsed()
        first = self.first_chunk_latency
        stream = "-" if self.stream is None else str(self.stream).lower()
        parts = self.first_timeline.first_chunk_parts() if self.first_timeline else None
        metrics.record_request(self.method, self.mode, self.status, self.status == "200", stream, elapsed,
                               first, self.audio_seconds, self.tokens, self.chunks, parts)
        level = logging.INFO if self.status in ("200", "CANCELLED") else logging.WARNING
        log.log(level,
                "http method=%r id=%s mode=%s stream=%s format=%s status=%s latency_ms=%.1f first_chunk_ms=%s "
                "first_chunk_parts=%s audio_s=%.3f tokens=%d chunks=%d bytes=%d peer=%s%s%s",
                self.method, self.request_id, self.mode, stream, self.format or "-", self.status, elapsed * 1e3,
                "-" if first is None else f"{first * 1e3:.1f}",
                parts or "-",
                self.audio_seconds, self.tokens, self.chunks,
                self.bytes_out, self.peer, f" voice={self.voice!r}" if self.voice else "",
                f" detail={self.detail!r}" if self.detail else "")
