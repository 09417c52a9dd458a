"""The native engine against the plain reference loop (greedy), plus lengths, stops, aborts, load."""
import asyncio
import copy

import numpy as np
import pytest
import torch

from async_cosyvoice.engine.base import EngineStats, GenerationRequest, SpeechTokenEngine, length_limits
from async_cosyvoice.engine.native import NativeEngine, NativeEngineConfig
from async_cosyvoice.engine.scheduler import PrefillChunk
from async_cosyvoice.engine.sequence import Sequence
from async_cosyvoice.errors import InvalidRequest
from async_cosyvoice.models.dims import EOS2_TOKEN, EOS_TOKEN, STOP_TOKENS, RASParams
from async_cosyvoice.sampling import ras_sample
from test_llm import prompt_of

pytestmark = pytest.mark.usefixtures("_one_thread")

GREEDY = RASParams(top_k=1)
MODES = ["zero_shot", "cross_lingual", "instruct2", "sft"]


@pytest.fixture(scope="module")
def inputs(golden_dir):
    return np.load(golden_dir / "model_inputs.npz")


def make_request(inputs, mode, rid, max_tokens=40, min_tokens=None, ras=GREEDY, **kw) -> GenerationRequest:
    text, speech, n_target = prompt_of(inputs, mode)
    min_len, _ = length_limits(n_target)
    min_tokens = min(min_len, max_tokens) if min_tokens is None else min_tokens
    return GenerationRequest(rid, tuple(text), tuple(speech), min_tokens=min_tokens, max_tokens=max_tokens,
                             ras=ras, **kw)


def reference(lm, req: GenerationRequest) -> list[int]:
    return lm.generate_reference(req.text_tokens, req.prompt_speech_tokens, req.min_tokens, req.max_tokens,
                                 lambda logp, decoded: ras_sample(logp, decoded, req.ras))


def make_engine(lm, **kw) -> NativeEngine:
    cfg = dict(max_num_seqs=8, max_model_len=512, max_num_batched_tokens=512, seed=0)
    cfg.update(kw)
    engine = NativeEngine(lm, NativeEngineConfig(**cfg))
    assert isinstance(engine, SpeechTokenEngine)
    return engine


async def collect(engine, req) -> list[int]:
    out = []
    async for tokens in engine.generate(req):
        assert tokens and all(0 <= t < EOS_TOKEN for t in tokens)
        out += tokens
    return out


def run_engine(engine, body):
    async def main():
        await engine.start()
        try:
            return await body(engine)
        finally:
            await engine.stop()
    return asyncio.run(main())


def test_greedy_alone_matches_reference(lm, inputs):
    reqs = [make_request(inputs, m, f"r{i}", max_tokens=30 + 5 * i) for i, m in enumerate(MODES)]

    async def body(engine):
        return [await collect(engine, r) for r in reqs]
    outs = run_engine(make_engine(lm), body)
    for req, out in zip(reqs, outs):
        assert out == reference(lm, req), req.request_id


@pytest.mark.slow
def test_greedy_8_concurrent_staggered_matches_reference(lm, inputs):
    """Requests join a running batch between steps; every stream is what it is alone."""
    reqs = [make_request(inputs, MODES[i % 4], f"r{i}", max_tokens=24 + 7 * i, min_tokens=i) for i in range(8)]

    async def body(engine):
        async def one(i, req):
            await asyncio.sleep(0.002 * i)  # test-side stagger only
            return await collect(engine, req)
        return await asyncio.gather(*(one(i, r) for i, r in enumerate(reqs)))
    engine = make_engine(lm)
    outs = run_engine(engine, body)
    for req, out in zip(reqs, outs):
        assert out == reference(lm, req), req.request_id
    assert engine.stats() == EngineStats()


def test_chunked_prefill_matches_reference(lm, inputs):
    """A 130-position prompt through a 24-token budget: prefilled over several steps, next to
    decoding streams."""
    reqs = [make_request(inputs, "zero_shot", "long", max_tokens=20),
            make_request(inputs, "cross_lingual", "short", max_tokens=30)]

    async def body(engine):
        return await asyncio.gather(*(collect(engine, r) for r in reqs))
    engine = make_engine(lm, max_num_seqs=4, max_num_batched_tokens=24)
    outs = run_engine(engine, body)
    for req, out in zip(reqs, outs):
        assert out == reference(lm, req), req.request_id
    steps = engine.stage_stats
    assert steps.calls > 20 + 130 // 24 and steps.failed == 0 and steps.busy_s > 0
    assert steps.items >= 20 + 30  # every decode row and prefill chunk counted
    # the steps that fed prompt rows: every prompt row once, in chunks of at most the 24-token budget
    prefills, prompt_rows = engine.prefill_stats, sum(Sequence(r, None).segment_len for r in reqs)
    assert prefills.items == prompt_rows and prompt_rows / 24 <= prefills.calls < steps.calls
    assert 0 < prefills.busy_s <= steps.busy_s


def _biased(lm, token: int) -> torch.nn.Module:
    copy = type(lm)(lm.dims)
    copy.load_state_dict(lm.state_dict())
    with torch.no_grad():
        copy.llm_decoder.bias[token] += 100.0
    return copy.eval()


def test_min_max_tokens_and_stop_ids(lm, inputs):
    eos_model = _biased(lm, EOS_TOKEN)
    eos2_model = _biased(lm, EOS2_TOKEN)

    async def body(engine):
        return await asyncio.gather(
            collect(engine, make_request(inputs, "sft", "min5", max_tokens=50, min_tokens=5)),
            collect(engine, make_request(inputs, "sft", "min0", max_tokens=50, min_tokens=0)),
            collect(engine, make_request(inputs, "sft", "ignore", max_tokens=17, min_tokens=0,
                                         ignore_stop_tokens=True)))
    # EOS wins every step once allowed: exactly min_tokens tokens; ignore_stop_tokens runs to max
    assert [len(o) for o in run_engine(make_engine(eos_model), body)] == [5, 0, 17]
    # 6562 is a stop id but is not masked before min_tokens (upstream masks only EOS)
    assert [len(o) for o in run_engine(make_engine(eos2_model), body)] == [0, 0, 17]

    async def plain(engine):
        return await collect(engine, make_request(inputs, "cross_lingual", "max", max_tokens=9, min_tokens=0))
    out = run_engine(make_engine(lm), plain)
    assert len(out) == 9 and not set(out) & set(STOP_TOKENS)


def test_abort_and_cancel_free_slots(lm, inputs):
    async def body(engine):
        long = make_request(inputs, "sft", "long", max_tokens=400, min_tokens=0, ignore_stop_tokens=True)
        got = []
        agen = engine.generate(long)
        async for tokens in agen:
            got += tokens
            if len(got) >= 5:
                assert engine.stats().running == 1
                await engine.abort("long")
                assert engine.stats() == EngineStats()  # freed at once, mid-step or not
        assert 5 <= len(got) < 400

        # a consumer that walks away (cancelled task) aborts its request too
        started = asyncio.Event()

        async def consume():
            async for _ in engine.generate(make_request(inputs, "sft", "gone", max_tokens=400, min_tokens=0,
                                                        ignore_stop_tokens=True)):
                started.set()
        task = asyncio.create_task(consume())
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert engine.stats() == EngineStats()

        # aborting a waiting request (all slots busy) removes it from the queue
        engine_reqs = [make_request(inputs, "sft", f"busy{i}", max_tokens=300, min_tokens=0, ignore_stop_tokens=True)
                       for i in range(3)]
        gens = [engine.generate(r) for r in engine_reqs]
        firsts = await asyncio.gather(*(g.__anext__() for g in gens[:2]))  # 2 slots taken
        assert all(firsts)
        waiting = asyncio.create_task(gens[2].__anext__())
        await asyncio.sleep(0)
        assert engine.stats().waiting == 1 and engine.stats().running == 2
        await engine.abort("busy2")
        with pytest.raises(StopAsyncIteration):
            await waiting
        for rid in ("busy0", "busy1"):
            await engine.abort(rid)
        for g in gens[:2]:
            await g.aclose()
        assert engine.stats() == EngineStats()
        # the engine still serves afterwards
        return await collect(engine, make_request(inputs, "cross_lingual", "after", max_tokens=12))
    after = run_engine(make_engine(lm, max_num_seqs=2), body)
    assert after == reference(lm, make_request(inputs, "cross_lingual", "after", max_tokens=12))


@pytest.mark.slow
def test_32_concurrent_all_complete(lm, inputs):
    """32 sampled requests through 8 slots: all finish with their full length, FIFO admission."""
    reqs = [make_request(inputs, MODES[i % 4], f"r{i}", max_tokens=20 + (i % 5), min_tokens=0,
                         ras=RASParams(), seed=i, ignore_stop_tokens=True) for i in range(32)]
    finished: list[str] = []

    async def body(engine):
        async def one(req):
            out = await collect(engine, req)
            finished.append(req.request_id)
            return out
        return await asyncio.gather(*(one(r) for r in reqs))
    engine = make_engine(lm, max_num_seqs=8, max_num_batched_tokens=256)
    outs = run_engine(engine, body)
    assert [len(o) for o in outs] == [r.max_tokens for r in reqs]
    assert set(finished) == {r.request_id for r in reqs}
    # admission is FIFO: the first 8 finish before any of the last 8 starts decoding
    assert max(finished.index(f"r{i}") for i in range(8)) < min(finished.index(f"r{i}") for i in range(24, 32))
    assert engine.stats() == EngineStats()


@pytest.mark.slow
def test_seeded_requests_reproducible_across_batches(lm, inputs):
    target = make_request(inputs, "zero_shot", "seeded", max_tokens=40, min_tokens=0, ras=RASParams(), seed=1234)
    others = [make_request(inputs, MODES[i % 4], f"o{i}", max_tokens=30, min_tokens=0, ras=RASParams(), seed=None)
              for i in range(7)]

    async def alone(engine):
        return await collect(engine, target)

    async def crowded(engine):
        outs = await asyncio.gather(*(collect(engine, r) for r in others[:3]), collect(engine, target),
                                    *(collect(engine, r) for r in others[3:]))
        return outs[3]
    first = run_engine(make_engine(lm, seed=1), alone)
    assert run_engine(make_engine(lm, seed=2), crowded) == first
    assert len(first) == 40 and len(set(first)) > 5  # really sampled, not a greedy loop


def test_invalid_requests(lm, inputs):
    async def body(engine):
        too_long = make_request(inputs, "zero_shot", "x", max_tokens=500)
        with pytest.raises(InvalidRequest, match="max_model_len"):
            await collect(engine, too_long)
        with pytest.raises(InvalidRequest, match="win_size"):
            await collect(engine, make_request(inputs, "sft", "w", ras=RASParams(win_size=64)))
        gen = engine.generate(make_request(inputs, "sft", "dup", max_tokens=100, min_tokens=0,
                                           ignore_stop_tokens=True))
        await gen.__anext__()
        with pytest.raises(InvalidRequest, match="already running"):
            await collect(engine, make_request(inputs, "sft", "dup"))
        await gen.aclose()
        assert engine.stats() == EngineStats()
    run_engine(make_engine(lm), body)


def test_prompts_in_prefill_buckets_match_the_reference(lm, inputs):
    """prefill_graphs: a prompt prefilled alone runs padded to its width bucket (on CUDA as that
    bucket's graph; here the same padded call without one) and samples what the plain prefill does;
    prompts that share a step's prefill, or are wider than every bucket, take the plain path."""
    reqs = [make_request(inputs, m, f"r{i}", max_tokens=25 + 3 * i) for i, m in enumerate(MODES)]
    widths = []

    async def body(engine):
        runner = engine.runner
        alone = [await collect(engine, r) for r in reqs]  # one at a time: each prompt alone in its prefill
        widths.append(runner.bucketed_prefills)
        widths.extend(runner.prefill_graph_width([PrefillChunk(Sequence(r, None), 0, Sequence(r, None).segment_len)])
                      for r in reqs)
        together = await asyncio.gather(*(collect(engine, r) for r in reqs))  # prompts in one step's prefill
        return alone, together
    alone, together = run_engine(make_engine(lm, prefill_graphs=True), body)
    for req, a, t in zip(reqs, alone, together):
        assert a == t == reference(lm, req), req.request_id
    assert widths[0] == len(reqs) and all(w in (64, 128, 256, 512) for w in widths[1:]), widths

    runner = make_engine(lm, prefill_graphs=True, max_model_len=512).runner
    seq = Sequence(reqs[0], None)
    assert runner.prefill_graph_width([PrefillChunk(seq, 0, seq.segment_len)]) == next(
        w for w in (64, 128, 256, 512) if w >= seq.segment_len)
    assert runner.prefill_graph_width([PrefillChunk(seq, 0, 10)]) is None  # a prompt's first part (chunked)
    assert runner.prefill_graph_width([PrefillChunk(seq, 0, seq.segment_len)] * 2) is None  # two prompts
    assert make_engine(lm).runner.prefill_graph_width([PrefillChunk(seq, 0, seq.segment_len)]) is None  # off


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_prefill_graphs_match_the_plain_prefill_on_cuda(lm, inputs):
    """On a GPU: each prompt alone in its step's prefill replays its width bucket's CUDA graph and
    samples the same greedy tokens as the plain (eager, unpadded) prefill."""
    reqs = [make_request(inputs, m, f"r{i}", max_tokens=20) for i, m in enumerate(MODES)]

    async def body(engine):
        return [await collect(engine, r) for r in reqs]
    outs = {}
    for graphs in (False, True):
        engine = make_engine(copy.deepcopy(lm), device="cuda", prefill_graphs=graphs)
        outs[graphs] = run_engine(engine, body)
        if graphs:
            assert engine.runner.bucketed_prefills == len(reqs) and engine.runner.prefill_graphs
    assert outs[True] == outs[False]
