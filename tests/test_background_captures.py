"""Where the token2wav batcher captures the CUDA graphs that requests wanted (token2wav/batcher.py):
in a capture thread of its own, one at a time, while its device thread goes on running batches (a
job submitted during a capture does not wait for it); the warm-up's captures go through the same
thread; a failed capture stops nothing; and every way a request ends (finished, closed by its
consumer, cancelled, failed) closes its device's open-stream count, through the real Synthesizer.

A capture itself needs CUDA (tests/test_graph_buckets_defer.py, run on a GPU, also captures in
one thread while another calls); here the runner is the real one on the tiny model, with its
`capture_wanted` / `wants_capture` standing in for the graph holders' so that the batcher's
batches and captures can be read back.
"""
from __future__ import annotations

import asyncio
import sys
import threading
import time

import numpy as np
import pytest
import torch
from conftest import next_job_upto
from torch._dynamo.utils import counters

from async_cosyvoice.compile_cache import resume_compiling, stop_compiling
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
    capture thread) and, for names in `hold`, waits there until the test releases it."""

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
        assert threading.current_thread().name.startswith("token2wav-capture")  # never the device thread
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
        assert not threading.current_thread().name.startswith("token2wav-capture")
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


def test_a_job_runs_while_a_capture_is_under_way(models, prompt):
    """A batch leaves buckets wanted: the capture thread takes them one by one, and a job submitted
    while the first capture is held runs at once, beside it."""
    async def scenario():
        runner = CaptureLog(models.flow, models.hift)
        batcher = Token2WavBatcher(runner)
        await batcher.serve_captures()
        try:
            told = []  # what a token2wav child's server does with it: tell its parent the new graph state
            batcher.on_capture = lambda: told.append((batcher.background_captures, batcher.capturing))
            runner.want("a", "b")
            runner.hold["a"], runner.capturing["a"] = threading.Event(), asyncio.Event()
            stream = new_stream(prompt)
            await batcher.submit(next_job_upto(stream, TOKENS, False), time.monotonic())  # then "a" starts
            await asyncio.wait_for(runner.capturing["a"].wait(), WAIT_S)
            # "a" is being captured (held): the stream's next chunk and a new stream's first run now
            await asyncio.wait_for(batcher.submit(next_job_upto(stream, TOKENS, False), time.monotonic()), WAIT_S)
            await asyncio.wait_for(batcher.submit(next_job_upto(new_stream(prompt), TOKENS, False),
                                                  time.monotonic()), WAIT_S)
            during = list(runner.events)
            runner.hold["a"].set()
            await asyncio.wait_for(runner.drained.wait(), WAIT_S)
            await asyncio.wait_for(batcher._capturing, WAIT_S)  # it counts "b" before it ends
            return during, runner.events, batcher.background_captures, batcher.open_streams, told
        finally:
            await batcher.close()

    during, events, captured, still_open, told = asyncio.run(scenario())
    assert during == ["batch of 1", "capture a", "batch of 1", "batch of 1"]
    assert events == during + ["capture b"] and captured == 2 and still_open == 0
    # after each capture, and once the round is over (a child's last word must not say "capturing")
    assert told == [(1, True), (2, True), (2, False)]


def test_a_failed_capture_does_not_stop_the_batcher(models, prompt):
    """An error out of the runner's capture (GraphBuckets.capture_wanted catches a capture's own
    failure; this is anything else) is logged; the batcher keeps serving, and a later batch that
    leaves something wanted starts the capture thread again."""
    class Failing(CaptureLog):
        def capture_wanted(self) -> bool:
            super().capture_wanted()
            raise RuntimeError("CUDA out of memory (stand-in)")

    async def scenario():
        runner = Failing(models.flow, models.hift)
        batcher = Token2WavBatcher(runner)
        await batcher.serve_captures()
        try:
            runner.want("a")
            await batcher.run_on_device(lambda: None)  # anything run on the device starts the captures
            await asyncio.wait_for(runner.drained.wait(), WAIT_S)
            await asyncio.wait_for(batcher._capturing, WAIT_S)
            runner.want("b")
            samples = await batcher.submit(next_job_upto(new_stream(prompt), TOKENS, False), time.monotonic())
            await asyncio.wait_for(runner.drained.wait(), WAIT_S)
            await asyncio.wait_for(batcher._capturing, WAIT_S)
            return samples, runner.events, batcher.background_captures
        finally:
            await batcher.close()

    samples, events, captured = asyncio.run(scenario())
    assert samples.numel() > 0 and events == ["capture a", "batch of 1", "capture b"] and captured == 0


def test_close_waits_for_the_capture_under_way_and_starts_no_other(models, prompt):
    async def scenario():
        runner = CaptureLog(models.flow, models.hift)
        batcher = Token2WavBatcher(runner)
        await batcher.serve_captures()
        runner.want("a", "b")
        runner.hold["a"], runner.capturing["a"] = threading.Event(), asyncio.Event()
        await batcher.run_on_device(lambda: None)
        await asyncio.wait_for(runner.capturing["a"].wait(), WAIT_S)
        closing = asyncio.ensure_future(batcher.close())
        await asyncio.sleep(0.05)
        not_yet = closing.done()  # the capture thread is still in "a"
        runner.hold["a"].set()
        await asyncio.wait_for(closing, WAIT_S)
        return not_yet, runner.events, runner.wanted

    assert asyncio.run(scenario()) == (False, ["capture a"], ["b"])


def test_nothing_is_captured_beside_the_batches_until_serve_captures(models, prompt):
    """The warm-up's requests (and a benchmark's throw-away batcher on a runner, t2w_compare.py) run
    before `serve_captures`: the capture thread stays idle, and `capture_all_wanted` captures
    everything wanted, in that thread; after `serve_captures` it captures by itself."""
    async def scenario():
        runner = CaptureLog(models.flow, models.hift)
        batcher = Token2WavBatcher(runner)
        try:
            runner.want("a", "b")
            await batcher.submit(next_job_upto(new_stream(prompt), TOKENS, False), time.monotonic())
            before = list(runner.events)
            n = await batcher.capture_all_wanted()
            runner.want("c")
            await batcher.run_on_device(lambda: None)
            not_yet = (list(runner.events), batcher._capturing)
            await batcher.serve_captures()
            await asyncio.wait_for(runner.drained.wait(), WAIT_S)
            return before, n, not_yet, runner.events
        finally:
            await batcher.close()

    before, n, (events_then, task_then), events = asyncio.run(scenario())
    assert before == ["batch of 1"] and n == 2 and events_then == before + ["capture a", "capture b"]
    assert task_then is None and events == events_then + ["capture c"]


def test_the_warm_up_captures_what_its_own_requests_wanted(models):
    """Before SERVING (Token2WavBatcher.capture_graphs): the plan, then every bucket the warm-up's
    own requests left wanted, in the capture thread, so none is left for after SERVING."""
    async def scenario():
        runner = CaptureLog(models.flow, models.hift)
        batcher = Token2WavBatcher(runner)
        try:
            runner.want("a", "b")
            await batcher.capture_graphs(capture_plan(Config()), and_wanted=True)
            return list(runner.events), list(runner.wanted), batcher._capturing
        finally:
            await batcher.close()

    events, wanted, task = asyncio.run(scenario())
    assert events == ["capture a", "capture b"] and wanted == [] and task is None


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

    # 1 while a request speaks: its segment's stream
    seen, after = synth.call(finished())
    assert seen and all(n == 1 for n in seen) and after == 0
    assert synth.call(closed_by_its_consumer()) == (1, 0)
    assert synth.call(cancelled()) == (1, 0)
    assert synth.call(failed()) == ([1], 0)


def test_once_captures_are_served_nothing_compiles_until_the_last_holder_resumes():
    """compile_cache.stop_compiling (Token2WavBatcher.serve_captures, where graphs are captured): a
    compile in one thread breaks compiled calls in the others, and the capture thread runs beside
    the device thread, so from then on neither a recompile nor a first compile happens: such a call
    runs eagerly. Counted: the default comes back when the last holder resumes (a batcher's close)."""
    @torch.compile(backend="eager", dynamic=False)
    def double(x):
        return x * 2

    @torch.compile(backend="eager", dynamic=False)
    def triple(x):
        return x * 3

    torch._dynamo.reset()
    counters.clear()
    double(torch.ones(3))
    stop_compiling()
    stop_compiling()  # a second batcher of the process (replicas)
    try:
        assert torch.equal(double(torch.ones(5)), torch.full((5,), 2.0))  # a recompile: eager instead
        assert torch.equal(triple(torch.ones(2)), torch.full((2,), 3.0))  # a first compile: eager too
        resume_compiling()
        double(torch.ones(6))  # one holder left: still nothing
        assert counters["stats"]["unique_graphs"] == 1
    finally:
        resume_compiling()
    double(torch.ones(7))  # the last one resumed: compiling again
    assert counters["stats"]["unique_graphs"] == 2
    torch._dynamo.reset()


def test_captures_give_way_to_a_stream_owed_its_first_chunk(models, prompt):
    """A stream that started and has no first chunk yet (its LLM tokens on the way) holds the next
    capture back until its first job is done; a stream that ends without one releases it too."""
    async def scenario():
        runner = CaptureLog(models.flow, models.hift)
        batcher = Token2WavBatcher(runner)
        await batcher.serve_captures()
        try:
            stream = new_stream(prompt)
            batcher.stream_started(stream)
            runner.want("a")
            await batcher.run_on_device(lambda: None)  # the capture thread is asked for "a" ...
            await asyncio.sleep(0.2)
            held = list(runner.events)  # ... and waits for the stream's first chunk
            await batcher.submit(next_job_upto(stream, TOKENS, False), time.monotonic())
            await asyncio.wait_for(runner.drained.wait(), WAIT_S)
            await asyncio.wait_for(batcher._capturing, WAIT_S)
            first = list(runner.events)

            silent = new_stream(prompt)  # started, then ended (cancelled) before any job
            batcher.stream_started(silent)
            runner.want("b")
            await batcher.run_on_device(lambda: None)
            await asyncio.sleep(0.2)
            held_b = list(runner.events)
            batcher.stream_ended(silent)
            await asyncio.wait_for(runner.drained.wait(), WAIT_S)
            batcher.stream_ended(stream)
            return held, first, held_b, runner.events, batcher.first_chunks.owed, batcher.capture_gave_way_seconds
        finally:
            await batcher.close()

    held, first, held_b, events, owed, gave_way = asyncio.run(scenario())
    assert held == [] and first == ["batch of 1", "capture a"]
    assert held_b == first and events == first + ["capture b"]
    assert owed == 0 and gave_way >= 0.4  # two waits of at least the 0.2 s the test held each


def test_an_old_stream_owed_its_first_chunk_holds_no_capture_back(models, prompt):
    """A stream owed its first chunk for longer than the grace (a text-in stream waiting for text)
    does not hold captures back."""
    async def scenario():
        runner = CaptureLog(models.flow, models.hift)
        batcher = Token2WavBatcher(runner)
        batcher.first_chunks.grace_s = 0.0
        await batcher.serve_captures()
        try:
            batcher.stream_started(new_stream(prompt))
            runner.want("a")
            await batcher.run_on_device(lambda: None)
            await asyncio.wait_for(runner.drained.wait(), WAIT_S)
            return runner.events, batcher.first_chunks.owed
        finally:
            await batcher.close()

    assert asyncio.run(scenario()) == (["capture a"], 1)


def test_a_capture_beside_the_batches_runs_with_the_shortened_switch_interval(models, prompt):
    """While the capture thread captures, Python's switch interval is the batcher's
    capture_switch_interval_s (so the LLM step thread waits less for the GIL); after, Python's own."""
    class Interval(CaptureLog):
        def capture_wanted(self) -> bool:
            self.events.append(f"interval {sys.getswitchinterval():.4f}")
            return super().capture_wanted()

    async def scenario():
        runner = Interval(models.flow, models.hift)
        batcher = Token2WavBatcher(runner, capture_switch_interval_s=0.0005)
        await batcher.serve_captures()
        try:
            runner.want("a")
            await batcher.run_on_device(lambda: None)
            await asyncio.wait_for(runner.drained.wait(), WAIT_S)
            await asyncio.wait_for(batcher._capturing, WAIT_S)
            return runner.events, sys.getswitchinterval()
        finally:
            await batcher.close()

    before = sys.getswitchinterval()
    events, after = asyncio.run(scenario())
    assert events == ["interval 0.0005", "capture a"] and after == before
