"""Where the device time went during a level: the busy counters the stages keep themselves
(`StageStats` of the LLM engine's steps and of the token2wav batches), read before and after.

In-process they are read from the Synthesizer; over gRPC from the server's Prometheus endpoint
(`server.metrics_port`), where they are `cosyvoice_stage_{busy_seconds,calls,items}_total`. The
benchmark never wraps or patches what it measures.

From a server also where its streamed first chunks' time went
(`cosyvoice_first_chunk_part_seconds{part}`), as the stages `first_chunk_tokens`,
`first_chunk_wait` and `first_chunk_t2w`: `calls` first chunks, `busy_s` their seconds in that
part, so a level's `ms_per_call` is the part's mean.
"""
from __future__ import annotations

import asyncio
import urllib.request
from typing import TYPE_CHECKING, Mapping, Protocol

from prometheus_client.parser import text_string_to_metric_families

from async_cosyvoice.stage_stats import StageStats

if TYPE_CHECKING:
    from async_cosyvoice.tts import Synthesizer

# Prometheus counter (without `_total`) -> StageStats field
PROMETHEUS_FIELDS = {"cosyvoice_stage_busy_seconds": "busy_s", "cosyvoice_stage_calls": "calls",
                     "cosyvoice_stage_items": "items", "cosyvoice_stage_failed_calls": "failed"}
FIRST_CHUNK_PARTS = "cosyvoice_first_chunk_part_seconds"  # histogram, label part: tokens, wait, t2w


class StageCounters(Protocol):
    async def read(self) -> dict[str, StageStats]:
        """A copy of every stage's counters now, by stage name."""
        ...


class SynthesizerStages:
    """The counters of a Synthesizer in this process (its engine's, where it keeps them, and its
    token2wav batcher's)."""

    def __init__(self, synth: "Synthesizer"):
        self.synth = synth

    async def read(self) -> dict[str, StageStats]:
        stages = [self.synth.engine.stage_stats, self.synth.engine.prefill_stats, self.synth.batcher.stage_stats]
        return {s.name: s.copy() for s in stages if s is not None}


class PrometheusStages:
    """The counters a server exports on its metrics endpoint, `http://HOST:PORT/metrics`."""

    def __init__(self, url: str, timeout_s: float = 5.0):
        self.url = url if "://" in url else f"http://{url}/metrics"
        self.timeout_s = timeout_s

    async def read(self) -> dict[str, StageStats]:
        return parse_prometheus(await self.text())

    async def text(self) -> str:
        """The endpoint's exposition text now."""
        return await asyncio.to_thread(self._fetch)

    def _fetch(self) -> str:
        with urllib.request.urlopen(self.url, timeout=self.timeout_s) as r:
            return r.read().decode("utf-8")


def parse_prometheus(text: str) -> dict[str, StageStats]:
    out: dict[str, StageStats] = {}
    for family in text_string_to_metric_families(text):
        if family.name == FIRST_CHUNK_PARTS:
            for sample in family.samples:
                name = f"first_chunk_{sample.labels.get('part')}"
                if sample.name.endswith("_sum"):
                    out.setdefault(name, StageStats(name)).busy_s = float(sample.value)
                elif sample.name.endswith("_count"):
                    out.setdefault(name, StageStats(name)).calls = int(sample.value)
            continue
        field = PROMETHEUS_FIELDS.get(family.name)
        if field is None:
            continue
        for sample in family.samples:
            if not sample.name.endswith("_total"):
                continue
            stats = out.setdefault(sample.labels["stage"], StageStats(sample.labels["stage"]))
            setattr(stats, field, float(sample.value) if field == "busy_s" else int(sample.value))
    return out


def stage_delta(before: Mapping[str, StageStats], after: Mapping[str, StageStats], wall_s: float) -> dict:
    """Per stage: calls, items, busy seconds, busy fraction of `wall_s`, ms per call, items per call."""
    return {name: s.since(before.get(name), wall_s) for name, s in after.items()}
