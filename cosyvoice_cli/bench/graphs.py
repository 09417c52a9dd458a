"""Wait for a server's CUDA graphs to settle before a timed phase.

A server meets new (batch, length) buckets under load; their calls run without a graph until the
token2wav batcher's capture thread has captured their graphs, one after another beside the batches
(1-2 s each with compiled regions; ~30 after a 32-stream level). A phase timed while those are
pending measures calls without their graphs and captures sharing the device, not the server. So
before each timed phase a bench reads the server's Prometheus endpoint until no bucket is wanted
(`cosyvoice_device_cuda_graphs_wanted`, summed over devices and kinds, is 0), at most `bound_s`.
The endpoint is pull-only: the bench reads it every `poll_s` seconds, as a Prometheus server would.
A bucket leaves `wanted` when its capture starts (graph_buckets.GraphBuckets.capture_wanted), so
the wait also lasts while a device says its capture thread is at work
(`cosyvoice_device_cuda_graph_capturing`).
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from .stages import PrometheusStages

WANTED = "cosyvoice_device_cuda_graphs_wanted"
CAPTURED = "cosyvoice_device_cuda_graphs"
CAPTURES = "cosyvoice_device_cuda_graph_background_captures"
CAPTURE_SECONDS = "cosyvoice_device_cuda_graph_capture_seconds"
CAPTURING = "cosyvoice_device_cuda_graph_capturing"
POLL_S = 0.5


@dataclass(frozen=True)
class GraphCounts:
    """A server's CUDA graph series, summed over its devices and graph kinds."""
    captured: int = 0
    wanted: int = 0
    background_captures: int = 0
    capture_seconds: float = 0.0
    capturing: int = 0  # devices whose capture thread is at work

    @property
    def settled(self) -> bool:
        return self.wanted == 0 and self.capturing == 0


def parse_graph_counts(text: str) -> GraphCounts:
    sums = {CAPTURED: 0.0, WANTED: 0.0, CAPTURES: 0.0, CAPTURE_SECONDS: 0.0, CAPTURING: 0.0}
    for family in text_string_to_metric_families(text):
        if family.name in sums:
            # a counter family's samples are <name>_total and <name>_created: the total only
            sums[family.name] += sum(s.value for s in family.samples if not s.name.endswith("_created"))
    return GraphCounts(int(sums[CAPTURED]), int(sums[WANTED]), int(sums[CAPTURES]), sums[CAPTURE_SECONDS],
                       int(sums[CAPTURING]))


async def settle_graphs(metrics: PrometheusStages, bound_s: float, poll_s: float = POLL_S) -> dict:
    """Read `metrics` until no CUDA graph is wanted or being captured, or `bound_s` seconds have
    passed. Returns as JSON: waited_s, settled (nothing wanted or being captured at the end),
    captured, wanted and capturing at the end, and the server's captures during the wait
    (background_captures, capture_s)."""
    t = time.monotonic()
    first = counts = parse_graph_counts(await metrics.text())
    while not counts.settled and (left := bound_s - (time.monotonic() - t)) > 0:
        await asyncio.sleep(min(poll_s, left))
        counts = parse_graph_counts(await metrics.text())
    return {"waited_s": time.monotonic() - t, "bound_s": bound_s, "settled": counts.settled,
            "captured": counts.captured, "wanted": counts.wanted, "capturing": counts.capturing,
            "background_captures": counts.background_captures - first.background_captures,
            "capture_s": counts.capture_seconds - first.capture_seconds}


def format_settle(settle: dict, before: str) -> str:
    """One line: how long the wait was and what the server had then."""
    if "error" in settle:
        return f"CUDA graphs before {before}: not read ({settle['error']})"
    line = (f"CUDA graphs before {before}: waited {settle['waited_s']:.1f} s, {settle['captured']} captured "
            f"({settle['background_captures']} while waiting, {settle['capture_s']:.1f} s)")
    if not settle["settled"]:
        line += (f", {settle['wanted']} STILL WANTED ({settle['capturing']} device(s) capturing) after the "
                 f"{settle['bound_s']:g} s bound (--settle-s)")
    return line
