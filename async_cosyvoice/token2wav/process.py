"""token2wav in a process of its own (`token2wav.process: true`): flow + HiFT out of the server's GIL.

Why: one Python process shares one GIL between the LLM step thread, the token2wav thread, the
event loop and gRPC. On an H200 pair two in-process replicas' token2wav batches took twice as long
with half the jobs (docs/deployment.md), and on one H100 a one-job batch took 77 ms in the server
against ~60 ms alone. Here a child process (spawned: CUDA cannot be forked) loads flow + HiFT on
its device and runs the same token2wav stage (token2wav/stage.py) on an event loop of its own.

The split of a stream: the server's Token2WavStream plans (tokens, hops, offsets: what
`next_job` reads, and `advance` after each job) and holds no device state; the child's copy of
it renders (the prompt on the device, the HiFT and flow caches, the NSF noise drawn there from the
request's seed). One duplex pipe of pickled messages:

    server -> child   ("open", sid, StreamSpec)        a new stream: prompt, options, seed
                      ("job", key, JobSpec)            one chunk, with the tokens the child lacks
                      ("cancel", key)                  its caller went away: dropped if not started
                      ("close", sid)                   the server's stream is gone
                      ("call", key, method, args[, kwargs])  prepare_speaker, forget_speaker, capture_graphs,
                                                       serve_captures
                      ("stop",)
    child -> server   ("ready", device) | ("failed", None, error)   once, after loading
                      ("done", key, result, started, stats) | ("failed", key, error, stats)
                      ("graphs", None, stats)           after each CUDA graph capture beside the batches
                      (stats: ChildStats, its batcher's stage counters and CUDA graph state)

A reader thread in the server blocks on the pipe and hands each reply to the event loop. When the
pipe breaks (the child died) every pending and later job fails with EngineDead and `wait_dead`
returns, so the server turns NOT_SERVING and exits with code 3, as when the LM engine dies.
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import logging
import multiprocessing
import pickle
import threading
import weakref
from dataclasses import dataclass

from torch import Tensor

from ..compile_cache import compile_in_use, use_compile_cache
from ..config import Config
from ..errors import EngineDead
from ..graph_buckets import CapturePlan
from ..model_dir import ModelDir, load_model_dir
from ..stage_stats import StageStats
from .batcher import Token2WavBatcher
from .graph_state import DeviceGraphState, read_graph_state
from .stage import device_token2wav_batcher
from .stream import Token2WavJob, Token2WavStream

log = logging.getLogger(__name__)

STOP_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class ChildStats:
    """What every message of the child carries about its batcher."""
    stage: StageStats
    graphs: DeviceGraphState

    @classmethod
    def of(cls, batcher: Token2WavBatcher) -> "ChildStats":
        return cls(batcher.stage_stats, read_graph_state(batcher))


@dataclass(frozen=True)
class StreamSpec:
    """What the child needs to make its copy of a stream (`Token2WavBatcher.open_stream`)."""
    prompt_token: Tensor
    prompt_feat: Tensor
    embedding: Tensor
    seed: int | None
    segment: int
    options: dict  # Token2WavStream's stream, schedule, speed, prompt_key

    def open(self, batcher: Token2WavBatcher) -> Token2WavStream:
        return batcher.open_stream(self.prompt_token, self.prompt_feat, self.embedding, seed=self.seed,
                                   segment=self.segment, **self.options)


@dataclass(frozen=True)
class JobSpec:
    """One job of a stream, as the child rebuilds it (`Token2WavStream.job_until`)."""
    sid: int
    index: int
    end: int           # the job sees the stream's first `end` tokens
    hop: int
    finalize: bool
    streaming: bool
    new_tokens: Tensor  # the tokens after those already sent
    deadline: float     # time.monotonic(): one clock for every process of the host


def picklable(error: BaseException) -> BaseException:
    """The error itself where it survives pickling (an exception whose __init__ takes other
    arguments than its args pickles but does not unpickle), else a RuntimeError naming it."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:  # noqa: BLE001 — any unpicklable error becomes a plain one
        return RuntimeError(f"{type(error).__name__}: {error}")


# -- the server's side ------------------------------------------------------------------------------


@dataclass
class _Sent:
    sid: int
    tokens: int = 0  # tokens of the stream the child has


class Token2WavProcess:
    """The token2wav stage of one device in a child process; in the Synthesizer's `batcher` slot
    (open_stream, submit, stream_started, stream_ended, pick, stage_stats_list, prepare_speaker,
    forget_speaker, capture_graphs, serve_captures, wait_dead, close). Construction blocks until the child has loaded its models (call it off the
    loop)."""

    def __init__(self, config: Config, model_dir: ModelDir, device: str):
        self.device = device
        ctx = multiprocessing.get_context("spawn")
        self._conn, child_end = ctx.Pipe()
        args = (config.model_dump(mode="json"), str(model_dir.path), device, child_end)
        self.process = ctx.Process(target=serve_token2wav, args=args,
                                   name=f"token2wav-{device}", daemon=True)
        self.process.start()
        child_end.close()
        try:
            reply = self._conn.recv()
        except EOFError:
            self.process.join(STOP_TIMEOUT_S)
            raise RuntimeError(f"the token2wav process on {device} exited while loading "
                               f"(exit code {self.process.exitcode})") from None
        if reply[0] != "ready":
            self.process.join(STOP_TIMEOUT_S)
            raise reply[2]
        self.stage_stats = StageStats("token2wav_batch")
        self.open_streams = 0  # segments' streams on this device (stream_started / stream_ended)
        self.graph_state: DeviceGraphState | None = None  # the child's, as of its last message
        self._send_lock = threading.Lock()  # the loop sends; close() may send from another thread
        # streams the server dropped (weakref finalizers, which run wherever the GC does, even
        # inside a send): told to the child before the next message
        self._closed_sids: collections.deque[int] = collections.deque()
        self._streams: weakref.WeakKeyDictionary[Token2WavStream, _Sent] = weakref.WeakKeyDictionary()
        self._sids = itertools.count()
        self._keys = itertools.count()
        self._pending: dict[int, asyncio.Future] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._dead: asyncio.Future[str] | None = None
        self._closing = False
        log.info("token2wav process %d on %s ready", self.process.pid, device)

    # the sink interface (utterance.Token2WavSink, placement)

    def pick(self) -> "Token2WavProcess":
        return self

    def stage_stats_list(self) -> list[StageStats]:
        return [self.stage_stats]

    def open_stream(self, prompt_token: Tensor, prompt_feat: Tensor, embedding: Tensor, *, seed: int | None,
                    segment: int, **options) -> Token2WavStream:
        """A planning stream here (CPU, no noise) and its rendering copy in the child."""
        stream = Token2WavStream(prompt_token, prompt_feat, embedding, **options)
        sid = next(self._sids)
        self._send(("open", sid, StreamSpec(stream.prompt_token, stream.prompt_feat, stream.embedding, seed, segment,
                                            options)))
        self._streams[stream] = _Sent(sid)
        weakref.finalize(stream, self._closed_sids.append, sid)
        return stream

    async def submit(self, job: Token2WavJob, deadline: float) -> Tensor:
        """Render `job` in the child, then apply it to the planning stream; returns its samples.
        Cancelling the caller drops the job there if it has not started."""
        sent = self._streams.get(job.stream)
        if sent is None:
            raise ValueError("the job's stream was not opened by this token2wav process")
        new_tokens = job.tokens[0, sent.tokens:].clone()
        result = await self._request("job", JobSpec(sent.sid, job.index, job.n_tokens, job.hop, job.finalize,
                                                    job.streaming, new_tokens, deadline))
        sent.tokens = job.n_tokens
        samples, started = result
        job.timing.started = started
        job.stream.advance(job, samples.numel())
        return samples

    def stream_started(self, stream: Token2WavStream) -> None:
        """A segment's stream on this device began (Utterance.run): counted here, where the
        segment runs; the child only renders jobs (its captures do not give way to first chunks)."""
        self.open_streams += 1

    def stream_ended(self, stream: Token2WavStream) -> None:
        self.open_streams -= 1

    async def prepare_speaker(self, prompt_token: Tensor, prompt_feat: Tensor, embedding: Tensor,
                              speaker_id: str) -> bool:
        return await self._request("call", "prepare_speaker", (prompt_token, prompt_feat, embedding, speaker_id))

    def forget_speaker(self, speaker_id: str) -> None:
        self._send_quietly(("call", None, "forget_speaker", (speaker_id,)))

    async def capture_graphs(self, plan: CapturePlan, *, defer: bool = False, and_wanted: bool = False) -> int:
        return await self._request("call", "capture_graphs", (plan,), {"defer": defer, "and_wanted": and_wanted})

    async def serve_captures(self) -> None:
        await self._request("call", "serve_captures", ())

    async def wait_dead(self) -> str:
        """Returns (the reason) once the child has died; never while it runs or after close()."""
        self._attach()
        return await asyncio.shield(self._dead)

    async def close(self) -> None:
        self._closing = True
        self._send_quietly(("stop",))
        await asyncio.to_thread(self.process.join, STOP_TIMEOUT_S)
        if self.process.is_alive():
            log.warning("the token2wav process on %s did not stop in %.0f s: killing it", self.device, STOP_TIMEOUT_S)
            self.process.kill()
            await asyncio.to_thread(self.process.join)
        self._conn.close()

    # internals

    def _attach(self) -> None:
        """On first use from the event loop: the reader thread that hands replies to it."""
        if self._loop is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._dead = self._loop.create_future()
        threading.Thread(target=self._read, name=f"token2wav-{self.device}-reader", daemon=True).start()

    async def _request(self, kind: str, *payload):
        self._attach()
        if self._dead.done():
            raise EngineDead(self._dead.result())
        key = next(self._keys)
        future = self._loop.create_future()
        self._pending[key] = future
        try:
            self._send((kind, key, *payload))
            return await future
        except asyncio.CancelledError:
            if self._pending.pop(key, None) is not None:
                self._send_quietly(("cancel", key))
            raise
        finally:
            self._pending.pop(key, None)

    def _send(self, message: tuple) -> None:
        try:
            with self._send_lock:
                while self._closed_sids:
                    self._conn.send(("close", self._closed_sids.popleft()))
                self._conn.send(message)
        except (OSError, ValueError) as e:  # a closed or broken pipe: the child is gone
            raise EngineDead(f"the token2wav process on {self.device} is gone ({type(e).__name__})") from None

    def _send_quietly(self, message: tuple) -> None:
        try:
            self._send(message)
        except EngineDead:
            pass

    def _read(self) -> None:
        """Reader thread: replies to the loop until the pipe closes, then the death."""
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                break
            self._to_loop(self._on_reply, message)
        self.process.join(5.0)
        self._to_loop(self._on_exit, f"the token2wav process on {self.device} exited (exit code "
                                     f"{self.process.exitcode})")

    def _to_loop(self, fn, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: nobody is waiting any more
            pass

    def _on_reply(self, message: tuple) -> None:
        kind, key, *rest = message
        if rest and isinstance(rest[-1], ChildStats):
            for f in dataclasses.fields(StageStats):
                setattr(self.stage_stats, f.name, getattr(rest[-1].stage, f.name))
            self.graph_state = rest[-1].graphs
        future = self._pending.pop(key, None)
        if future is None or future.done():
            return
        if kind == "done":
            future.set_result(rest[0])
        else:
            future.set_exception(rest[0])

    def _on_exit(self, reason: str) -> None:
        if self._closing:
            return
        log.critical("%s: its requests fail with UNAVAILABLE", reason)
        self._dead.set_result(reason)
        for future in self._pending.values():
            if not future.done():
                future.set_exception(EngineDead(reason))
        self._pending.clear()


# -- the child's side --------------------------------------------------------------------------------


def serve_token2wav(config_json: dict, model_path: str, device: str, conn) -> None:
    """The child process: load flow + HiFT of the model directory the server resolved on `device`,
    say ready, serve the pipe until "stop" or until the server's end of the pipe closes."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s token2wav[{device}] %(name)s: %(message)s")
    try:
        config = Config.model_validate(config_json)
        if compile_in_use(config):
            use_compile_cache(config)
        batcher = device_token2wav_batcher(config, load_model_dir(model_path), device)
    except BaseException as e:  # noqa: BLE001 — reported to the server, which raises it
        conn.send(("failed", None, picklable(e)))
        return
    conn.send(("ready", device))
    asyncio.run(_ChildServer(conn, batcher).serve())


def pipe_inbox(conn, name: str) -> asyncio.Queue:
    """A child's end of the pipe as a queue of this loop: a thread receives each message and puts
    it there; a closed pipe reads as ("stop",), the last message."""
    loop = asyncio.get_running_loop()
    inbox: asyncio.Queue[tuple] = asyncio.Queue()

    def pump() -> None:
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                message = ("stop",)
            loop.call_soon_threadsafe(inbox.put_nowait, message)
            if message[0] == "stop":
                return

    threading.Thread(target=pump, name=name, daemon=True).start()
    return inbox


class _ChildServer:
    def __init__(self, conn, batcher: Token2WavBatcher):
        self.conn = conn
        self.batcher = batcher
        self.streams: dict[int, Token2WavStream] = {}
        self.tasks: dict[int, asyncio.Task] = {}
        # a capture beside the batches changes the graph state after the last reply: told at once
        batcher.on_capture = self._tell_graphs

    def _tell_graphs(self) -> None:
        try:
            self.conn.send(("graphs", None, ChildStats.of(self.batcher)))
        except (OSError, ValueError):  # the server's end is gone: the inbox reads "stop" next
            pass

    async def serve(self) -> None:
        loop = asyncio.get_running_loop()
        inbox = pipe_inbox(self.conn, "token2wav-pipe")
        while (message := await inbox.get())[0] != "stop":
            kind, key, *rest = message
            if kind == "open":
                self.streams[key] = rest[0].open(self.batcher)
            elif kind == "close":
                self.streams.pop(key, None)
            elif kind == "cancel":
                task = self.tasks.pop(key, None)
                if task is not None:
                    task.cancel()
            elif kind in ("job", "call"):
                self.tasks[key] = loop.create_task(self._run(kind, key, *rest))
        for task in self.tasks.values():
            task.cancel()
        await self.batcher.close()

    async def _run(self, kind: str, key, *payload) -> None:
        try:
            if kind == "job":
                result = await self._job(*payload)
            else:
                method, args, *kwargs = payload
                result = getattr(self.batcher, method)(*args, **(kwargs[0] if kwargs else {}))
                if asyncio.iscoroutine(result):
                    result = await result
            if key is not None:
                self.conn.send(("done", key, result, ChildStats.of(self.batcher)))
        except asyncio.CancelledError:
            pass  # the server gave up on it
        except Exception as e:  # noqa: BLE001 — the caller gets it
            if key is not None:
                self.conn.send(("failed", key, picklable(e), ChildStats.of(self.batcher)))
        finally:
            self.tasks.pop(key, None)

    async def _job(self, spec: JobSpec) -> tuple[Tensor, float]:
        stream = self.streams[spec.sid]
        stream.append(spec.new_tokens)
        job = stream.job_until(spec.end, spec.hop, spec.finalize, spec.streaming)
        if job.index != spec.index:
            raise RuntimeError(f"stream {spec.sid}: the server sent chunk {spec.index}, this copy is at {job.index}")
        samples = await self.batcher.submit(job, spec.deadline)
        if stream.finished:
            self.streams.pop(spec.sid, None)
        return samples, job.timing.started


def token2wav_worker(config: Config, model_dir: ModelDir, device: str) -> Token2WavBatcher | Token2WavProcess:
    """The token2wav stage on `device`: its own flow + HiFT weights, estimator, runner and batcher,
    in this process or (token2wav.process) in a child process of its own. The one place that
    decision is made, for one device and for each worker of a disaggregated pool."""
    if config.token2wav.process:
        return Token2WavProcess(config, model_dir, device)
    return device_token2wav_batcher(config, model_dir, device)
