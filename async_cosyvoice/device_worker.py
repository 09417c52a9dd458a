"""One device's worker process (`model.placement: workers`): a Synthesizer on its device (LLM
engine + token2wav) serving the server's front process over a pipe. The front (worker_pool.py)
keeps the doors, the RequestFront (text normalization and tokens, voices, speaker store),
admission and metrics; here run only the devices' parts (`Synthesizer.speak`, `speak_stream`), on
an event loop and a GIL of their own.

One duplex pipe of pickled messages (multiprocessing's Connection):

    front -> worker   ("speak", key, SpeakOrder)      a checked request and its model inputs
                      ("stream", key, StreamOrder)    a text stream: its request, voice, instruction, mode
                      ("text", key, token_ids)        the stream's next text tokens (RequestFront.stream_tokens)
                      ("text_end", key)               the stream's text is complete
                      ("cancel", key)                 its caller went away
                      ("call", key, method, args)     prepare_speaker(record), forget_speaker(speaker_id),
                                                      stats() (nothing: the reply carries them)
                      ("stop",)
    worker -> front   ("ready", WorkerInfo) | ("failed", None, error)   once, after loading + warm-up
                      ("chunk", key, AudioChunk, WorkerStats)
                      ("end", key, None, WorkerStats) | ("error", key, error, WorkerStats)
                      ("result", key, value, WorkerStats)

Every reply carries the worker's current WorkerStats (engine, stage counters, memory, CUDA graph
state), so the front's metrics are as fresh as the last message; a metrics scrape asks for them
(`stats`), since a worker changes after its last reply too (it captures wanted CUDA graphs). The
worker stops when told, when the front's end of the pipe closes (the server died), or with exit
code 3 when its engine (or token2wav process) dies; the front then restarts it.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
from dataclasses import dataclass, field
from typing import AsyncIterator

import torch

from .config import Config
from .cost import device_memory
from .engine.base import EngineStats
from .frontend.model_input import ModelInput
from .request import AudioChunk, SynthesisRequest, Voice
from .request_front import TextMode
from .stage_stats import StageStats
from .token2wav.graph_state import DeviceGraphState, graph_state_of
from .token2wav.process import picklable, pipe_inbox
from .tts import Synthesizer

log = logging.getLogger(__name__)

ENGINE_DEAD_EXIT_CODE = 3


@dataclass(frozen=True)
class WorkerInfo:
    """What a worker tells the front once it serves."""
    pid: int
    sample_rate: int
    supports_bistream: bool
    memory_total: int  # the device's memory (cost.device_memory): the front's bound per request


@dataclass(frozen=True)
class WorkerStats:
    engine: EngineStats = field(default_factory=EngineStats)
    stages: tuple[StageStats, ...] = ()
    memory_bytes: int = 0  # CUDA: the caching allocator's reserved bytes on the device; CPU: the process RSS
    graphs: DeviceGraphState | None = None  # its token2wav's CUDA graphs (graph_state.graph_state_of)

    @property
    def busy_s(self) -> float:
        return sum(s.busy_s for s in self.stages)


@dataclass(frozen=True)
class SpeakOrder:
    request: SynthesisRequest  # checked, without its audio (the inputs carry what the devices need)
    inputs: list[ModelInput]


@dataclass(frozen=True)
class StreamOrder:
    request: SynthesisRequest  # checked, without its audio
    voice: Voice
    instruction: list[int]     # instruction token ids (instruct2 modes)
    mode: TextMode             # bistream: one LM request fed the tokens; sentence: an utterance per list


_TEXT_END = object()


def device_memory_bytes(device: str) -> int:
    if device.startswith("cuda"):
        return torch.cuda.memory_reserved(torch.device(device))
    with open("/proc/self/statm") as f:  # resident pages
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def serve_device(config_json: dict, conn, warmup: bool = True, threads: int | None = None) -> None:
    """The worker process (spawned: CUDA cannot be forked): load (and warm up) a Synthesizer on
    `model.device` of the single-device config, say ready, serve the pipe. threads: torch's CPU
    threads here (the host's cores shared by the workers, not each taking all of them)."""
    config = Config.model_validate(config_json)
    device = config.model.device
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s worker[{device}] %(name)s: %(message)s")
    if threads is not None:
        torch.set_num_threads(threads)
    if torch.device(device).type == "cuda":
        # whatever says just "cuda" (a stream, a graph pool, a library's default) means this worker's
        # card, not cuda:0 of every worker
        torch.cuda.set_device(torch.device(device))
    code = asyncio.run(_serve(config, conn, warmup))
    conn.close()
    os._exit(code)  # not the interpreter's exit: a stuck non-daemon thread of an engine must not hold it


async def _serve(config: Config, conn, warmup: bool) -> int:
    try:
        synth = await Synthesizer.create(config, warmup=warmup)
    except BaseException as e:  # noqa: BLE001 — reported to the front, which raises it
        conn.send(("failed", None, picklable(e)))
        return 1
    conn.send(("ready", WorkerInfo(os.getpid(), synth.sample_rate, synth.supports_bistream,
                                  device_memory(synth.config.model.device))))
    return await _WorkerServer(conn, synth).serve()


class _WorkerServer:
    def __init__(self, conn, synth: Synthesizer):
        self.conn = conn
        self.synth = synth
        self.device = synth.config.model.device
        self.tasks: dict[int, asyncio.Task] = {}
        self.texts: dict[int, asyncio.Queue] = {}
        self._send_lock = threading.Lock()

    async def serve(self) -> int:
        loop = asyncio.get_running_loop()
        inbox = pipe_inbox(self.conn, "worker-pipe")
        death = asyncio.ensure_future(self.synth.wait_dead())
        code = 0
        while True:
            next_message = asyncio.ensure_future(inbox.get())
            await asyncio.wait([next_message, death], return_when=asyncio.FIRST_COMPLETED)
            if death.done():
                next_message.cancel()
                log.critical("%s: this worker exits with code %d and is restarted", death.result(),
                             ENGINE_DEAD_EXIT_CODE)
                code = ENGINE_DEAD_EXIT_CODE
                break
            message = next_message.result()
            if message[0] == "stop":
                break
            self._handle(loop, *message)
        death.cancel()
        for task in self.tasks.values():
            task.cancel()
        await asyncio.gather(*self.tasks.values(), return_exceptions=True)
        if code == 0:
            await self.synth.close()
        return code

    def _handle(self, loop: asyncio.AbstractEventLoop, kind: str, key, *rest) -> None:
        if kind == "speak":
            order: SpeakOrder = rest[0]
            self.tasks[key] = loop.create_task(self._stream(key, self.synth.speak(order.request, order.inputs)))
        elif kind == "stream":
            order: StreamOrder = rest[0]
            text = self.texts[key] = asyncio.Queue()
            chunks = self.synth.speak_stream(order.request, order.voice, order.instruction, order.mode,
                                             _text_tokens(text))
            self.tasks[key] = loop.create_task(self._stream(key, chunks))
        elif kind == "text":
            if (text := self.texts.get(key)) is not None:
                text.put_nowait(rest[0])
        elif kind == "text_end":
            if (text := self.texts.get(key)) is not None:
                text.put_nowait(_TEXT_END)
        elif kind == "cancel":
            if (task := self.tasks.get(key)) is not None:
                task.cancel()
        elif kind == "call":
            method, args = rest
            self.tasks[key] = loop.create_task(self._call(key, method, args))

    def stats(self) -> WorkerStats:
        return WorkerStats(self.synth.engine_stats(), tuple(s.copy() for s in self.synth.stage_stats()),
                           device_memory_bytes(self.device), graph_state_of(self.synth.batcher))

    def _send(self, kind: str, key, value) -> None:
        try:
            with self._send_lock:
                self.conn.send((kind, key, value, self.stats()))
        except (OSError, ValueError):  # the front is gone: the pump stops the loop
            pass

    async def _stream(self, key: int, chunks: AsyncIterator[AudioChunk]) -> None:
        try:
            async with contextlib.aclosing(chunks):
                async for chunk in chunks:
                    self._send("chunk", key, chunk)
            self._send("end", key, None)
        except asyncio.CancelledError:
            pass  # the front gave up on it
        except Exception as e:  # noqa: BLE001 — the front's caller gets it
            self._send("error", key, picklable(e))
        finally:
            self.tasks.pop(key, None)
            self.texts.pop(key, None)

    async def _call(self, key, method: str, args: tuple) -> None:
        calls = {"prepare_speaker": self.synth.prepare_speaker, "forget_speaker": self.synth.batcher.forget_speaker,
                 "stats": lambda: None}  # every reply carries the stats
        try:
            result = calls[method](*args)
            if asyncio.iscoroutine(result):
                result = await result
            if key is not None:
                self._send("result", key, result)
        except asyncio.CancelledError:
            pass
        except Exception as e:  # noqa: BLE001 — the front's caller gets it
            if key is not None:
                self._send("error", key, picklable(e))
        finally:
            self.tasks.pop(key, None)


async def _text_tokens(text: asyncio.Queue) -> AsyncIterator[list[int]]:
    while (tokens := await text.get()) is not _TEXT_END:
        yield tokens
