"""The built-in speech-token engine: continuous batching over a slot KV cache, RAS on the device.

One step thread runs the step loop: it asks the scheduler for a plan (decode every running
stream, fill the rest of the token budget with prompt chunks), runs it, commits the sampled
tokens and hands them to the requests' queues on the event loop, then plans the next step at
once. The event loop is not on the way from one step to the next: when it was (each step awaited
from the loop), every step also waited for the loop to get the GIL and a turn, which under load
(the token2wav thread and the gRPC streams busy) cost as much as the step itself (docs/performance.md,
"The LM's step loop in its own thread"). New requests, aborts and bistream text join between steps,
under the engine's lock, which guards the scheduler and every sequence's state (the step itself
runs outside it). An abort frees the slot at once. Each request's `generate()` awaits its own
queue: nobody polls, nobody sleeps; an idle step thread waits on an event.

Bistream requests (`generate_bistream`) run in the same steps: a task per request moves the
caller's text pieces into the request's `BistreamSchedule` (bistream.py) and wakes the step thread
when they complete an input; a request that waits for text keeps its slot and KV cache but is
left out of the steps, so it never holds up the others.
"""
from __future__ import annotations

import asyncio
import logging
import numbers
import threading
from contextlib import aclosing
from dataclasses import dataclass
from typing import AsyncIterator
from typing import Sequence as Seq

import torch

from ..device_errors import device_error
from ..errors import EngineDead, InvalidRequest, NotReady
from ..models.llm import CosyVoice2LM
from ..stage_stats import StageStats, timed_call
from .base import BistreamRequest, EngineStats, GenerationRequest
from .bistream import BistreamSchedule, UnexpectedStopToken, Verdict
from .model_runner import ModelRunner, RunnerConfig
from .recorder import StepRecorder
from .scheduler import Scheduler, StepPlan
from .sequence import Sequence, SeqStatus

log = logging.getLogger(__name__)

Deliveries = list[tuple[Sequence, object]]  # (sequence, item for its queue: a token list, None = end, or an error)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class NativeEngineConfig:
    max_num_seqs: int = 64  # KV slots = most requests decoding at once
    max_model_len: int = 4096  # prompt + output positions per slot
    max_num_batched_tokens: int = 4096  # per step: decode rows + padded prefill rows x width
    device: str = "cpu"
    dtype: torch.dtype | str = torch.float32
    cuda_graphs: bool = True  # CUDA only; decode steps replay captured graphs
    warm_up_at_start: bool = True  # compile and capture graphs in start(), not on first use
    compile: bool = False  # CUDA only: torch.compile the decoder layers (~20 s more start-up)
    prefill_graphs: bool = False  # a whole prompt alone in its step's prefill: one graph per width bucket
    history_len: int = 32  # longest RAS win_size accepted
    max_top_k: int = 100  # largest RAS top_k accepted
    seed: int | None = None  # draws of requests without their own seed

    def runner_config(self) -> RunnerConfig:
        dtype = _DTYPES[self.dtype] if isinstance(self.dtype, str) else self.dtype
        return RunnerConfig(max_num_seqs=self.max_num_seqs, max_model_len=self.max_model_len,
                            device=self.device, dtype=dtype, cuda_graphs=self.cuda_graphs,
                            history_len=self.history_len, max_top_k=self.max_top_k, compile=self.compile,
                            prefill_graphs=self.prefill_graphs)


class NativeEngine:
    """`SpeechTokenEngine` on our own model code. Moves `model` to the configured device/dtype.
    `recorder` (optional, recorder.py) records every step's LM inputs and log-probs."""

    supports_bistream = True

    def __init__(self, model: CosyVoice2LM, config: NativeEngineConfig = NativeEngineConfig(),
                 recorder: StepRecorder | None = None):
        self.config = config
        self.runner = ModelRunner(model, config.runner_config(), seed=config.seed, recorder=recorder)
        self._mix_ratio = tuple(model.dims.mix_ratio)
        self._ids = model.ids
        self._text_vocab = model.dims.qwen.vocab_size
        self.scheduler = Scheduler(config.max_num_seqs, config.max_num_batched_tokens)
        self.stage_stats = StageStats("llm_step")  # steps, rows (decode + prefill), busy seconds
        self.prefill_stats = StageStats("llm_prefill_step")  # the steps that fed prompt rows; items: those rows
        self._seqs: dict[str, Sequence] = {}
        self._lock = threading.Lock()  # the scheduler, _seqs and the sequences' state: step thread and loop
        self._wake = threading.Event()  # set: a request, text or stop may have given the idle step thread work
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = False
        self._dead: str | None = None  # why the step loop died (set under the lock, by the step thread)
        self._death: asyncio.Future[str] | None = None

    # ------------------------------------------------------------------ SpeechTokenEngine

    async def start(self) -> None:
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._death = self._loop.create_future()
        warmed: asyncio.Future = self._loop.create_future()
        self._stopping, self._dead = False, None
        self._thread = threading.Thread(target=self._thread_main, args=(warmed,), name="native-llm", daemon=True)
        self._thread.start()
        try:
            await asyncio.shield(warmed)  # the warm-up runs in the step thread: the graphs it captures are its own
        except BaseException:
            await self.stop()
            raise

    async def stop(self) -> None:
        thread = self._thread
        if thread is None:
            return
        with self._lock:
            self._stopping = True
        self._wake.set()
        await asyncio.to_thread(thread.join)  # an in-flight step finishes first
        self._thread = None
        with self._lock:
            ended = [self._end(seq, NotReady("the speech-token engine stopped")) for seq in list(self._seqs.values())]
        self._deliver(ended)

    async def generate(self, request: GenerationRequest) -> AsyncIterator[list[int]]:
        seq = Sequence(request, asyncio.Queue(), ids=self._ids)
        if seq.segment_len + request.max_tokens > self.config.max_model_len:
            raise InvalidRequest(
                f"prompt ({seq.segment_len} positions) + max_tokens ({request.max_tokens}) exceeds max_model_len "
                f"({self.config.max_model_len}); shorten the text or prompt audio, or raise engine max_model_len")
        self._add(seq)
        async with aclosing(self._stream(seq)) as stream:
            async for tokens in stream:
                yield tokens

    async def generate_bistream(self, request: BistreamRequest,
                                text: AsyncIterator[Seq[int]]) -> AsyncIterator[list[int]]:
        try:
            schedule = BistreamSchedule(request.prompt_text_tokens, request.prompt_speech_tokens, self._mix_ratio,
                                        request.training_consistent, self._ids, request.system_prompt_len)
        except ValueError as e:
            raise InvalidRequest(str(e)) from None
        seq = Sequence(request, asyncio.Queue(), schedule=schedule, ids=self._ids)
        prompt_len = len(request.prompt_text_tokens) + len(request.prompt_speech_tokens) + 2
        if prompt_len > self.config.max_model_len:
            raise InvalidRequest(f"the prompt ({prompt_len} positions) exceeds max_model_len "
                                 f"({self.config.max_model_len}); shorten the prompt audio")
        self._add(seq)
        feeder = asyncio.create_task(self._feed_text(seq, text), name=f"bistream-text-{request.request_id}")
        try:
            async with aclosing(self._stream(seq)) as stream:
                async for tokens in stream:
                    yield tokens
        finally:
            feeder.cancel()
            await asyncio.gather(feeder, return_exceptions=True)

    async def _stream(self, seq: Sequence) -> AsyncIterator[list[int]]:
        try:
            while True:
                items = [await seq.outputs.get()]
                while not seq.outputs.empty():
                    items.append(seq.outputs.get_nowait())
                tokens = [t for item in items if isinstance(item, list) for t in item]
                if tokens:
                    yield tokens
                end = items[-1]
                if isinstance(end, BaseException):
                    raise end
                if end is None:
                    return
        finally:
            if seq.status is not SeqStatus.FINISHED:  # the consumer went away: abort
                self._finish_now(seq)

    async def abort(self, request_id: str) -> None:
        with self._lock:
            seq = self._seqs.get(request_id)
        if seq is not None:
            self._finish_now(seq)

    async def wait_dead(self) -> str:
        """Returns (the reason) when the step loop has died; never while it runs or after stop()."""
        if self._death is None:
            raise NotReady("the speech-token engine is not started")
        return await asyncio.shield(self._death)

    def stats(self) -> EngineStats:
        with self._lock:
            return EngineStats(running=len(self.scheduler.running), waiting=len(self.scheduler.waiting),
                               kv_usage=self.scheduler.usage())

    # ------------------------------------------------------------------ internals

    def _add(self, seq: Sequence) -> None:
        request = seq.request
        if not 1 <= request.ras.win_size <= self.config.history_len:
            raise InvalidRequest(f"RAS win_size must be in [1, {self.config.history_len}], got {request.ras.win_size}")
        if not 1 <= request.ras.top_k <= self.config.max_top_k:
            raise InvalidRequest(f"RAS top_k must be in [1, {self.config.max_top_k}], got {request.ras.top_k}")
        if request.seed is not None:
            seq.generator = torch.Generator().manual_seed(request.seed)
        with self._lock:
            if self._dead is not None:
                raise EngineDead(f"the speech-token engine died: {self._dead}")
            if self._thread is None or self._stopping:
                raise NotReady("the speech-token engine is not running (not started, stopped or failed)")
            if request.request_id in self._seqs:
                raise InvalidRequest(f"request id {request.request_id!r} is already running; ids must be unique")
            self._seqs[request.request_id] = seq
            self.scheduler.add(seq)
        self._wake.set()

    async def _feed_text(self, seq: Sequence, text: AsyncIterator[Seq[int]]) -> None:
        """Moves the caller's text pieces into the sequence's schedule until the text ends."""
        try:
            async for piece in text:
                if seq.status is SeqStatus.FINISHED:
                    return
                tokens = list(piece)
                bad = [t for t in tokens if not (isinstance(t, numbers.Integral) and 0 <= t < self._text_vocab)]
                if bad:
                    raise InvalidRequest(f"text token ids must be ints in [0, {self._text_vocab}); got {bad[:5]}")
                with self._lock:
                    if seq.status is SeqStatus.FINISHED:
                        return
                    seq.schedule.add_text(int(t) for t in tokens)
                    ended = self._advance(seq)
                self._deliver(ended)
            with self._lock:
                if seq.status is SeqStatus.FINISHED:
                    return
                seq.schedule.end_text()
                ended = self._advance(seq)
            self._deliver(ended)
        except Exception as e:  # noqa: BLE001 - the text source failed: the request fails with its error
            self._finish_now(seq, e)

    def _advance(self, seq: Sequence) -> Deliveries:
        """Give a bistream sequence that waits for input its next segment, if its text allows
        (under the lock); returns what to deliver (the sequence's end, if that fails it)."""
        if seq.status is SeqStatus.FINISHED or not seq.schedule.wants_input:
            return []
        parts = seq.schedule.next_input()
        if parts is None:
            return []  # needs more text: out of the steps until some arrives
        seq.set_segment(parts)
        if seq.segment_end > self.config.max_model_len:
            return [self._end(seq, InvalidRequest(
                f"bistream request {seq.request_id!r} needs more than max_model_len ({self.config.max_model_len}) "
                "positions; send shorter texts per request or raise engine max_model_len"))]
        self._wake.set()
        return []

    def _end(self, seq: Sequence, error: BaseException | None = None) -> tuple[Sequence, object]:
        """The one place a request ends (done, aborted, failed or engine stopped), under the lock:
        its slot is free at once; returns the end to deliver to its queue (None or the error)."""
        if seq.status is not SeqStatus.FINISHED:
            self.scheduler.release(seq)
            del self._seqs[seq.request_id]
        return seq, error

    def _finish_now(self, seq: Sequence, error: BaseException | None = None) -> None:
        """End a request from the event loop."""
        with self._lock:
            if seq.status is SeqStatus.FINISHED:
                return
            end = self._end(seq, error)
        self._deliver([end])

    @staticmethod
    def _deliver(items: Deliveries) -> None:
        """On the event loop: each (sequence, item) into the sequence's queue, in order."""
        for seq, item in items:
            seq.outputs.put_nowait(item)

    def _post(self, items: Deliveries) -> None:
        """From the step thread: deliver on the event loop (gone at interpreter exit: then nobody listens)."""
        if items:
            try:
                self._loop.call_soon_threadsafe(self._deliver, items)
            except RuntimeError:  # the loop is closed
                pass

    def _thread_main(self, warmed: asyncio.Future) -> None:
        try:
            if self.config.warm_up_at_start:
                self.runner.warm_up()
        except BaseException as e:  # noqa: BLE001 - handed to start(), which raises it
            self._loop.call_soon_threadsafe(_settle, warmed, e)
            return
        self._loop.call_soon_threadsafe(_settle, warmed, None)
        try:
            self._step_loop()
        except Exception as e:  # a bug in the loop itself: nobody may wait forever
            log.exception("speech-token engine loop died")
            reason = f"its step loop failed ({type(e).__name__}: {e})"
            with self._lock:
                self._dead = reason
                ended = [self._end(seq, EngineDead(f"the speech-token engine died: {reason}"))
                         for seq in list(self._seqs.values())]
            self._post(ended)
            try:
                self._loop.call_soon_threadsafe(_settle, self._death, reason)
            except RuntimeError:
                pass

    def _step_loop(self) -> None:
        while True:
            with self._lock:
                if self._stopping:
                    return
                plan = self.scheduler.schedule()
                if not plan:  # idle, or every running sequence waits for text
                    self._wake.clear()
            if not plan:
                self._wake.wait()
                continue
            sampled, seconds, ok = timed_call(self.runner.step, plan)
            self.stage_stats.record(seconds, len(plan.sequences), ok)
            if plan.prefill:
                self.prefill_stats.record(seconds, sum(c.end - c.start for c in plan.prefill), ok)
            with self._lock:
                if ok:
                    delivered = self._commit(plan, sampled)
                else:  # fail the step's requests, keep serving the rest
                    log.error("speech-token engine step failed", exc_info=sampled)
                    error = device_error(sampled)
                    delivered = [self._end(seq, error) for seq in plan.sequences if seq.status is not SeqStatus.FINISHED]
            self._post(delivered)

    def _commit(self, plan: StepPlan, sampled: list[tuple[Sequence, int]]) -> Deliveries:
        out: Deliveries = []
        for chunk in plan.prefill:
            chunk.seq.num_cached = chunk.end
        for seq in plan.decode:
            seq.num_cached += 1
        for seq, token in sampled:
            if seq.status is SeqStatus.FINISHED:  # aborted while the step ran
                continue
            seq.end_segment()
            seq.decoding, seq.last_token = True, token
            if seq.schedule is not None:
                self._commit_bistream(seq, token, out)
            elif self._ids.is_stop(token) and not seq.request.ignore_stop_tokens:
                out.append(self._end(seq))
            else:
                self._emit(seq, token, out)
        return out

    def _commit_bistream(self, seq: Sequence, token: int, out: Deliveries) -> None:
        try:
            verdict = seq.schedule.accept(token)
        except UnexpectedStopToken as e:
            out.append(self._end(seq, e))
            return
        if verdict is Verdict.EMIT:
            if seq.num_cached >= self.config.max_model_len:  # no position left to feed it
                out.append(self._end(seq, InvalidRequest(
                    f"bistream request {seq.request_id!r} reached max_model_len ({self.config.max_model_len}) "
                    "positions; send shorter texts per request or raise engine max_model_len")))
                return
            self._emit(seq, token, out)
        elif verdict is Verdict.FILL:
            seq.decoding = False  # the fill is never fed
            out += self._advance(seq)
        else:
            out.append(self._end(seq))

    def _emit(self, seq: Sequence, token: int, out: Deliveries) -> None:
        seq.num_output += 1
        out.append((seq, [token]))
        if seq.num_output >= seq.request.max_tokens:
            out.append(self._end(seq))


def _settle(future: asyncio.Future, outcome) -> None:
    """On the event loop: a future's result, or its exception when `outcome` is one."""
    if future.done():
        return
    if isinstance(outcome, BaseException):
        future.set_exception(outcome)
    else:
        future.set_result(outcome)
