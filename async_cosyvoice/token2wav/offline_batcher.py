"""The offline collector: non-streaming utterances of one device, rendered in length-sorted batches.

A non-streaming utterance submits its one job when its LM request is done (`submit`). Jobs wait
here until a batch is worth taking, then `render_offline` runs them in the device's token2wav
thread (shared with the streaming batcher, so the device has one caller):

- take when the pending jobs fill a batch (max_batch jobs or max_frames mel frames), or when the
  oldest has waited `max_wait_s` (a lone request waits that long, then runs alone: the
  one-at-a-time render); jobs that arrive while a batch runs are taken together after it;
- a batch is the length group (`padded_groups`: sorted, at most max_batch items and max_frames
  padded frames, lengths within length_ratio) holding the oldest pending job, so no job starves
  and the other groups can still grow;
- a job whose caller went away (cancelled request) is dropped before it runs.

Event-driven: the collector sleeps on an asyncio.Event (new job) or the oldest job's deadline.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Awaitable, Callable

from torch import Tensor

from .offline import OfflineLimits, OfflineStats, padded_groups, render_offline
from .runner import Token2WavRunner
from .stream import Token2WavJob

log = logging.getLogger(__name__)

# run_on_device(fn, *args, items=n): fn(*args) in the device's token2wav thread -> its result
DeviceRun = Callable[..., Awaitable]


@dataclass(eq=False)
class _Pending:
    job: Token2WavJob
    future: asyncio.Future
    arrived: float
    frames: int  # prompt + target mel frames (what the flow computes)


class OfflineBatcher:
    def __init__(self, runner: Token2WavRunner, run_on_device: DeviceRun, limits: OfflineLimits = OfflineLimits(),
                 max_wait_s: float = 0.01):
        if max_wait_s < 0:
            raise ValueError(f"max_wait_s must be >= 0, got {max_wait_s}")
        self.runner = runner
        self.limits = limits
        self.max_wait_s = max_wait_s
        self.stats = OfflineStats()
        self._run_on_device = run_on_device
        self._pending: list[_Pending] = []  # arrival order
        self._running: list[_Pending] = []
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None

    @property
    def pending(self) -> int:
        return sum(not p.future.done() for p in self._pending)

    async def submit(self, job: Token2WavJob) -> Tensor:
        """Render a non-streaming utterance's job with others; returns its samples (1-D float32, CPU).
        Cancelling the caller drops the job if it has not started."""
        self._ensure_running()
        fut = asyncio.get_running_loop().create_future()
        frames = job.stream.schedule.token_mel_ratio * (int(job.stream.prompt_token.shape[1]) + job.n_tokens)
        self._pending.append(_Pending(job, fut, time.monotonic(), frames))
        self._wake.set()
        return await fut

    def _ensure_running(self) -> None:
        loop = asyncio.get_running_loop()
        if self._task is None or self._task.done() or self._task.get_loop() is not loop:
            self._wake = asyncio.Event()
            self._pending = [p for p in self._pending if p.future.get_loop() is loop]
            self._task = loop.create_task(self._loop(), name="token2wav-offline")

    def _wait_s(self) -> float:
        """How long to wait for more jobs before taking a batch (0: take one now)."""
        if len(self._pending) >= self.limits.max_batch or sum(p.frames for p in self._pending) >= self.limits.max_frames:
            return 0.0
        return max(0.0, self._pending[0].arrived + self.max_wait_s - time.monotonic())

    def _take(self) -> list[_Pending]:
        """The length group of the oldest pending job, removed from the pending list."""
        groups = padded_groups([p.frames for p in self._pending], self.limits)
        group = next(g for g in groups if 0 in g)
        taken = set(group)
        batch = [self._pending[i] for i in sorted(group)]
        self._pending = [p for i, p in enumerate(self._pending) if i not in taken]
        return batch

    async def _loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while True:
                self._pending = [p for p in self._pending if not p.future.done()]
                if not self._pending:
                    break
                wait = self._wait_s()
                if wait > 0:
                    try:
                        await asyncio.wait_for(self._wake.wait(), wait)
                    except TimeoutError:
                        pass
                    self._wake.clear()
                    continue
                batch = self._running = self._take()
                try:
                    outs = await self._run_on_device(render_offline, self.runner, [p.job for p in batch],
                                                     self.limits, self.stats, items=len(batch))
                except Exception as e:  # a failed batch fails its callers, not the collector
                    log.error("offline token2wav batch of %d failed", len(batch), exc_info=e)
                    for p in batch:
                        if not p.future.done():
                            p.future.set_exception(e)
                    continue
                finally:
                    self._running = []
                for p, out in zip(batch, outs):
                    if not p.future.done():
                        p.future.set_result(out)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        for p in self._pending + self._running:
            if not p.future.done():
                p.future.cancel()
        self._pending, self._running = [], []
