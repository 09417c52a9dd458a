"""A token2wav device's CUDA graph state, as metrics and benchmarks read it: per graph kind (a graph
holder's `what`: flow, HiFT, cached flow, flow estimator) the graphs captured, the buckets wanted
(met by a call, waiting for their capture: graph_buckets.py) and the calls so far, plus the
batcher's captures of wanted graphs (in its capture thread, beside the batches).

A snapshot of plain numbers: it crosses a pipe (a worker process's replies, device_worker.py) and
is read in a scrape thread. Until the wanted buckets are captured, calls of those shapes run
without a graph and the captures share the device: a benchmark waits for `wanted == 0` before it
times anything.
"""
from __future__ import annotations

from dataclasses import dataclass

from .batcher import Token2WavBatcher


@dataclass(frozen=True)
class GraphKindState:
    kind: str         # the holder's `what`
    graphs: int       # captured
    wanted: int       # buckets a call met that wait for their capture
    replays: int      # calls that ran in a graph (off CUDA: padded to their bucket)
    deferred: int     # calls that ran without a graph while their bucket waited for its capture
    fallbacks: int    # calls past the buckets (or of a bucket whose capture failed)
    covered: int = 0  # calls that ran in a larger bucket's graph while theirs waited (counted in replays)


@dataclass(frozen=True)
class DeviceGraphState:
    kinds: tuple[GraphKindState, ...] = ()
    background_captures: int = 0   # the batcher's captures of wanted graphs (its capture thread)
    capture_seconds: float = 0.0   # their seconds
    capture_gave_way_seconds: float = 0.0  # seconds they waited for streams owed their first chunk
    capturing: bool = False        # its capture thread is at work (a bucket leaves `wanted` as its capture starts)

    @property
    def graphs(self) -> int:
        return sum(k.graphs for k in self.kinds)

    @property
    def wanted(self) -> int:
        return sum(k.wanted for k in self.kinds)


def read_graph_state(batcher: Token2WavBatcher) -> DeviceGraphState:
    """The state of an in-process batcher's graph holders (`Token2WavRunner.graph_holders`: those
    that capture; none on a CPU), holders of one kind added up, and the captures of its capture
    thread (`background_captures`, `capture_seconds`, `capture_gave_way_seconds`, `capturing`)."""
    kinds: dict[str, list[int]] = {}
    for g in batcher.runner.graph_holders():
        # len() of dicts the device and capture threads change: atomic under the GIL
        counts = (len(g.graphs), len(g.wanted), g.replays, g.deferred, g.fallbacks, g.covered)
        total = kinds.setdefault(g.what, [0] * len(counts))
        for i, n in enumerate(counts):
            total[i] += n
    return DeviceGraphState(tuple(GraphKindState(kind, *counts) for kind, counts in kinds.items()),
                            batcher.background_captures, batcher.capture_seconds,
                            batcher.capture_gave_way_seconds, batcher.capturing)


def graph_state_of(batcher) -> DeviceGraphState | None:
    """`read_graph_state` of an in-process batcher; a token2wav process (token2wav/process.py)
    keeps its child's as `graph_state`, as of the child's last message (each reply, and each
    capture beside the batches; None before the first)."""
    if isinstance(batcher, Token2WavBatcher):
        return read_graph_state(batcher)
    return getattr(batcher, "graph_state", None)
