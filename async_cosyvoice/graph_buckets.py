"""Calls captured as CUDA graphs by (batch, length) bucket: the whole flow call (token2wav/flow_graphs.py),
HiFT (token2wav/hift_graphs.py), the cached flow call (token2wav/slot_calls.py) and the flow
estimator's single steps (estimator/torch_backend.py).

A call of batch B (streams; estimator rows) and length L takes the smallest batch bucket >= B and
L rounded up (`length_bucket`, steps of >= `min_step`: <= 12.5 % padding), for buckets of at most
`max_bucket_size` batch x length (None: no limit), at most `max_graphs` graphs, and only while the
device keeps `GRAPH_MEMORY_RESERVE` of its memory free; past that the caller runs it without a graph
(a graph's pool keeps its memory for good, and graphs of ever longer calls fragment it: CosyVoice3's
vocoder, which re-renders all the mel so far, filled an 80 GB card with graphs at 64 streams).

Captures never run on a request's path. `warmup` captures the start-up plan's buckets ahead. A
call of a bucket that has no graph yet runs in a captured larger bucket's graph where one adds at
most `max_cover_extra` batch x length (`cover`: padding is exact, so this is the same computation
with more padding, and a graph is far faster than the launch-bound call without one at small
batches), else the bucket's function without a graph on its inputs padded to the bucket (the same
computation the graph would replay); either way it records the bucket as wanted (`want` marks
planned buckets so without a call), and `capture_wanted` captures the oldest wanted bucket. The
token2wav stage calls it in a capture thread of its own, beside the device thread that keeps
running the batches (token2wav/batcher.py): a capture is recorded on a stream of
its own in `thread_local` mode (cuda_graph.py), so the other thread's calls, this holder's
included, go on meanwhile (with compiled regions a flow capture takes 1-2 s; why not on first use
or while idle: docs/performance.md, "Captures off the request path"). A capture that fails (e.g.
out of memory) is logged, and its bucket runs without a graph from then on, as one past the
buckets. `wanted` and `_failed` change under a lock: the device thread adds wanted buckets while
the capture thread takes them.

All graphs share one memory pool, so each call's outputs are overwritten by the next replay:
callers copy out what they keep. Off CUDA (`cuda_graphs=False`) the call runs on inputs padded to
the bucket, without a graph: the tests use it to check that padding changes nothing.

A subclass says what runs in a bucket (`_fn`), the static shape of each input there
(`_buffer_shape`) and inputs to capture it with (`_example`, for `warmup` and `capture_wanted`).
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import Tensor

from .cuda_graph import CapturedCall, fill_corner
from .startup import CAPTURES

log = logging.getLogger(__name__)

DEFAULT_STREAM_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
GRAPH_MEMORY_RESERVE = 0.2  # fraction of the device's memory that new graphs never take: eager calls need it
Bucket = tuple[int, int]  # (batch, length)


def length_bucket(length: int, min_step: int = 64) -> int:
    """length rounded up to its bucket: a multiple of max(min_step, 2^(⌊log2 length⌋ − 3)), so at
    most 12.5 % of it (and at least `min_step`) is padding."""
    if length < 1:
        raise ValueError(f"length must be >= 1, got {length}")
    step = max(min_step, 1 << max(0, length.bit_length() - 4))
    return -(-length // step) * step


def batch_bucket(batch: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket >= batch, or None if the batch is larger than every bucket."""
    for b in sorted(buckets):
        if b >= batch:
            return b
    return None


def room_for_graphs(free_bytes: int, total_bytes: int, reserve: float = GRAPH_MEMORY_RESERVE) -> bool:
    """Whether a new graph may be captured with `free_bytes` of the device's `total_bytes` free."""
    return free_bytes >= reserve * total_bytes


def batch_sizes(largest: int) -> list[int]:
    """1, 2, 4, … and `largest` itself."""
    sizes, n = [], 1
    while n < largest:
        sizes.append(n)
        n *= 2
    return sizes + [largest]


@dataclass(frozen=True)
class CapturePlan:
    """The graphs the warm-up captures, as (stream counts, lengths) pairs per graph kind: the flow's
    lengths are tokens (prompt + target), HiFT's mel frames. The token2wav stage maps each pair to
    its buckets (graph_buckets.GraphBuckets.buckets) and captures each bucket once."""
    flow: tuple[tuple[tuple[int, ...], range], ...]
    hift: tuple[tuple[tuple[int, ...], range], ...]         # CosyVoice2's HiFT: a chunk's frames
    causal_hift: tuple[tuple[tuple[int, ...], range], ...]  # CosyVoice3's CausalHiFT: all the mel so far
    covers: tuple[int, ...] = ()  # stream counts whose buckets of a kind's longest length (and half) come first

    @property
    def max_streams(self) -> int:
        return max((max(streams) for streams, _ in self.flow + self.hift + self.causal_hift), default=1)

    def with_covers(self, pairs: tuple[tuple[tuple[int, ...], range], ...]
                    ) -> tuple[tuple[tuple[int, ...], Sequence[int]], ...]:
        """`pairs` of one graph kind (one of the fields above) after its cover buckets: `covers` x
        the longest length of the pairs and half of it, the graphs that calls of buckets not yet
        captured run in (GraphBuckets.cover)."""
        if not self.covers or not pairs:
            return pairs
        longest = max(lengths[-1] for _, lengths in pairs)
        return ((self.covers, (longest // 2, longest)),) + pairs


class GraphBuckets:
    what = "call"     # for the log: "capturing the <what> CUDA graph for batch B x T <unit>"
    unit = "positions"
    compiled = False  # whether `_fn` runs torch.compile'd code (`compile_shapes`)

    def __init__(self, device: torch.device, *, cuda_graphs: bool | None, batch_buckets: Sequence[int],
                 min_step: int, max_bucket_size: int | None, max_graphs: int, min_length: int = 1,
                 max_cover_extra: int = 0):
        """min_length: the shortest length a bucket has (shorter calls are padded to it);
        max_cover_extra: the most batch x length a captured larger bucket may add to a call whose
        own bucket has no graph yet, for it to run in that graph (`cover`; 0: never)."""
        self.device = device
        self.cuda_graphs = device.type == "cuda" if cuda_graphs is None else cuda_graphs
        if self.cuda_graphs and device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device; the {self.what} is on {device}")
        self.batch_buckets = tuple(sorted(batch_buckets))  # streams (flow, HiFT) or rows (estimator)
        self.min_step = min_step
        self.max_bucket_size = max_bucket_size
        self.max_graphs = max_graphs
        self.min_length = min_length
        self.max_cover_extra = max_cover_extra
        self.graphs: dict[Bucket, CapturedCall] = {}
        self._pool = None
        self._warned_full = False
        self._warned_memory = False
        self._lock = threading.Lock()  # over `wanted` (and `_failed`): two threads change them
        self.wanted: dict[Bucket, None] = {}  # buckets called before their graph, oldest first
        self._failed: set[Bucket] = set()     # buckets whose capture failed: they run without a graph
        self.replays = 0    # calls that ran in a graph (or, off CUDA, padded to a bucket)
        self.deferred = 0   # calls that ran padded without a graph while their bucket waited for its capture
        self.fallbacks = 0  # calls past the buckets (or of a bucket whose capture failed)
        self.covered = 0    # calls that ran in a larger bucket's graph while theirs waited (counted in replays too)

    def bucket(self, batch: int, length: int) -> Bucket | None:
        """The bucket a call of `batch` streams (rows) of `length` runs in: its own; while its own
        has no graph yet, a captured larger one that covers it (`cover`), its own then wanted; None:
        it runs without a graph."""
        own = self._bucket_of(batch, length)
        if own is None or not self.cuda_graphs or own in self.graphs:
            return own
        room = self._has_room(own)
        if (cover := self.cover(own)) is not None:
            if room:
                self._want(own)
            self.covered += 1
            return cover
        return own if room else None

    def cover(self, bucket: Bucket) -> Bucket | None:
        """The smallest captured bucket at least as large as `bucket` in batch and length that adds
        at most `max_cover_extra` to its batch x length, or None. Padding to it is exact, as to a
        call's own bucket; it is the same computation with more padding. Why: a call whose bucket
        has no graph yet runs its padded function without one, launch-bound at small batches
        (on the H200 the estimator at 2 rows x 336 frames: 18.9 ms a step eager, 4.2 ms in a
        graph), so a graph of a somewhat larger call runs it sooner than its own function would."""
        if self.max_cover_extra <= 0:
            return None
        B, T = bucket
        fits = [(b * t, (b, t)) for b, t in tuple(self.graphs)  # a copy: the capture thread adds graphs
                if b >= B and t >= T and b * t - B * T <= self.max_cover_extra]
        return min(fits)[1] if fits else None

    def _has_room(self, bucket: tuple[int, ...]) -> bool:
        """Whether `bucket` has a graph or may capture one (fewer than max_graphs so far, and the
        device's memory reserve free)."""
        if not self.cuda_graphs or bucket in self.graphs:
            return True
        if bucket in self._failed:
            return False
        if len(self.graphs) >= self.max_graphs:
            if not self._warned_full:
                self._warned_full = True
                log.warning("%d %s CUDA graphs captured (max_graphs): calls of new shapes run without a graph",
                            len(self.graphs), self.what)
            return False
        free, total = torch.cuda.mem_get_info(self.device)
        if not room_for_graphs(free, total):
            if not self._warned_memory:
                self._warned_memory = True
                log.warning("%d %s CUDA graphs captured; %.1f of %.1f GiB free is under the %.0f %% kept for calls "
                            "without a graph: calls of new shapes run without one", len(self.graphs), self.what,
                            free / 2**30, total / 2**30, 100 * GRAPH_MEMORY_RESERVE)
            return False
        return True

    def _bucket_of(self, batch: int, length: int) -> Bucket | None:
        """`bucket` by the rule alone (max_graphs not counted)."""
        B = batch_bucket(batch, self.batch_buckets)
        T = length_bucket(max(length, self.min_length), self.min_step)
        if B is None or (self.max_bucket_size is not None and B * T > self.max_bucket_size):
            return None
        return B, T

    def buckets(self, streams: Sequence[int], lengths: Sequence[int]) -> list[Bucket]:
        """The distinct buckets of these stream counts x lengths, in order (those past the buckets left out)."""
        found: dict[Bucket, None] = {}
        for b in streams:
            for t in lengths:
                bucket = self._bucket_of(b, t)
                if bucket is not None:
                    found[bucket] = None
        return list(found)

    def warmup(self, streams: Sequence[int], lengths: Sequence[int]) -> int:
        """Capture the buckets of these stream counts x lengths now (`buckets`). Returns how many
        graphs were new."""
        new = 0
        if not self.cuda_graphs:
            return new
        for bucket in self.buckets(streams, lengths):
            if bucket in self.graphs or not self._has_room(bucket):  # captured, or max_graphs reached
                continue
            with torch.inference_mode():
                self._capture(bucket, self._example(bucket))
            new += 1
        return new

    def compile_shapes(self, lengths: Sequence[int]) -> int:
        """Where `_fn` runs compiled code: run the bucket of every batch bucket x `lengths` once
        without a graph (those past max_bucket_size left out), so that torch.compile has made the
        programs that every batch size needs before serving. Returns how many buckets ran.

        Why: a compiled region traced at one batch size may need another program at another (on
        the CPU the flow estimator's resnet convolutions guard on 2 <= rows <= 15), and once the
        process stops compiling (compile_cache.stop_compiling, when it serves) a call that needs a
        new program runs eagerly, and so does every replay of a graph captured of it. With the
        warm-up at 1 stream only, an H200's 16- and 32-stream token2wav batches took 1144 and
        687 ms, with this 364 and 395 ms (docs/performance.md, "Every batch size compiled before
        serving")."""
        if not self.compiled:
            return 0
        buckets = self.buckets(self.batch_buckets, lengths)
        with torch.inference_mode():
            for bucket in buckets:
                self._fn(bucket)(**self._example(bucket))
        return len(buckets)

    def want(self, streams: Sequence[int], lengths: Sequence[int]) -> int:
        """Mark the buckets of these stream counts x lengths wanted (`buckets`; those captured or
        without room left out), for `capture_wanted` to capture later. Returns how many were new."""
        if not self.cuda_graphs:
            return 0
        new = [b for b in self.buckets(streams, lengths) if b not in self.graphs and self._has_room(b)]
        with self._lock:
            new = [b for b in new if b not in self.wanted]
            self.wanted.update(dict.fromkeys(new))
        return len(new)

    def capture_wanted(self) -> bool:
        """Capture the oldest wanted bucket that still has room (`_has_room`; those without are
        dropped), from `_example` inputs. Returns whether a capture ran (False: nothing was
        wanted). A failed capture is logged and its bucket runs without a graph from then on.
        One thread captures at a time (all graphs share one memory pool); another may run this
        object's calls meanwhile, a call of the bucket being captured included (it runs without
        the graph until the capture is done)."""
        while True:
            with self._lock:
                if not self.wanted:
                    return False
                bucket = next(iter(self.wanted))
                del self.wanted[bucket]
            if bucket in self.graphs or not self._has_room(bucket):
                continue
            try:
                with torch.inference_mode():
                    self._capture(bucket, self._example(bucket))
            except Exception as e:  # noqa: BLE001 — e.g. CUDA out of memory: the bucket runs without a graph
                with self._lock:
                    self._failed.add(bucket)
                log.warning("capturing the %s CUDA graph for batch %s %s failed (%s: %s): its calls run without "
                            "a graph", self.what, " x ".join(map(str, bucket)), self.unit, type(e).__name__, e)
            return True

    def _run(self, bucket: Bucket, inputs: dict[str, Tensor]) -> Any:
        """The bucket's call on `inputs` (each at most the bucket's shape): its graph replayed, or
        the bucket's function on inputs padded to the bucket: off CUDA, and on CUDA while the
        bucket waits for its capture (recorded in `wanted`)."""
        graph = self.graphs.get(bucket) if self.cuda_graphs else None
        if graph is not None:
            self.replays += 1
            return graph(**inputs)
        if self.cuda_graphs:
            self.deferred += 1
            self._want(bucket)
        else:
            self.replays += 1
        return self._fn(bucket)(**self._padded(bucket, inputs))

    def _want(self, bucket: Bucket) -> None:
        """A call met `bucket` without its graph: the capture thread is to capture it."""
        with self._lock:
            if bucket not in self._failed:
                self.wanted[bucket] = None

    def _capture(self, bucket: Bucket, inputs: dict[str, Tensor]) -> CapturedCall:
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        log.info("capturing the %s CUDA graph for batch %s %s", self.what, " x ".join(map(str, bucket)), self.unit)
        buffers = self._buffers(bucket, inputs)
        with CAPTURES.capturing(self.what):
            graph = CapturedCall(self._fn(bucket), buffers, self.device, self._pool)
        self.graphs[bucket] = graph  # complete: the device thread's next call of the bucket replays it
        return graph

    def _padded(self, bucket: Bucket, inputs: dict[str, Tensor]) -> dict[str, Tensor]:
        """`inputs` padded to the bucket as a graph's buffers hold them (`_buffers`: shapes, dtypes)."""
        buffers = self._buffers(bucket, inputs)
        for name, v in inputs.items():
            fill_corner(buffers[name], v)
        return buffers

    def _buffers(self, bucket: Bucket, inputs: dict[str, Tensor]) -> dict[str, Tensor]:
        """The bucket's static input buffers, zeros (what padding holds)."""
        return {name: torch.zeros(self._buffer_shape(name, bucket, v), dtype=v.dtype, device=self.device)
                for name, v in inputs.items()}

    # -- what a subclass says

    def _fn(self, bucket: Bucket) -> Callable[..., Any]:
        raise NotImplementedError

    def _buffer_shape(self, name: str, bucket: Bucket, example: Tensor) -> tuple[int, ...]:
        raise NotImplementedError

    def _example(self, bucket: Bucket) -> dict[str, Tensor]:
        raise NotImplementedError
