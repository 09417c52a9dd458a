"""One token2wav batcher per device: ready chunk jobs of all active streams run together.

Streams submit one job at a time (`await batcher.submit(job, deadline)`); while the device is
busy, jobs pile up and the next batch is taken from them. Two lanes:

- first chunks (a stream's chunk 0: what a new listener is waiting for) are taken first, as a
  batch of their own: a first chunk waits for the batch that is running, never behind the queue.
  So that arrivals cannot starve the streams already playing, two first-lane batches never run
  back to back while other jobs wait;
- every other batch takes the most urgent jobs first: the job whose stream runs out of
  already-sent audio soonest (`deadline`, monotonic seconds; a first chunk is due now), at most
  `max_batch` jobs and, with `max_batch_tokens`, at most that many flow positions (prompt +
  tokens of each job, what the flow computes): this bounds one batch's device time, so a long
  render is split into batches that new first chunks can run between.

Non-streaming utterances (`is_offline_job`: one job for the whole utterance) go to the device's
offline collector instead (token2wav/offline_batcher.py: length-sorted, padded batches of whole utterances)
when `offline` limits are given; its batches run in the same device thread.

CUDA graphs of buckets first met by a request (graph_buckets.py: such a call runs without a
graph and leaves its bucket wanted) are captured in a capture thread of the batcher's own, one at
a time, while the device thread goes on running batches (a capture takes 1-2 s; no listener and no
new request waits for it), from `serve_captures` on: once the process has warmed up, since from
then on nothing may compile (compile_cache.stop_compiling). The warm-up's planned captures
(`capture_graphs`) run in that thread too, so two captures never overlap. Why not in the device
thread while idle, as before: docs/performance.md, "Captures off the request path". Before each
capture beside the batches the capture thread gives way to streams owed their first chunk
(token2wav/first_chunks.py): a capture competes with their LLM steps for the GIL and the card.

The device work runs in one executor thread, so the event loop never blocks and the model sees
one caller. The batcher keeps its own counters (`stage_stats`: batches, jobs, busy seconds) and a
bounded timeline of the batches it ran (`stats.timeline`), which metrics and benchmarks read.
"""
from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

from torch import Tensor

from ..compile_cache import resume_compiling, stop_compiling
from ..device_errors import device_error
from ..graph_buckets import CapturePlan, GraphBuckets, batch_sizes
from ..stage_stats import StageStats, timed_call
from ..switch_interval import shortened_switch_interval
from .first_chunks import FirstChunksOwed
from .offline import OfflineLimits, is_offline_job
from .offline_batcher import OfflineBatcher
from .runner import Token2WavRunner
from .schedule import ChunkSchedule
from .stream import Token2WavJob, Token2WavStream, request_noise

log = logging.getLogger(__name__)

FIRST_LANE = "first"
MAIN_LANE = "main"


@dataclass(order=True)
class _Pending:
    deadline: float
    seq: int
    job: Token2WavJob = field(compare=False)
    future: asyncio.Future = field(compare=False)
    submitted: float = field(compare=False)
    after_batch: int = field(compare=False)  # batches started before this job was submitted


@dataclass(frozen=True)
class JobRecord:
    stream: int        # id() of the job's stream
    chunk: int         # the job's chunk index in its stream (0: a first chunk)
    seq: int           # submission order in this batcher
    after_batch: int   # batches started before it was submitted (it ran in batch >= this)
    queued_s: float    # from submission to its batch's start


@dataclass(frozen=True)
class BatchRecord:
    """One batch the device thread ran."""
    index: int
    lane: str                   # FIRST_LANE or MAIN_LANE
    started: float              # monotonic seconds
    busy_s: float               # device-thread seconds of the batch
    flow_positions: int         # prompt + tokens over its jobs (what the flow computes)
    left_waiting: int           # live jobs still queued when it was taken
    jobs: tuple[JobRecord, ...]


@dataclass
class BatcherStats:
    max_batch_seen: int = 0
    first_lane_batches: int = 0
    timeline: deque = field(default_factory=lambda: deque(maxlen=1024))  # the latest BatchRecords


def flow_positions(job: Token2WavJob) -> int:
    return int(job.stream.prompt_token.shape[1]) + job.n_tokens


class Token2WavBatcher:
    def __init__(self, runner: Token2WavRunner, max_batch: int = 32, batching: bool = True,
                 max_batch_tokens: int | None = None, offline: OfflineLimits | None = None,
                 offline_wait_s: float = 0.01, capture_switch_interval_s: float | None = None):
        """offline: limits of the offline collector for non-streaming utterances (None: they run
        here, as one job each); offline_wait_s: how long its oldest job waits for others;
        capture_switch_interval_s: Python's thread switch interval while a capture runs beside the
        batches (switch_interval.py; None: Python's own)."""
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if max_batch_tokens is not None and max_batch_tokens < 1:
            raise ValueError(f"max_batch_tokens must be >= 1 or None, got {max_batch_tokens}")
        self.runner = runner
        self.max_batch = max_batch if batching else 1
        self.max_batch_tokens = max_batch_tokens
        self.capture_switch_interval_s = capture_switch_interval_s
        self.stage_stats = StageStats("token2wav_batch")
        self.stats = BatcherStats()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="token2wav")
        self._capture_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="token2wav-capture")
        self._capturing: asyncio.Task | None = None
        self._serving_captures = False  # `serve_captures` was called: the capture thread may run
        self._stopped_compiling = False
        self.on_capture: Callable[[], None] | None = None  # after each capture beside the batches (a token2wav child tells its server)
        self._first: list[_Pending] = []  # heaps by (deadline, seq)
        self._rest: list[_Pending] = []
        self._running: list[_Pending] = []  # the batch on the device now
        self._seq = itertools.count()
        self._started = 0  # batches taken so far
        self._last_lane = MAIN_LANE
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self.open_streams = 0  # streams between stream_started and stream_ended
        self.first_chunks = FirstChunksOwed()  # of those, the ones owed their first chunk
        self.background_captures = 0  # wanted CUDA graphs captured in the capture thread (a failed one included)
        self.capture_seconds = 0.0    # their time in the capture thread
        self.capture_gave_way_seconds = 0.0  # time they waited for first chunks (FirstChunksOwed.give_way)
        self._closed = False
        self.offline = (OfflineBatcher(runner, self.run_on_device, offline, offline_wait_s)
                        if offline is not None and batching else None)

    def stage_stats_list(self) -> list[StageStats]:
        return [self.stage_stats]

    def pick(self) -> "Token2WavBatcher":
        """Where an utterance's jobs go: this batcher (placement.Token2WavPool picks a device)."""
        return self

    def open_stream(self, prompt_token: Tensor, prompt_feat: Tensor, embedding: Tensor, *, seed: int | None,
                    segment: int, **options) -> Token2WavStream:
        """A stream whose jobs run here: its prompt moved to this device once, its NSF noise drawn
        there (`request_noise`), its vocoder carry the runner's vocoder's. options: Token2WavStream's
        stream, schedule, speed, prompt_key."""
        device = self.runner.device
        return Token2WavStream(prompt_token, prompt_feat, embedding, noise=request_noise(seed, segment, device),
                               device=device, causal_vocoder=self.runner.causal_vocoder, **options)

    def stream_started(self, stream: Token2WavStream) -> None:
        """A segment's stream started on this device (Utterance.run): counted in `open_streams`,
        and owed its first chunk until its first job is done."""
        self.open_streams += 1
        self.first_chunks.started(id(stream))

    def stream_ended(self, stream: Token2WavStream) -> None:
        """A segment's stream ended (finished, failed or cancelled)."""
        self.first_chunks.served(id(stream))
        if self.open_streams <= 0:  # a bookkeeping slip must not take the device down (nor hide a request's error)
            log.error("token2wav stream_ended without stream_started: ignored")
            return
        self.open_streams -= 1

    async def wait_dead(self) -> str:
        """Never returns: this batcher runs in the server's own process (a token2wav process can die)."""
        await asyncio.Event().wait()
        return ""

    async def submit(self, job: Token2WavJob, deadline: float) -> Tensor:
        """Run `job` (applying it to its stream) and return its samples (1-D float32, CPU).
        Cancelling the caller drops a job that has not started yet."""
        try:
            if self.offline is not None and is_offline_job(job):
                return await self.offline.submit(job)
            self._ensure_running()
            fut = asyncio.get_running_loop().create_future()
            entry = _Pending(deadline, next(self._seq), job, fut, time.monotonic(), self._started)
            heapq.heappush(self._first if job.index == 0 else self._rest, entry)
            self._wake.set()
            return await fut
        finally:
            if job.index == 0:
                self.first_chunks.served(id(job.stream))

    @property
    def pending(self) -> int:
        """Jobs submitted and not yet taken (cancelled ones excluded)."""
        return sum(not p.future.done() for p in itertools.chain(self._first, self._rest))

    async def run_on_device(self, fn, *args, items: int = 1):
        """fn(*args) in this device's token2wav thread (after the batches queued there), counted in
        stage_stats as one batch of `items` jobs; returns its result or raises what it raised."""
        result, seconds, ok = await asyncio.get_running_loop().run_in_executor(self._executor, timed_call, fn, *args)
        self.stage_stats.record(seconds, items, ok)
        self._capture_wanted()  # e.g. a bucket a speaker's prefix met
        if not ok:
            raise device_error(result)
        return result

    async def capture_graphs(self, plan: CapturePlan, *, defer: bool = False, and_wanted: bool = False) -> int:
        """The warm-up's CUDA graphs (warmup.py): the whole flow call's (token2wav/flow_graphs.py) and
        HiFT's (token2wav/hift_graphs.py) buckets of `plan`, and the cached flow call's
        (token2wav/slot_calls.py) at the plan's stream counts x its first four new-token buckets (a
        chunk's hop plus its recomputed partial encoder chunk; a speaker's prefix) x every key
        bucket that holds them. Captured now, in the capture thread (`and_wanted`: then whatever
        else is wanted, e.g. what the warm-up's own requests met); logs one line per graph kind
        and returns how many graphs were new (0 without graphs). The plan's cover buckets
        (`CapturePlan.with_covers`) come first. `defer`: marked wanted instead, for the capture
        thread to capture beside the batches once `serve_captures` is called; returns 0. Without
        `defer`, the compiled code of every batch size runs first (GraphBuckets.compile_shapes), so
        that these captures and every later one record compiled kernels."""
        slot_calls = self.runner.slot_calls
        slot_plan = () if slot_calls is None else (
            (tuple(batch_sizes(plan.max_streams)), range(slot_calls.min_step, 4 * slot_calls.min_step + 1,
                                                        slot_calls.min_step)),)
        hift_plan = plan.causal_hift if self.runner.causal_vocoder else plan.hift
        kinds = [(graphs, pairs) for graphs, pairs in ((self.runner.flow_graphs, plan.with_covers(plan.flow)),
                                                         (self.runner.hift_graphs, plan.with_covers(hift_plan)),
                                                         (slot_calls, slot_plan))
                 if graphs is not None and graphs.cuda_graphs]
        if defer:
            wanted = sum(graphs.want(streams, lengths) for graphs, pairs in kinds for streams, lengths in pairs)
            if wanted:
                log.info("warm-up: %d planned CUDA graph(s) left to the capture thread, after SERVING", wanted)
            return 0

        def capture() -> int:
            self._compile_shapes(kinds, plan)  # first: the captures below and every later one record compiled code
            new = 0
            for graphs, pairs in kinds:
                t, n = time.perf_counter(), 0
                for streams, lengths in pairs:
                    n += graphs.warmup(streams, lengths)
                log.info("warm-up: %d %s CUDA graph(s) captured in %.1f s", n, graphs.what, time.perf_counter() - t)
                new += n
            t = time.perf_counter()
            if and_wanted and (left := self.runner.capture_all_wanted()):
                log.info("warm-up: %d CUDA graph(s) its requests wanted captured in %.1f s", left, time.perf_counter() - t)
                new += left
            return new
        return await self._in_capture_thread(capture)  # after any capture under way: one thread, one at a time

    def _compile_shapes(self, kinds: list[tuple[GraphBuckets, tuple]], plan: CapturePlan) -> None:
        """Every batch size's compiled programs made before serving (GraphBuckets.compile_shapes):
        each graph kind's buckets at the shortest and longest length of its planned pairs, and the
        compiled estimator's own (configs without whole-flow graphs run it in per-step graphs) at
        the plan's flow extremes in frames."""
        def extremes(pairs) -> list[int]:
            return sorted({n for _, lengths in pairs for n in (lengths[0], lengths[-1])})

        runs = [(graphs, extremes(pairs)) for graphs, pairs in kinds]
        if (estimator := self.runner.estimator) in self.runner.graph_holders():
            ratio = self.runner.flow.dims.token_mel_ratio
            runs.append((estimator, [ratio * n for n in extremes(plan.flow)]))
        for graphs, lengths in runs:
            t = time.perf_counter()
            if ran := graphs.compile_shapes(lengths):
                log.info("warm-up: %s compiled for every batch size (%d buckets run) in %.1f s", graphs.what, ran,
                         time.perf_counter() - t)

    async def capture_all_wanted(self) -> int:
        """Every wanted CUDA graph captured now, in the capture thread (after any capture under way);
        how many captures ran."""
        return await self._in_capture_thread(self.runner.capture_all_wanted)

    def _ensure_running(self) -> None:
        loop = asyncio.get_running_loop()
        if self._task is None or self._task.done() or self._task.get_loop() is not loop:
            self._wake = asyncio.Event()
            self._first = [p for p in self._first if p.future.get_loop() is loop]
            self._rest = [p for p in self._rest if p.future.get_loop() is loop]
            heapq.heapify(self._first)
            heapq.heapify(self._rest)
            self._task = loop.create_task(self._loop(), name="token2wav-batcher")

    @staticmethod
    def _drop_cancelled(heap: list[_Pending]) -> None:
        while heap and heap[0].future.done():
            heapq.heappop(heap)

    def _take_batch(self) -> tuple[str, list[_Pending]]:
        for heap in (self._first, self._rest):
            self._drop_cancelled(heap)
        if self._first and (self._last_lane != FIRST_LANE or not self._rest):
            lane, heaps = FIRST_LANE, (self._first,)
        else:
            lane, heaps = MAIN_LANE, (self._first, self._rest)
        batch, streams, deferred, positions = [], set(), [], 0
        while len(batch) < self.max_batch:
            live = [h for h in heaps if h]
            if not live:
                break
            heap = min(live, key=lambda h: h[0])
            p = heap[0]
            if p.future.done():  # cancelled while waiting
                heapq.heappop(heap)
                continue
            cost = flow_positions(p.job)
            if batch and self.max_batch_tokens is not None and positions + cost > self.max_batch_tokens:
                break
            heapq.heappop(heap)
            if id(p.job.stream) in streams:  # a stream's chunks are sequential
                deferred.append((heap, p))
                continue
            streams.add(id(p.job.stream))
            batch.append(p)
            positions += cost
        for heap, p in deferred:
            heapq.heappush(heap, p)
        if batch:
            self._last_lane = lane
        return lane, batch

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._wake.wait()
            self._wake.clear()
            while True:
                lane, batch = self._take_batch()
                if not batch:
                    break
                index, self._started = self._started, self._started + 1
                started = time.monotonic()
                left = self.pending
                jobs = [p.job for p in batch]
                self._running = batch  # close() must not leave these callers waiting
                for job in jobs:
                    job.timing.started = started
                outs, seconds, ok = await loop.run_in_executor(self._executor, timed_call,
                                                               self.runner.run_many, jobs)
                self._record(index, lane, started, seconds, left, batch, ok)
                if not ok:  # a failed batch fails its callers, not the batcher
                    log.error("token2wav batch of %d failed", len(jobs), exc_info=outs)
                    for p in batch:
                        if not p.future.done():
                            p.future.set_exception(device_error(outs))
                    continue
                for p, out in zip(batch, outs):
                    if not p.future.done():
                        p.future.set_result(out)
                self._capture_wanted()
                # let the streams just served plan and submit their next chunk before the next
                # batch is taken, so they batch together instead of alternating
                await asyncio.sleep(0)

    @property
    def capturing(self) -> bool:
        """The capture thread is at work (a bucket leaves its holder's `wanted` when its capture starts)."""
        return self._capturing is not None and not self._capturing.done()

    def _capture_wanted(self) -> None:
        """Start capturing the CUDA graphs the device's calls wanted, in the capture thread, unless
        that is under way or nothing is wanted."""
        if self._closed or not self._serving_captures or not self.runner.wants_capture or self.capturing:
            return
        self._capturing = asyncio.get_running_loop().create_task(self._capture_while_wanted(), name="token2wav-capture")
        if self.on_capture is not None:  # and once more when the round is over (`capturing` false again)
            self._capturing.add_done_callback(lambda _: self.on_capture())

    async def serve_captures(self) -> None:
        """From now on (the process warmed up: every replica or pool device of it) the capture thread
        captures what calls want, beside the batches. Where this device captures CUDA graphs,
        nothing compiles in the process from here on (compile_cache.stop_compiling): a compile in
        the capture thread would break the compiled calls of the others. Without it (no warm-up)
        wanted graphs are not captured: their calls run without a graph."""
        if self._serving_captures or self._closed:
            return
        if self.runner.graph_holders():
            stop_compiling()
            self._stopped_compiling = True
        self._serving_captures = True
        self._capture_wanted()

    async def _capture_while_wanted(self) -> None:
        """Wanted graphs captured one by one (Token2WavRunner.capture_wanted), until none is wanted.
        A capture's own failure is the runner's to log (its bucket then runs without a graph);
        anything else out of it is logged here and stops this round, never the batcher."""
        while not self._closed and self.runner.wants_capture:
            gave_way = await self.first_chunks.give_way()
            self.capture_gave_way_seconds += gave_way
            if self._closed:
                return
            try:
                with shortened_switch_interval(self.capture_switch_interval_s):
                    captured, seconds = await self._in_capture_thread(self.runner.capture_wanted, timed=True)
            except Exception:  # noqa: BLE001
                log.exception("capturing a wanted CUDA graph failed; its calls keep running without one")
                return
            if not captured:
                return
            self.background_captures += 1
            self.capture_seconds += seconds
            if self.on_capture is not None:
                self.on_capture()
            log.info("CUDA graph captured beside the batches: %.1f s, after giving way to first chunks for %.2f s "
                     "(%d so far; %d calls ran without a graph waiting for theirs, %d still wanted)", seconds, gave_way,
                     self.background_captures,
                     sum(g.deferred for g in self.runner.graph_holders()),
                     sum(len(g.wanted) for g in self.runner.graph_holders()))

    async def _in_capture_thread(self, fn, timed: bool = False):
        """fn() in the capture thread: its result (and seconds, if `timed`), or what it raised."""
        result, seconds, ok = await asyncio.get_running_loop().run_in_executor(self._capture_executor, timed_call, fn)
        if not ok:
            raise result
        return (result, seconds) if timed else result

    def _record(self, index: int, lane: str, started: float, seconds: float, left: int,
                batch: list[_Pending], ok: bool) -> None:
        self.stage_stats.record(seconds, len(batch), ok)
        st = self.stats
        st.max_batch_seen = max(st.max_batch_seen, len(batch))
        st.first_lane_batches += lane == FIRST_LANE
        jobs = tuple(JobRecord(id(p.job.stream), p.job.index, p.seq, p.after_batch, started - p.submitted)
                     for p in batch)
        st.timeline.append(BatchRecord(index, lane, started, seconds, sum(flow_positions(p.job) for p in batch),
                                       left, jobs))

    async def prepare_speaker(self, prompt_token: Tensor, prompt_feat: Tensor, embedding: Tensor,
                              speaker_id: str) -> bool:
        """A registered speaker's flow prompt prefix computed and cached now, in the device thread
        (Token2WavRunner.prepare_speaker); False where the runner keeps none."""
        if not self.runner.flow_cache:
            return False
        ratio = self.runner.flow.dims.token_mel_ratio
        stream = Token2WavStream(prompt_token, prompt_feat, embedding, schedule=ChunkSchedule(token_mel_ratio=ratio),
                                 device=self.runner.device, prompt_key=speaker_id)
        return await self.run_on_device(self.runner.prepare_speaker, stream, items=0)

    def forget_speaker(self, speaker_id: str) -> None:
        """Drop a deleted speaker's cached prompt prefix (it would otherwise stay until evicted)."""
        self.runner.speaker_prefixes.drop(speaker_id)

    async def close(self) -> None:
        self._closed = True  # no capture starts after this
        if self.offline is not None:
            await self.offline.close()
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        for p in itertools.chain(self._first, self._rest, self._running):
            if not p.future.done():
                p.future.cancel()
        self._first.clear()
        self._rest.clear()
        self._running = []
        if self._capturing is not None:
            self._capturing.cancel()
        self._executor.shutdown(wait=True)
        # a capture under way (1-2 s) finishes first; awaited off the loop, which keeps serving meanwhile
        await asyncio.get_running_loop().run_in_executor(None, self._capture_executor.shutdown)
        if self._stopped_compiling:
            self._stopped_compiling = False
            resume_compiling()
