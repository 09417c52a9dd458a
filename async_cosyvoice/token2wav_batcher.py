"""One token2wav batcher per device: ready chunk jobs of all active streams run together.

Streams submit one job at a time (`await batcher.submit(job, deadline)`); while the device is
busy, jobs pile up, and the next batch takes the most urgent ones first: the job whose stream
runs out of already-sent audio soonest (`deadline`, monotonic seconds; a first chunk is due
now). The device work runs in one executor thread, so the event loop never blocks and the model
sees one caller.
"""
from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from torch import Tensor

from .token2wav import Token2WavJob, Token2WavRunner

log = logging.getLogger(__name__)


@dataclass(order=True)
class _Pending:
    deadline: float
    seq: int
    job: Token2WavJob = field(compare=False)
    future: asyncio.Future = field(compare=False)


@dataclass
class BatcherStats:
    batches: int = 0
    jobs: int = 0
    max_batch_seen: int = 0


class Token2WavBatcher:
    def __init__(self, runner: Token2WavRunner, max_batch: int = 32, batching: bool = True):
        self.runner = runner
        self.max_batch = max_batch if batching else 1
        self.stats = BatcherStats()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="token2wav")
        self._heap: list[_Pending] = []
        self._running: list[_Pending] = []  # the batch on the device now
        self._seq = itertools.count()
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None

    def pick(self) -> "Token2WavBatcher":
        """Where an utterance's jobs go: this batcher (placement.Token2WavPool picks a device)."""
        return self

    async def submit(self, job: Token2WavJob, deadline: float) -> Tensor:
        """Run `job` (applying it to its stream) and return its samples (1-D float32, CPU).
        Cancelling the caller drops a job that has not started yet."""
        self._ensure_running()
        fut = asyncio.get_running_loop().create_future()
        heapq.heappush(self._heap, _Pending(deadline, next(self._seq), job, fut))
        self._wake.set()
        return await fut

    def _ensure_running(self) -> None:
        loop = asyncio.get_running_loop()
        if self._task is None or self._task.done() or self._task.get_loop() is not loop:
            self._wake = asyncio.Event()
            self._heap = [p for p in self._heap if p.future.get_loop() is loop]
            self._task = loop.create_task(self._loop(), name="token2wav-batcher")

    def _take_batch(self) -> list[_Pending]:
        batch, seen = [], set()
        deferred = []
        while self._heap and len(batch) < self.max_batch:
            p = heapq.heappop(self._heap)
            if p.future.done():  # cancelled while waiting
                continue
            if id(p.job.stream) in seen:  # a stream's chunks are sequential
                deferred.append(p)
                continue
            seen.add(id(p.job.stream))
            batch.append(p)
        for p in deferred:
            heapq.heappush(self._heap, p)
        return batch

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._wake.wait()
            self._wake.clear()
            while batch := self._take_batch():
                jobs = [p.job for p in batch]
                self._running = batch  # close() must not leave these callers waiting
                try:
                    outs = await loop.run_in_executor(self._executor, self.runner.run_many, jobs)
                except Exception as e:  # a failed batch fails its callers, not the batcher
                    log.exception("token2wav batch of %d failed", len(jobs))
                    for p in batch:
                        if not p.future.done():
                            p.future.set_exception(e)
                    continue
                self.stats.batches += 1
                self.stats.jobs += len(jobs)
                self.stats.max_batch_seen = max(self.stats.max_batch_seen, len(jobs))
                for p, out in zip(batch, outs):
                    if not p.future.done():
                        p.future.set_result(out)
                # let the streams just served plan and submit their next chunk before the next
                # batch is taken, so they batch together instead of alternating
                await asyncio.sleep(0)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        for p in self._heap + self._running:
            if not p.future.done():
                p.future.cancel()
        self._heap.clear()
        self._running = []
        self._executor.shutdown(wait=True)
