"""When the token2wav batcher captures the CUDA graphs that requests wanted (token2wav/batcher.py):
only in its device thread, one at a time, while no job is queued and no stream is open; a job
that arrives during a capture runs before the next one; and every way a request ends (finished,
closed by its consumer, cancelled, failed) closes its stream's count, through the real Synthesizer.

A capture itself needs CUDA (tests/test_graph_buckets_defer.py, run on a GPU); here the runner is
the real one on the tiny model, with its `capture_wanted` / `wants_capture` standing in for the
graph holders' so that the batcher's order of batches and captures can be read back.
"""
from __future__ import annotations

import asyncio
import contextlib
import threading
import time

import numpy as np
import pytest
import torch
from conftest import next_job_upto

from async_cosyvoice.config import Config
from async_cosyvoice.errors import TextTimeout
from async_cosyvoice.model_dir import build_models, load_model_dir
from async_cosyvoice.models.hift import NSFNoise
from async_cosyvoice.request import FLUSH, Mode, SynthesisOptions, SynthesisRequest
from async_cosyvoice.token2wav import ChunkSchedule, Token2WavRunner, Token2WavStream
from async_cosyvoice.token2wav.batcher import Token2WavBatcher
from async_cosyvoice.tts import SyncSynthesizer
from async_cosyvoice.warmup import capture_plan

torch.set_num_threads(1)

TOKENS = [(7 * i + 11) % 6561 for i in range(120)]
WAIT_S = 60  # a bound for a hung test, never a measured time


class CaptureLog(Token2WavRunner):
    """The real runner; its wanted graphs are names in a list, a "capture" logs the name (in the
    device thread) and, for names in `hold`, waits there until the test releases it."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.events: list[str] = []
        self.wanted: list[str] = []
        self.hold: dict[str, threading.Event] = {}
        self.capturing: dict[str, asyncio.Event] = {}
        self.drained: asyncio.Event | None = None
        self.loop: asyncio.AbstractEventLoop | None = None

    def want(self, *names: str) -> None:
        self.loop = asyncio.get_running_loop()
        self.drained = asyncio.Event()
        self.wanted.extend(names)

    @property
    def wants_capture(self) -> bool:
        return bool(self.wanted)

    def capture_wanted(self) -> bool:
        assert threading.current_thread().name.startswith("token2wav")  # the device thread
        if not self.wanted:
            return False
        name = self.wanted.pop(0)
        self.events.append(f"capture {name}")
        if name in self.capturing:
            self.loop.call_soon_threadsafe(self.capturing[name].set)
        if name in self.hold:
            assert self.hold[name].wait(WAIT_S)
        if not self.wanted:
            self.loop.call_soon_threadsafe(self.drained.set)
        return True

    def run_many(self, jobs):
        self.events.append(f"batch of {len(jobs)}")
        return super().run_many(jobs)


@pytest.fixture(scope="module")
def models(tiny_dir):
    return build_models(load_model_dir(tiny_dir))


@pytest.fixture(scope="module")
def prompt(golden_dir):
    mi = np.load(golden_dir / "model_inputs.npz")
    tok = torch.from_numpy(mi["zero_shot/flow_prompt_speech_token"])[:, :20]
    feat = torch.from_numpy(mi["zero_shot/prompt_speech_feat"])[:, :40]
    return tok, feat, torch.from_numpy(mi["zero_shot/flow_embedding"])


def new_stream(prompt) -> Token2WavStream:
    return Token2WavStream(*prompt, schedule=ChunkSchedule(first_hop=10, max_hop_multiple=1, prompt_align=1),
                           noise=NSFNoise.zero())


def test_captures_wait_until_no_job_is_queued_and_no_stream_is_open(models, prompt):
    async def scenario():
        runner = CaptureLog(models.flow, models.hift)
        batcher = Token2WavBatcher(runner)
        try:
            runner.want("a", "b", "c")
            stream = new_stream(prompt)
            batcher.stream_started()
            await batcher.submit(next_job_upto(stream, TOKENS, False), time.monotonic())
            await batcher.submit(next_job_upto(stream, TOKENS, False), time.monotonic())
            await batcher.run_on_device(lambda: None)  # anything queued in the device thread has run
            while_open = list(runner.events)
            batcher.stream_ended()  # the last open stream: the batcher captures now
            await asyncio.wait_for(runner.drained.wait(), WAIT_S)
            # the loop counts a capture once it is back from the device thread, before it takes the
            # next batch: a job run after the last capture reads the count without a race
            await batcher.submit(next_job_upto(new_stream(prompt), TOKENS, False), time.monotonic())
            return while_open, runner.events, batcher.open_streams, batcher.idle_captures
        finally:
            await batcher.close()

    while_open, events, still_open, captured = asyncio.run(scenario())
    assert while_open == ["batch of 1", "batch of 1"]  # a playing stream's jobs, no capture between them
    assert events == ["batch of 1", "batch of 1", "capture a", "capture b", "capture c", "batch of 1"]
    assert still_open == 0 and captured == 3


def test_a_job_arriving_during_a_capture_runs_before_the_next_capture(models, prompt):
    async def scenario():
        runner = CaptureLog(models.flow, models.hift)
        batcher = Token2WavBatcher(runner)
        try:
            runner.want("a", "b", "c")
            runner.hold["a"], runner.capturing["a"] = threading.Event(), asyncio.Event()
            batcher.stream_started()
            batcher.stream_ended()
            await asyncio.wait_for(runner.capturing["a"].wait(), WAIT_S)
            # a new request's first chunk while "a" is being captured: it waits for that one only
            stream = new_stream(prompt)
            batcher.stream_started()
            first = asyncio.ensure_future(batcher.submit(next_job_upto(stream, TOKENS, False), time.monotonic()))
            await asyncio.sleep(0)
            runner.hold["a"].set()
            await asyncio.wait_for(first, WAIT_S)
            await batcher.run_on_device(lambda: None)
            while_open = list(runner.events)  # its stream is still open: no capture after its chunk
            batcher.stream_ended()
            await asyncio.wait_for(runner.drained.wait(), WAIT_S)
            # a job with no open stream at all (the batcher only knows the queue): still before "c"
            runner.want("d", "e")
            runner.hold["d"], runner.capturing["d"] = threading.Event(), asyncio.Event()
            batcher.stream_started()
            batcher.stream_ended()
            await asyncio.wait_for(runner.capturing["d"].wait(), WAIT_S)
            other = asyncio.ensure_future(batcher.submit(next_job_upto(new_stream(prompt), TOKENS, False),
                                                         time.monotonic()))
            await asyncio.sleep(0)
            runner.hold["d"].set()
            await asyncio.wait_for(other, WAIT_S)
            await asyncio.wait_for(runner.drained.wait(), WAIT_S)
            return while_open, runner.events
        finally:
            await batcher.close()

    while_open, events = asyncio.run(scenario())
    assert while_open == ["capture a", "batch of 1"]
    assert events == ["capture a", "batch of 1", "capture b", "capture c", "capture d", "batch of 1", "capture e"]


def test_a_failed_capture_does_not_stop_the_batcher(models, prompt):
    """An error out of the runner's capture (GraphBuckets.capture_wanted catches a capture's own
    failure; this is anything else) is logged; the batcher keeps serving."""
    class Failing(CaptureLog):
        def capture_wanted(self) -> bool:
            super().capture_wanted()
            raise RuntimeError("CUDA out of memory (stand-in)")

    async def scenario():
        runner = Failing(models.flow, models.hift)
        batcher = Token2WavBatcher(runner)
        try:
            runner.want("a")
            batcher.stream_started()
            batcher.stream_ended()
            await asyncio.wait_for(runner.drained.wait(), WAIT_S)
            samples = await batcher.submit(next_job_upto(new_stream(prompt), TOKENS, False), time.monotonic())
            return samples, runner.events, batcher.idle_captures
        finally:
            await batcher.close()

    samples, events, captured = asyncio.run(scenario())
    assert samples.numel() > 0 and events == ["capture a", "batch of 1"] and captured == 0


def test_a_stream_ending_after_close_starts_nothing(models):
    """A server stopping cancels its requests; their streams end after the batcher closed: no
    capture, no new loop on a shut-down device thread."""
    async def scenario():
        runner = CaptureLog(models.flow, models.hift)
        batcher = Token2WavBatcher(runner)
        batcher.stream_started()
        await batcher.close()
        runner.want("a")
        batcher.stream_ended()
        await asyncio.sleep(0)
        return batcher._task, runner.events, batcher.open_streams

    assert asyncio.run(scenario()) == (None, [], 0)


# -- through the Synthesizer: every way a request ends closes its stream's count


@pytest.fixture(scope="module")
def synth(tiny_dir, tmp_path_factory):
    config = Config.model_validate({"model": {"dir": str(tiny_dir)}, "token2wav": {"adaptive": False},
                                    "limits": {"text_idle_seconds": 0.5},
                                    "speakers": {"dir": str(tmp_path_factory.mktemp("spk"))}})
    s = SyncSynthesizer(config)
    s.synth.speakers.import_spk2info(tiny_dir / "spk2info.pt")
    yield s
    s.close()


def _request(stream: bool = True, max_tokens: int = 60, text: str = "Hello there. This is a short test.") -> SynthesisRequest:
    return SynthesisRequest(Mode.SFT, text=text, speaker_id="tiny_sft_spk",
                            options=SynthesisOptions(stream=stream, seed=7, max_tokens=max_tokens))


def test_the_open_stream_count_returns_to_zero_however_a_request_ends(synth):
    s = synth.synth
    batcher = s.batcher

    async def finished():
        seen = [batcher.open_streams async for _ in s.synthesize(_request())]
        return seen, batcher.open_streams

    async def closed_by_its_consumer():  # the client went away after the first chunk
        chunks = s.synthesize(_request(max_tokens=400))
        await anext(chunks)
        during = batcher.open_streams
        await chunks.aclose()
        return during, batcher.open_streams

    async def cancelled():  # the handler's task cancelled (deadline, server stop) mid-request
        first = asyncio.Event()

        async def consume():
            async for _ in s.synthesize(_request(max_tokens=400)):
                first.set()
        task = asyncio.create_task(consume())
        await asyncio.wait_for(first.wait(), WAIT_S)
        during = batcher.open_streams
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return during, batcher.open_streams

    async def failed():  # a text stream that stalls past limits.text_idle_seconds: TextTimeout mid-request
        open_at_stall = []

        async def text():
            yield "A first sentence to speak, long enough for the speech to start before the text stalls."
            yield FLUSH
            open_at_stall.append(batcher.open_streams)  # the utterance runs: it pulls its text
            await asyncio.Event().wait()  # never another piece
        with pytest.raises(TextTimeout):
            async for _ in s.synthesize_stream(text(), _request(max_tokens=400, text="")):
                pass
        return open_at_stall, batcher.open_streams

    # 2 while a request speaks: the request's hold (Synthesizer._held) and its segment's stream
    seen, after = synth.call(finished())
    assert seen and all(n == 2 for n in seen) and after == 0
    assert synth.call(closed_by_its_consumer()) == (2, 0)
    assert synth.call(cancelled()) == (2, 0)
    assert synth.call(failed()) == ([2], 0)


def test_a_request_holds_the_device_between_its_segments(synth):
    """Sentence mode: while a streamed text's next sentence is awaited, none of the request's
    segments is open, but the request still holds the device, so no capture can start then."""
    s = synth.synth
    batcher = s.batcher

    async def scenario():
        more = asyncio.Event()

        async def text():
            yield "A first sentence to speak."
            yield FLUSH
            while not more.is_set():  # an empty FLUSH now and then: alive for limits.text_idle_seconds
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(more.wait(), 0.1)
                yield FLUSH
            yield "And a second one."

        chunks = s.synthesize_stream(text(), _request(max_tokens=None, text=""), text_mode="sentence")
        async with contextlib.aclosing(chunks):
            while not (chunk := await anext(chunks)).segment_tokens:  # the first segment's last chunk
                pass
            nxt = asyncio.ensure_future(anext(chunks))
            # no chunk can come before the text goes on; the request closes its first segment meanwhile
            done, _ = await asyncio.wait({nxt}, timeout=1.0)
            between = (bool(done), batcher.open_streams)
            more.set()
            rest = [await nxt] + [c async for c in chunks]
        return between, rest[-1].is_final, batcher.open_streams

    assert synth.call(scenario()) == ((False, 1), True, 0)


def test_the_warm_up_captures_what_its_own_requests_wanted(models):
    """Before SERVING (Token2WavBatcher.capture_graphs): the plan, then every bucket the warm-up's
    own requests left wanted, so none is left for an idle moment after SERVING, when the first
    request could arrive during it."""
    async def scenario():
        runner = CaptureLog(models.flow, models.hift)
        batcher = Token2WavBatcher(runner)
        try:
            runner.want("a", "b")
            batcher.stream_started()  # a warm-up request still open: nothing is captured while idle
            await batcher.capture_graphs(capture_plan(Config()))
            during, wanted = list(runner.events), list(runner.wanted)
            batcher.stream_ended()
            await batcher.run_on_device(lambda: None)
            return during, wanted, runner.events, batcher.idle_captures
        finally:
            await batcher.close()

    during, wanted, events, idle = asyncio.run(scenario())
    assert during == ["capture a", "capture b"] and wanted == []
    assert events == during and idle == 0
