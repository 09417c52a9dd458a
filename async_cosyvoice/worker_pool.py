"""Several devices, one worker process each (`model.placement: workers`, the default).

Why: one Python process shares one GIL between every device's LLM step thread, token2wav thread,
the event loop and gRPC; in-process replicas on an H200 pair gave 0.44x the capacity of one GPU
(docs/perf/multi-gpu). Here each device's LLM engine and token2wav run in a process of their own
(device_worker.py), and this process, the server's front, keeps what is shared:

    the doors (gRPC, HTTP, WebSocket), admission and metrics   (the server, unchanged)
    RequestFront: rules, voices, text -> model inputs          (CPU, once per request)
    the speaker store                                           (registrations reach every worker)
    WorkerPool: routing, a worker's death and its restart       (this file)

A request goes to the serving worker with the fewest requests in flight (ties: the one given
fewest) and stays there. A worker that dies (killed, its engine died) fails its requests with
NotReady (UNAVAILABLE) naming its device, takes no new ones, and is started again after a back-off
(workers.restart_backoff_s, doubling up to workers.restart_backoff_max_s); meanwhile the others
serve and the pool reports itself `degraded`. Speakers live in the store, so a restarted worker
loses none (its start-up prepares the most recent ones, as any start does).
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import multiprocessing
import os
import threading
from typing import AsyncIterable, AsyncIterator

from .config import Config
from .demo import resolve_model_dir
from .device_worker import ENGINE_DEAD_EXIT_CODE, SpeakOrder, StreamOrder, WorkerInfo, WorkerStats, serve_device
from .devices import DeviceStats, devices_of, on_device
from .engine.base import EngineStats
from .errors import NotReady
from .model_dir import load_model_dir
from .request import Audio, AudioChunk, SynthesisRequest, Voice
from .request_front import RequestFront
from .speakers import SpeakerRecord
from .stage_stats import StageStats, totals

log = logging.getLogger(__name__)

STOP_TIMEOUT_S = 30.0
STATS_TIMEOUT_S = 2.0  # a metrics scrape waits this long for the workers' stats, then reads the last ones


class DeviceWorker:
    """One device's worker process seen from the front: started (and restarted) here, spoken to
    over a pipe whose replies a reader thread hands to the event loop, one inbox per request."""

    def __init__(self, config: Config, index: int, device: str, warmup: bool = True, threads: int | None = None):
        self.config = on_device(config, device)
        self.index = index
        self.device = device
        self.warmup = warmup
        self.threads = threads
        self.state = "starting"   # serving, restarting (died, being started again), failed (given up), closed
        self.active = 0           # requests in flight here
        self.served = 0           # requests assigned so far
        self.restarts = 0
        self.info: WorkerInfo | None = None
        self.stats = WorkerStats()
        self.gave_up: asyncio.Future[str] | None = None
        self._process: multiprocessing.Process | None = None
        self._conn = None
        self._generation = 0      # which process the reader thread's replies belong to
        self._inboxes: dict[int, asyncio.Queue] = {}
        self._keys = itertools.count()
        self._send_lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._restarter: asyncio.Task | None = None
        self._serving = asyncio.Event()

    def __repr__(self) -> str:
        return f"worker {self.index} on {self.device}"

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    # -- life --------------------------------------------------------------------------------------

    async def start(self) -> None:
        """Spawn the process and return once it serves (loaded and warmed up), or raise why not."""
        self._loop = asyncio.get_running_loop()
        if self.gave_up is None:
            self.gave_up = self._loop.create_future()
        ctx = multiprocessing.get_context("spawn")
        conn, child_end = ctx.Pipe()
        # not a daemon: the worker may start processes of its own (token2wav.process, vLLM's engine)
        process = ctx.Process(target=serve_device, name=f"worker-{self.index}-{self.device}",
                              args=(self.config.model_dump(mode="json"), child_end, self.warmup, self.threads))
        process.start()
        child_end.close()
        timeout = self.config.workers.start_timeout_s
        try:
            reply = await asyncio.wait_for(asyncio.to_thread(_first_reply, conn), timeout)
        except BaseException as e:
            process.kill()
            await asyncio.to_thread(process.join)
            conn.close()
            if isinstance(e, TimeoutError):
                raise RuntimeError(f"{self} did not start in {timeout:g} s (workers.start_timeout_s)") from None
            if isinstance(e, EOFError):
                raise RuntimeError(f"{self} exited while loading (exit code {process.exitcode})") from None
            raise
        if reply[0] != "ready":
            await asyncio.to_thread(process.join, STOP_TIMEOUT_S)
            conn.close()
            raise reply[2]
        self.info = reply[1]
        self._process, self._conn = process, conn
        self._generation += 1
        threading.Thread(target=self._read, args=(conn, process, self._generation),
                         name=f"worker-{self.index}-reader", daemon=True).start()
        self.state = "serving"
        self._serving.set()
        log.info("%s serves (process %d)", self, process.pid)

    async def wait_serving(self) -> None:
        """Returns once the worker serves (at once if it does)."""
        await self._serving.wait()

    async def close(self) -> None:
        self.state = "closed"
        if self._restarter is not None:
            self._restarter.cancel()
        process, conn = self._process, self._conn
        if process is None:
            return
        try:
            with self._send_lock:
                conn.send(("stop",))
        except (OSError, ValueError):
            pass
        await asyncio.to_thread(process.join, STOP_TIMEOUT_S)
        if process.is_alive():
            log.warning("%s did not stop in %.0f s: killing it", self, STOP_TIMEOUT_S)
            process.kill()
            await asyncio.to_thread(process.join)
        conn.close()

    def _read(self, conn, process: multiprocessing.Process, generation: int) -> None:
        """Reader thread of one process: its replies to the loop until the pipe closes, then its exit."""
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                break
            self._to_loop(self._on_reply, generation, message)
        process.join(5.0)
        self._to_loop(self._on_exit, generation, process.exitcode)

    def _to_loop(self, fn, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: nobody is waiting any more
            pass

    def _on_reply(self, generation: int, message: tuple) -> None:
        if generation != self._generation:
            return
        kind, key, value, stats = message
        self.stats = stats
        if (inbox := self._inboxes.get(key)) is not None:
            inbox.put_nowait((kind, value))

    def _on_exit(self, generation: int, exitcode: int | None) -> None:
        if generation != self._generation or self.state == "closed":
            return
        cause = ("its engine died" if exitcode == ENGINE_DEAD_EXIT_CODE
                 else f"killed by signal {-exitcode}" if exitcode is not None and exitcode < 0
                 else f"exit code {exitcode}")
        reason = f"the worker process on {self.device} (worker {self.index}) died ({cause})"
        log.critical("%s: its %d request(s) get UNAVAILABLE; the other workers serve on; restarting it",
                     reason, len(self._inboxes))
        self.state = "restarting"
        self._serving.clear()
        error = NotReady(f"{reason}; retry")
        for inbox in self._inboxes.values():
            inbox.put_nowait(("error", error))
        self._inboxes.clear()
        self._conn.close()
        self._restarter = self._loop.create_task(self._restart(reason))

    async def _restart(self, reason: str) -> None:
        workers = self.config.workers
        delay, failed = workers.restart_backoff_s, 0
        while True:
            await asyncio.sleep(delay)
            try:
                await self.start()
            except Exception as e:  # noqa: BLE001 — logged, tried again after a longer pause
                failed += 1
                log.error("%s: start %d of %d after its death failed: %s: %s", self, failed,
                          workers.max_failed_starts, type(e).__name__, e)
                if failed >= workers.max_failed_starts:
                    self.state = "failed"
                    self.gave_up.set_result(f"{reason}; {failed} starts since failed ({type(e).__name__}: {e})")
                    return
                delay = min(2 * delay, workers.restart_backoff_max_s)
                continue
            self.restarts += 1
            log.warning("%s serves again (restart %d)", self, self.restarts)
            return

    # -- messages ------------------------------------------------------------------------------------

    def open(self, kind: str, *payload) -> tuple[int, asyncio.Queue]:
        """Send a request; its replies arrive in the returned inbox as (kind, value)."""
        if self.state != "serving":
            raise NotReady(f"{self} is {self.state}; retry")
        key = next(self._keys)
        inbox: asyncio.Queue = asyncio.Queue()
        self._inboxes[key] = inbox
        try:
            self.send((kind, key, *payload))
        except BaseException:
            self._inboxes.pop(key, None)
            raise
        return key, inbox

    def release(self, key: int, cancel: bool) -> None:
        """The request is over here; `cancel`: the worker should stop working on it."""
        if self._inboxes.pop(key, None) is not None and cancel:
            try:
                self.send(("cancel", key))
            except NotReady:
                pass

    def send(self, message: tuple) -> None:
        try:
            with self._send_lock:
                self._conn.send(message)
        except (OSError, ValueError, AttributeError):  # closed or broken: the process is gone
            raise NotReady(f"the worker process on {self.device} (worker {self.index}) is gone; retry") from None

    async def call(self, method: str, *args):
        """One of the worker's calls (device_worker._WorkerServer._call): its result."""
        key, inbox = self.open("call", method, args)
        done = False
        try:
            kind, value = await inbox.get()
            done = True
            if kind == "error":
                raise value
            return value
        finally:
            self.release(key, cancel=not done)


def _first_reply(conn) -> tuple:
    return conn.recv()


class WorkerPool:
    """Device worker processes behind the Synthesizer's public interface (what the doors call)."""

    def __init__(self, config: Config, front: RequestFront, workers: list[DeviceWorker], sample_rate: int):
        self.config = config
        self.front = front
        self.rules = front.rules
        self.workers = workers
        self.sample_rate = sample_rate
        self.closed = False
        self.loop: asyncio.AbstractEventLoop | None = None  # the one its workers' replies arrive on

    @classmethod
    async def create(cls, config: Config, warmup: bool = True) -> "WorkerPool":
        """Load the front (tokenizer, text normalizer, prompt encoder, speaker store) and start
        every device's worker at once; returns when all serve, or raises the first failure."""
        model_dir = await asyncio.to_thread(lambda: load_model_dir(resolve_model_dir(config.model.dir)))
        # the workers load the directory the front resolved (the demo model is generated once)
        config = config.model_copy(update={"model": config.model.model_copy(update={"dir": model_dir.path})})
        front = await asyncio.to_thread(RequestFront.load, config, model_dir)
        devices = devices_of(config)
        threads = max(1, (os.cpu_count() or 1) // len(devices))  # the host's cores shared by the workers
        workers = [DeviceWorker(config, i, d, warmup=warmup, threads=threads) for i, d in enumerate(devices)]
        started = await asyncio.gather(*(w.start() for w in workers), return_exceptions=True)
        if failures := [r for r in started if isinstance(r, BaseException)]:
            await asyncio.gather(*(w.close() for w in workers))
            front.close()
            raise failures[0]
        front.limit_to_device(min(w.info.memory_total for w in workers))
        log.info("a worker process per device: %s", ", ".join(f"{w.device} (pid {w.pid})" for w in workers))
        pool = cls(config, front, workers, workers[0].info.sample_rate)
        pool.loop = asyncio.get_running_loop()
        return pool

    # -- state -------------------------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        """Serving unless closed or every worker was given up; a request while all are restarting
        gets NotReady naming them (`_pick`)."""
        return not self.closed and any(w.state != "failed" for w in self.workers)

    @property
    def degraded(self) -> bool:
        """Some worker is not serving (restarting or given up): less capacity than configured."""
        return any(w.state != "serving" for w in self.workers)

    @property
    def speakers(self):
        return self.front.speakers

    @property
    def supports_bistream(self) -> bool:
        return all(w.info.supports_bistream for w in self.workers if w.info is not None)

    def _pick(self) -> DeviceWorker:
        live = [w for w in self.workers if w.state == "serving"]
        if not live:
            states = ", ".join(f"{w.device} {w.state}" for w in self.workers)
            raise NotReady(f"no device worker is serving ({states}); retry")
        worker = min(live, key=lambda w: (w.active, w.served))
        worker.served += 1
        return worker

    def engine_stats(self) -> EngineStats:
        stats = [w.stats.engine for w in self.workers if w.state == "serving"]
        return EngineStats(running=sum(s.running for s in stats), waiting=sum(s.waiting for s in stats),
                           kv_usage=max((s.kv_usage for s in stats), default=0.0))

    def stage_stats(self) -> list[StageStats]:
        return totals([s for w in self.workers for s in w.stats.stages])

    def device_stats(self) -> list[DeviceStats]:
        return [DeviceStats(w.device, "worker", w.active, w.served, w.stats.engine, state=w.state,
                            restarts=w.restarts, busy_s=w.stats.busy_s, memory_bytes=w.stats.memory_bytes,
                            graphs=w.stats.graphs if w.state == "serving" else None)
                for w in self.workers]

    def refresh_stats(self, timeout_s: float = STATS_TIMEOUT_S) -> None:
        """Ask every serving worker for its stats now and wait for them (at most `timeout_s`; then
        the last ones stand), from a thread other than the pool's loop: a metrics scrape. A worker
        changes after its last reply too (it captures the CUDA graphs its requests wanted), and
        only its replies bring its stats here."""
        loop = self.loop
        if loop is None or loop.is_closed():
            return
        with contextlib.suppress(RuntimeError):  # RuntimeError: no loop runs in this thread
            if asyncio.get_running_loop() is loop:
                return  # on the pool's own loop: it cannot wait for itself
        asked = asyncio.run_coroutine_threadsafe(self._ask_stats(timeout_s), loop)
        try:
            asked.result(timeout_s + 1.0)
        except Exception:  # noqa: BLE001 — a scrape reads the last stats rather than fail
            asked.cancel()

    async def _ask_stats(self, timeout_s: float) -> None:
        live = [w for w in self.workers if w.state == "serving"]
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.gather(*(w.call("stats") for w in live), return_exceptions=True),
                                   timeout_s)

    async def wait_dead(self) -> str:
        """Returns once every worker has been given up (workers.max_failed_starts failed starts in a
        row): this server can serve no more. A worker that dies is restarted, not reported here."""
        reasons = await asyncio.gather(*(asyncio.shield(w.gave_up) for w in self.workers))
        return "every device worker failed: " + "; ".join(reasons)

    async def warmup(self) -> None:
        """Each worker warmed up before it reported ready; nothing is left to do here."""

    async def close(self) -> None:
        self.closed = True
        await asyncio.gather(*(w.close() for w in self.workers))
        self.front.close()

    # -- synthesis ---------------------------------------------------------------------------------

    async def synthesize(self, request: SynthesisRequest, voice: Voice | None = None) -> AsyncIterator[AudioChunk]:
        """Checked, voiced and turned into model inputs here; spoken by one worker."""
        request = self.rules.check(request)
        inputs = await self.front.model_inputs(request, voice or await self.front.prepare_voice(request))
        # the audio stays here: the inputs carry what the devices need of it
        order = SpeakOrder(dataclasses.replace(request, prompt_audio=None, source_audio=None), inputs)
        # admitted here, in the front (the workers' Synthesizer.speak reserves nothing): refused or
        # queued before a worker is picked, and counted once
        async with self.front.admit(request, inputs), contextlib.aclosing(self._on_a_worker("speak", order)) as chunks:
            async for chunk in chunks:
                yield chunk

    async def synthesize_stream(self, text: AsyncIterable[str | object], request: SynthesisRequest, *,
                                text_mode: str | None = None,
                                text_normalization: str | None = None) -> AsyncIterator[AudioChunk]:
        """The voice is prepared and the text normalized and tokenized here
        (RequestFront.stream_tokens); the token ids go to one worker as they become known, whose
        Synthesizer.speak_stream speaks them (bistream or sentence by sentence)."""
        request = self.rules.check(request, streamed_text=True)
        mode, normalization = self.front.stream_modes(text_mode, text_normalization, self.supports_bistream)
        voice = await self.front.prepare_voice(request)
        instruction = await self.front.in_cpu(self.front.instruction_tokens, request)
        order = StreamOrder(dataclasses.replace(request, prompt_audio=None, source_audio=None), voice, instruction,
                            mode)
        tokens = self.front.stream_tokens(text, request, mode, normalization)
        async with (self.front.admit_stream(request, voice, instruction),
                    contextlib.aclosing(self._on_a_worker("stream", order, text_tokens=tokens)) as chunks):
            async for chunk in chunks:
                yield chunk

    async def _on_a_worker(self, kind: str, order, text_tokens: AsyncIterator[list[int]] | None = None
                           ) -> AsyncIterator[AudioChunk]:
        worker = self._pick()
        key, inbox = worker.open(kind, order)
        worker.active += 1
        feeder = None if text_tokens is None else asyncio.create_task(_feed(worker, key, text_tokens, inbox))
        over = False
        try:
            while True:
                what, value = await inbox.get()
                if what == "chunk":
                    yield value
                    continue
                over = True
                if what == "end":
                    return
                raise value
        finally:
            worker.active -= 1
            if feeder is not None:
                feeder.cancel()
            worker.release(key, cancel=not over)

    # -- speakers --------------------------------------------------------------------------------

    async def register_speaker(self, speaker_id: str, prompt_text: str, audio: Audio,
                               overwrite: bool = False) -> SpeakerRecord:
        """Computed and stored here; returns once every serving worker has prepared it (flow
        prompt prefix, warm-up of its prompt length), so any of them serves it at full speed."""
        record = await self.front.new_speaker(speaker_id, prompt_text, audio, overwrite)
        live = [w for w in self.workers if w.state == "serving"]
        results = await asyncio.gather(*(w.call("prepare_speaker", record) for w in live), return_exceptions=True)
        for worker, result in zip(live, results):
            if isinstance(result, BaseException):
                # stored and usable: its first request there computes what preparing would have
                log.warning("speaker %r is stored, but preparing it on %s failed (%s: %s)", speaker_id, worker,
                            type(result).__name__, result)
        return record

    async def delete_speaker(self, speaker_id: str) -> None:
        """From the store; each serving worker drops what its flow cached for it."""
        await self.front.in_cpu(self.front.speakers.delete, speaker_id)
        for worker in self.workers:
            if worker.state == "serving":
                try:
                    worker.send(("call", None, "forget_speaker", (speaker_id,)))
                except NotReady:  # died meanwhile: a restarted worker has no cache of it
                    pass


async def _feed(worker: DeviceWorker, key: int, text_tokens: AsyncIterator[list[int]], inbox: asyncio.Queue) -> None:
    """A text stream's token ids to the worker as they become known; a failure of the text (a bad
    piece, a pause too long, the client's error) ends the request with it."""
    try:
        async for tokens in text_tokens:
            worker.send(("text", key, tokens))
        worker.send(("text_end", key))
    except asyncio.CancelledError:
        raise
    except Exception as e:  # noqa: BLE001 — handed to the request
        inbox.put_nowait(("error", e))
