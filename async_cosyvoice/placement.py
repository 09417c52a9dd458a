"""Several devices behind one synthesizer: `model.devices` with `model.placement`.

    workers         (the default) a worker process per device, each with its own LLM engine and
                    token2wav, behind the server's front process (worker_pool.py): one GIL per
                    device, so the devices add up
    replicas        a whole Synthesizer per device in this process (one GIL for all: they do
                    not add up; kept for comparison); each request goes to the running replica
                    with the fewest active requests (`ReplicaRouter`, the Synthesizer's public
                    interface); a replica that stops ends its requests with NotReady (retry) and
                    takes no new ones, the others carry on
    disaggregated   one Synthesizer whose LLM engine runs on the first device, with one token2wav
                    worker (batcher + runner) per other device; each utterance goes to the worker
                    with the fewest open streams and stays there (`Token2WavPool.pick`)

`create_synthesizer(config)` is what a server calls; with one device it is `Synthesizer.create`.
Speakers are one store shared by all replicas. `device_stats(synth)` reports the load per device.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import AsyncIterator, Iterator

import torch

from .config import Config
from .devices import DeviceStats, devices_of, on_device
from .engine.base import EngineStats, first_death
from .errors import NotReady
from .graph_buckets import CapturePlan
from .model_dir import ModelDir
from .request import Audio, AudioChunk, SynthesisRequest
from .stage_stats import StageStats, totals
from .startup import Startup
from .token2wav import Token2WavJob, Token2WavStream
from .token2wav.batcher import Token2WavBatcher
from .token2wav.graph_state import graph_state_of
from .token2wav.process import Token2WavProcess, token2wav_worker
from .tts import Synthesizer
from .worker_pool import WorkerPool

log = logging.getLogger(__name__)


async def create_synthesizer(config: Config, warmup: bool = True,
                             startup: Startup | None = None) -> "Synthesizer | ReplicaRouter | WorkerPool":
    """`startup` (startup.py) follows the steps; after a warm-up its phase table is logged."""
    startup = startup or Startup()
    devices = devices_of(config)
    if len(devices) == 1:
        synth = await Synthesizer.create(on_device(config, devices[0]), warmup=warmup, startup=startup)
    elif config.model.placement == "workers":  # the worker processes load, compile and warm up themselves
        with startup.span("warm-up", "starting the worker processes (each loads, compiles and warms up)"):
            synth = await WorkerPool.create(config, warmup=warmup)
    elif config.model.placement == "replicas":
        synth = await ReplicaRouter.create(config, warmup=warmup, startup=startup)
    else:
        synth = await create_disaggregated(config, warmup=warmup, startup=startup)
    if warmup:
        log.info("%s", startup.finish().table())
    return synth


# ---- replicas ----------------------------------------------------------------------------------


@dataclass(eq=False)
class _Replica:
    synth: Synthesizer
    device: str
    active: int = 0
    served: int = 0


class ReplicaRouter:
    """N Synthesizers (one per device) behind the Synthesizer's public interface. A request goes
    to the replica with the fewest active requests (ties: the one that has served fewest), and
    stays there until its last chunk."""

    def __init__(self, replicas: list[Synthesizer], devices: list[str]):
        if not replicas or len(replicas) != len(devices):
            raise ValueError("one Synthesizer per device")
        shared = replicas[0].speakers
        for synth in replicas[1:]:  # one store: a speaker registered anywhere is seen everywhere
            synth.speakers = shared
        self.replicas = [_Replica(s, d) for s, d in zip(replicas, devices)]
        first = replicas[0]
        self.config = first.config
        self.model_dir = first.model_dir
        self.dims = first.dims
        self.sample_rate = first.sample_rate
        self.speakers = shared

    @classmethod
    async def create(cls, config: Config, warmup: bool = True, startup: Startup | None = None) -> "ReplicaRouter":
        devices = devices_of(config)
        # one replica after another: torch.compile is not thread-safe (two replicas compiling their LLM
        # step at once failed on an H100 pair: "using FX to symbolically trace a dynamo-optimized function")
        synths: list[Synthesizer] = []
        try:
            for d in devices:
                synths.append(await Synthesizer.create(on_device(config, d), warmup=warmup, startup=startup,
                                                       serve_captures=False))
            if warmup:  # every replica compiled: from now on nothing compiles (Synthesizer.serve_captures)
                for s in synths:
                    await s.serve_captures()
        except BaseException:
            for s in synths:
                await s.close()
            raise
        log.info("replicas on %s", ", ".join(devices))
        return cls(list(synths), devices)

    @property
    def ready(self) -> bool:
        """Serving while any replica is (a stopped one takes no new requests)."""
        return any(r.synth.ready for r in self.replicas)

    @property
    def supports_bistream(self) -> bool:
        return all(r.synth.supports_bistream for r in self.replicas)

    def _pick(self) -> _Replica:
        live = [r for r in self.replicas if r.synth.ready]
        if not live:
            raise NotReady("no device replica is running; retry on another instance")
        return min(live, key=lambda r: (r.active, r.served))

    @contextlib.contextmanager
    def _assigned(self) -> Iterator[_Replica]:
        replica = self._pick()
        replica.active += 1
        replica.served += 1
        try:
            yield replica
        finally:
            replica.active -= 1

    async def _route(self, method: str, *args, **kwargs) -> AsyncIterator[AudioChunk]:
        with self._assigned() as replica:
            try:
                async with contextlib.aclosing(getattr(replica.synth, method)(*args, **kwargs)) as chunks:
                    async for chunk in chunks:
                        yield chunk
            except (Exception, asyncio.CancelledError) as e:
                # a replica stopped under the request (its engine ends requests with NotReady, its
                # batcher cancels pending chunk jobs): retryable, unless our caller cancelled us
                if replica.synth.ready or asyncio.current_task().cancelling() or isinstance(e, NotReady):
                    raise
                raise NotReady(f"the replica on {replica.device} stopped during this request; retry") from e

    def synthesize(self, request: SynthesisRequest) -> AsyncIterator[AudioChunk]:
        return self._route("synthesize", request)

    def synthesize_stream(self, *args, **kwargs) -> AsyncIterator[AudioChunk]:
        return self._route("synthesize_stream", *args, **kwargs)

    async def register_speaker(self, speaker_id: str, prompt_text: str, audio: Audio, overwrite: bool = False):
        with self._assigned() as replica:
            record = await replica.synth.register_speaker(speaker_id, prompt_text, audio, overwrite=overwrite)
        # every replica prepares the new speaker before the registration returns, not only the one
        # that computed it (on an H200 pair the first request after a registration took 1.39 s, 9x the
        # warm first chunk, on the other replica); one at a time: warm-up compiles (see create)
        for r in self.replicas:
            if r is not replica and r.synth.ready:  # a stopped replica takes no requests
                await r.synth.prepare_speaker(record)
        return record

    async def delete_speaker(self, speaker_id: str) -> None:
        await asyncio.to_thread(self.speakers.delete, speaker_id)  # one store for every replica
        for r in self.replicas:  # stopped ones too: their caches still hold memory
            r.synth.batcher.forget_speaker(speaker_id)

    def engine_stats(self) -> EngineStats:
        stats = [r.synth.engine_stats() for r in self.replicas]
        return EngineStats(running=sum(s.running for s in stats), waiting=sum(s.waiting for s in stats),
                           kv_usage=max(s.kv_usage for s in stats))

    def device_stats(self) -> list[DeviceStats]:
        return [DeviceStats(r.device, "replica", r.active, r.served, r.synth.engine_stats(),
                            graphs=graph_state_of(r.synth.batcher)) for r in self.replicas]

    def stage_stats(self) -> list[StageStats]:
        return totals([st for r in self.replicas for st in r.synth.stage_stats()])

    async def wait_dead(self) -> str:
        """Returns once every replica's engine (or token2wav process) has died; one dead replica
        only stops taking requests."""
        return "; ".join(await asyncio.gather(*(r.synth.wait_dead() for r in self.replicas)))

    async def warmup(self) -> None:
        for r in self.replicas:  # one at a time: warm-up compiles (see create)
            await r.synth.warmup()

    async def close(self) -> None:
        await asyncio.gather(*(r.synth.close() for r in self.replicas))


# ---- disaggregated -----------------------------------------------------------------------------


class Token2WavWorker:
    """One device's token2wav batcher (in this process or a child's), counting the streams it
    serves: a segment's stream is open from the start of its Utterance.run to its end, however it
    ends (`stream_started` / `stream_ended`, passed on to the batcher's own count). `submit` is the
    batcher's."""

    def __init__(self, batcher: Token2WavBatcher | Token2WavProcess, device: str):
        self.batcher = batcher
        self.device = device
        self.open_streams = 0
        self.served = 0  # utterances assigned

    def open_stream(self, *args, **kwargs) -> Token2WavStream:
        return self.batcher.open_stream(*args, **kwargs)

    def stream_started(self, stream: Token2WavStream) -> None:
        self.open_streams += 1
        self.batcher.stream_started(stream)

    def stream_ended(self, stream: Token2WavStream) -> None:
        self.open_streams -= 1
        self.batcher.stream_ended(stream)

    async def submit(self, job: Token2WavJob, deadline: float) -> torch.Tensor:
        return await self.batcher.submit(job, deadline)


class Token2WavPool:
    """Token2WavBatchers on several devices in the Synthesizer's `batcher` slot. The Synthesizer
    calls `pick()` once per utterance (a plain Token2WavBatcher returns itself) and sends all of
    the utterance's jobs there, because its caches live on that device; `pick` returns the worker
    with the fewest open streams (ties: the one given fewest utterances)."""

    def __init__(self, batchers: list[Token2WavBatcher | Token2WavProcess], devices: list[str]):
        if not batchers or len(batchers) != len(devices):
            raise ValueError("one batcher per device")
        self.workers = [Token2WavWorker(b, d) for b, d in zip(batchers, devices)]

    def stage_stats_list(self) -> list[StageStats]:
        return [w.batcher.stage_stats for w in self.workers]

    def pick(self) -> Token2WavWorker:
        worker = min(self.workers, key=lambda w: (w.open_streams, w.served))
        worker.served += 1
        return worker

    def device_stats(self) -> list[DeviceStats]:
        return [DeviceStats(w.device, "token2wav", w.open_streams, w.served, graphs=graph_state_of(w.batcher))
                for w in self.workers]

    async def prepare_speaker(self, prompt_token: torch.Tensor, prompt_feat: torch.Tensor, embedding: torch.Tensor,
                              speaker_id: str) -> bool:
        """On every worker: any of them may take the speaker's next utterance."""
        kept = await asyncio.gather(*(w.batcher.prepare_speaker(prompt_token, prompt_feat, embedding, speaker_id)
                                      for w in self.workers))
        return all(kept)

    def forget_speaker(self, speaker_id: str) -> None:
        for w in self.workers:
            w.batcher.forget_speaker(speaker_id)

    async def wait_dead(self) -> str:
        """Returns when a worker's process died (in-process workers never do)."""
        return await first_death(*(w.batcher.wait_dead() for w in self.workers))

    async def capture_graphs(self, plan: CapturePlan, *, defer: bool = False, and_wanted: bool = False) -> int:
        # one worker after another: a capture's warm-up runs may torch.compile, which is not
        # thread-safe (see ReplicaRouter.create)
        return sum([await w.batcher.capture_graphs(plan, defer=defer, and_wanted=and_wanted) for w in self.workers])

    async def serve_captures(self) -> None:
        for w in self.workers:
            await w.batcher.serve_captures()

    async def close(self) -> None:
        await asyncio.gather(*(w.batcher.close() for w in self.workers))


def build_token2wav_pool(config: Config, model_dir: ModelDir, devices: list[str]) -> Token2WavPool:
    """One token2wav worker per device, loaded side by side."""
    with ThreadPoolExecutor(max_workers=len(devices), thread_name_prefix="token2wav-load") as pool:
        batchers = list(pool.map(lambda d: token2wav_worker(config, model_dir, d), devices))
    return Token2WavPool(batchers, devices)


async def create_disaggregated(config: Config, warmup: bool = True, startup: Startup | None = None) -> Synthesizer:
    """A Synthesizer on the first device (the LM only: no flow or HiFT there) whose batcher is a
    Token2WavPool over the other devices."""
    llm_device, *t2w_devices = devices_of(config)
    startup = startup or Startup()
    synth = await Synthesizer.create(on_device(config, llm_device), warmup=False, startup=startup,
                                     token2wav=lambda model_dir: build_token2wav_pool(config, model_dir, t2w_devices))
    pool = synth.batcher
    if warmup:
        synth.ready = False
        await synth.warm_start(startup, rounds=len(pool.workers))
        await synth.serve_captures()
        synth.ready = True
    log.info("LLM on %s, token2wav on %s", llm_device, ", ".join(t2w_devices))
    return synth


def device_stats(synth: "Synthesizer | ReplicaRouter | WorkerPool") -> list[DeviceStats]:
    """The load per device of whatever `create_synthesizer` made."""
    if isinstance(synth, (ReplicaRouter, WorkerPool)):
        return synth.device_stats()
    if not isinstance(synth, Synthesizer):  # e.g. Ray Serve's ingress: its replicas report their own
        return []
    engine = synth.engine_stats()
    if isinstance(synth.batcher, Token2WavPool):
        return [DeviceStats(synth.config.model.device, "llm", engine.running, engine=engine),
                *synth.batcher.device_stats()]
    return [DeviceStats(synth.config.model.device, "all", engine.running, engine=engine,
                        graphs=graph_state_of(synth.batcher))]
