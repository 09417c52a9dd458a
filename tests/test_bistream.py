"""Bistream (text-in streaming, facts §2.7): the schedule by hand, the native engine against a
teacher-forced copy of upstream's `inference_bistream` loop, batching, timing, cancel and errors."""
import asyncio

import numpy as np
import pytest
import torch

from async_cosyvoice.engine.base import BistreamRequest, EngineStats, GenerationRequest
from async_cosyvoice.engine.bistream import BistreamSchedule, UnexpectedStopToken, Verdict
from async_cosyvoice.engine.native import NativeEngine, NativeEngineConfig
from async_cosyvoice.engine.recorder import StepRecorder
from async_cosyvoice.errors import InvalidRequest
from async_cosyvoice.models.dims import EOS2_TOKEN, EOS_TOKEN, FILL_TOKEN, RASParams
from async_cosyvoice.models.llm import SOS, TASK, Table
from async_cosyvoice.sampling import ras_sample

pytestmark = pytest.mark.usefixtures("_one_thread")

GREEDY = RASParams(top_k=1)
SOS_ROW, TASK_ROW = (SOS[0], SOS[1][0]), (TASK[0], TASK[1][0])


def T(*ids):
    return tuple((Table.TEXT, i) for i in ids)


def S(*ids):
    return tuple((Table.SPEECH, i) for i in ids)


def rows(parts):
    return tuple((table, i) for table, ids in parts for i in ids)


# ---------------------------------------------------------------- the schedule by hand

def test_schedule_by_hand():
    """Prompt text 7, prompt speech 20 (not a multiple of 15): pairs, decoding right after the last
    pair, the forced fill at (20 // 15 + 1) * 15 - 20 = 10, 5 text tokens alone after a fill,
    tokens arriving mid-group waiting for the fill, and the double feed at the end."""
    sch = BistreamSchedule(range(100, 107), range(20))
    assert sch.next_input() is None  # nothing before the first text token, even with 7 prompt tokens
    sch.add_text([0])
    assert sch.next_input() is None  # one pair appended, 5 prompt speech tokens left, 3 text cached
    sch.add_text([1, 2])
    seg = sch.next_input()  # second pair (5 text, 5 speech), then decode without new text
    assert rows(seg) == (SOS_ROW, *T(100, 101, 102, 103, 104), *S(*range(15)), *T(105, 106, 0, 1, 2),
                         *S(*range(15, 20)))
    sch.add_text([3, 4, 5])  # arrives while decoding: waits for the next fill
    for k in range(10):
        assert not sch.forces_fill and sch.masks_eos
        assert sch.accept(1000 + k) is Verdict.EMIT
    assert sch.forces_fill
    assert sch.accept(FILL_TOKEN) is Verdict.FILL
    assert sch.next_input() is None  # 3 cached
    sch.add_text([6, 7, 8])
    assert rows(sch.next_input()) == T(3, 4, 5, 6, 7)  # one token at a time: the 5th completes the input
    # a sampled fill counts as the end of a group: the next one is due 16 outputs later
    assert sch.accept(2000) is Verdict.EMIT and sch.accept(FILL_TOKEN) is Verdict.FILL
    sch.add_text([9, 10, 11, 12])
    assert rows(sch.next_input()) == T(8, 9, 10, 11, 12)
    for k in range(15):
        assert sch.accept(3000 + k) is Verdict.EMIT
    assert sch.forces_fill and sch.accept(FILL_TOKEN) is Verdict.FILL
    sch.add_text([13])
    assert sch.next_input() is None
    sch.end_text()
    # the input that produced the fill (speech 3014) is fed again, then the cache, then task
    assert rows(sch.next_input()) == (*S(3014), *T(13), TASK_ROW)
    assert not sch.masks_eos and not sch.forces_fill
    assert sch.accept(4000) is Verdict.EMIT and sch.accept(EOS_TOKEN) is Verdict.END


def test_schedule_prompt_multiple_of_15_and_training_variant():
    """P = 30: upstream decodes 15 tokens after the last pair before the first fill; the training
    layout wants the fill at once, and never feeds an input twice."""
    for consistent, first_fill in ((False, 15), (True, 0)):
        sch = BistreamSchedule(range(100, 110), range(30), training_consistent=consistent)
        sch.add_text([0])
        assert rows(sch.next_input()) == (SOS_ROW, *T(*range(100, 105)), *S(*range(15)),
                                          *T(*range(105, 110)), *S(*range(15, 30)))
        for k in range(first_fill):
            assert not sch.forces_fill
            sch.accept(500 + k)
        assert sch.forces_fill and sch.accept(FILL_TOKEN) is Verdict.FILL
        sch.end_text()
        last = () if consistent else S(514)  # upstream feeds the fill's input (speech 514) again
        assert rows(sch.next_input()) == (*last, *T(0), TASK_ROW)
    # no prompt speech: [sos] + 5 text tokens first; the fill is due after 15 tokens in both layouts
    for consistent in (False, True):
        sch = BistreamSchedule([100, 101], [], training_consistent=consistent)
        sch.add_text([0, 1])
        assert sch.next_input() is None
        sch.add_text([2, 3])
        assert rows(sch.next_input()) == (SOS_ROW, *T(100, 101, 0, 1, 2))
        forced = []
        for _ in range(15):
            forced.append(sch.forces_fill)
            sch.accept(7)
        assert forced == [False] * 15 and sch.forces_fill
    # text that ends before any decoding: everything is fed once, unused prompt speech dropped
    sch = BistreamSchedule([100], range(40))
    sch.add_text([0, 1, 2, 3, 4, 5])
    assert sch.next_input() is None
    sch.end_text()
    assert rows(sch.next_input()) == (SOS_ROW, *T(100, 0, 1, 2, 3), *S(*range(15)), *T(4, 5), TASK_ROW)
    # upstream's errors: 6562 while text streams, 6563 after it ended
    sch = BistreamSchedule([], [])
    sch.add_text(range(5))
    sch.next_input()
    with pytest.raises(UnexpectedStopToken):
        sch.accept(EOS2_TOKEN)


# ---------------------------------------------------------------- upstream's loop, teacher-forced

class _Forward:
    """Upstream's `forward_one_step` + `llm_decoder` + `log_softmax` over one growing KV cache."""

    def __init__(self, lm):
        self.lm, self.pos, self.calls = lm, 0, []
        self.cache = lm.new_cache(1, 1024)

    @torch.no_grad()
    def __call__(self, lm_input):
        x = self.lm.embed_parts([(table, (i,)) for table, i in lm_input])[None]
        positions = torch.arange(self.pos, self.pos + len(lm_input))[None]
        hidden = self.lm.backbone(x, positions, self.cache, torch.zeros(1, dtype=torch.long))
        self.pos += len(lm_input)
        logp = self.lm.logits(hidden[0, -1]).float().log_softmax(-1)
        self.calls.append((tuple(lm_input), logp))
        return logp


def upstream_bistream(lm, prompt_text, prompt_speech, text_tokens, teacher, training_consistent=False):
    """`Qwen2LM.inference_bistream` (HEAD) line for line, with output k taken from teacher[k]
    (a forced fill must be there; where upstream samples, the teacher is checked to be the greedy
    pick). Returns the (input rows, log-probs) of every forward, the outputs and the indices of the
    forced fills, stopping once the teacher list is used up."""
    n_text, n_speech = lm.dims.mix_ratio
    forward = _Forward(lm)
    lm_input = [SOS_ROW]
    text_cache = list(T(*prompt_text))
    speech = list(S(*prompt_speech))
    out, forced = [], []
    P = len(prompt_speech)
    next_fill_index = (P // n_speech + 1) * n_speech - P
    if training_consistent and P and P % n_speech == 0:
        next_fill_index = 0

    def sample(logp, ignore_eos):
        if ignore_eos:
            logp = logp.clone()
            logp[EOS_TOKEN] = -float("inf")
        greedy = ras_sample(logp, out, GREEDY)
        assert teacher[len(out)] == greedy, (len(out), teacher[len(out)], greedy)
        return teacher[len(out)]

    for this_text in text_tokens:  # upstream's frontend hands over one token per iteration
        text_cache.append((Table.TEXT, this_text))
        while len(speech) != 0:
            if len(text_cache) >= n_text:
                lm_input = lm_input + text_cache[:n_text] + speech[:n_speech]
                text_cache, speech = text_cache[n_text:], speech[n_speech:]
            else:
                break
        if len(speech) == 0:
            if (len(out) != 0 and out[-1] == FILL_TOKEN) or (len(out) == 0 and len(lm_input) == 1):
                if len(text_cache) >= n_text:
                    if len(out) != 0 and out[-1] == FILL_TOKEN:
                        lm_input = text_cache[:n_text]
                    else:
                        lm_input = lm_input + text_cache[:n_text]
                    text_cache = text_cache[n_text:]
                else:
                    continue
            while True:
                if len(out) == len(teacher):
                    return forward.calls, out, forced
                logp = forward(lm_input)
                if len(out) == next_fill_index:
                    top_ids = FILL_TOKEN
                    next_fill_index += n_speech + 1
                    assert teacher[len(out)] == FILL_TOKEN
                    forced.append(len(out))
                else:
                    top_ids = sample(logp, ignore_eos=True)
                if top_ids == FILL_TOKEN:
                    next_fill_index = len(out) + n_speech + 1
                out.append(top_ids)
                if top_ids >= EOS_TOKEN:
                    if top_ids == FILL_TOKEN:
                        break
                    raise ValueError(f"should not get token {top_ids}")
                lm_input = [(Table.SPEECH, top_ids)]

    if training_consistent and len(out) != 0:
        lm_input = []
    lm_input = lm_input + text_cache + [TASK_ROW]
    while len(out) < len(teacher):
        logp = forward(lm_input)
        top_ids = sample(logp, ignore_eos=False)
        out.append(top_ids)
        if top_ids >= EOS_TOKEN:
            assert top_ids == EOS_TOKEN
            break
        lm_input = [(Table.SPEECH, top_ids)]
    return forward.calls, out, forced


def engine_calls(recorder, request_id):
    """The engine's records of one request merged into forwards: the rows up to each token."""
    calls, pending = [], []
    for r in recorder.of(request_id):
        pending += r.rows
        if r.token is not None:
            calls.append((tuple(pending), r.logp, r.token))
            pending = []
    assert not pending
    return calls


# ---------------------------------------------------------------- the engine

@pytest.fixture(scope="module")
def inputs(golden_dir):
    return np.load(golden_dir / "model_inputs.npz")


@pytest.fixture(scope="module")
def fill_lm(lm):
    """The fixture LM with the fill (and EOS) logits raised so that greedy decoding samples fills
    on its own next to the forced ones, and ends with EOS after the text; 6562 never wins."""
    copy = type(lm)(lm.dims)
    copy.load_state_dict(lm.state_dict())
    with torch.no_grad():
        copy.llm_decoder.bias[FILL_TOKEN] += 1.0
        copy.llm_decoder.bias[EOS_TOKEN] += 2.0
        copy.llm_decoder.bias[EOS2_TOKEN] -= 100.0
    return copy.eval()


def cases(inputs):
    """(prompt text, prompt speech, text) with P = 75 (a multiple of 15), 20, 0 and 74."""
    def get(key):
        return inputs[key][0].tolist()
    prompt_text, speech, text = get("zero_shot/prompt_text"), get("zero_shot/llm_prompt_speech_token"), get(
        "zero_shot/text")
    return {"p75": (prompt_text, speech, text),
            "p20": (prompt_text, speech[:20], text[:30]),
            "p0": (get("instruct2/prompt_text")[:3], [], text[5:34]),
            "p74": (prompt_text, get("zero_shot_zh_p16/llm_prompt_speech_token"), text[::-1])}


def pieces(tokens, sizes):
    """tokens cut into pieces of the given sizes, cycled (0 = an empty piece)."""
    out, i, k = [], 0, 0
    while i < len(tokens):
        n = sizes[k % len(sizes)]
        out.append(tokens[i:i + n])
        i, k = i + n, k + 1
    return out


async def text_source(chunks, delays=()):
    for k, chunk in enumerate(chunks):
        if delays:
            await asyncio.sleep(delays[k % len(delays)])
        yield chunk


def make_engine(lm, recorder=None, **kw):
    cfg = dict(max_num_seqs=8, max_model_len=512, max_num_batched_tokens=512, seed=0)
    cfg.update(kw)
    return NativeEngine(lm, NativeEngineConfig(**cfg), recorder=recorder)


def run(engine, body):
    async def main():
        await engine.start()
        try:
            return await body(engine)
        finally:
            await engine.stop()
    return asyncio.run(main())


async def collect(stream):
    out = []
    async for tokens in stream:
        assert tokens and all(0 <= t < EOS_TOKEN for t in tokens)
        out += tokens
    return out


def bistream_request(rid, case, max_tokens=120, **kw):
    prompt_text, speech, _ = case
    return BistreamRequest(rid, tuple(prompt_text), tuple(speech), max_tokens=max_tokens, ras=GREEDY, **kw)


def test_engine_matches_upstream_loop_batched(fill_lm, inputs):
    """Every case twice (uneven pieces with delays / everything in one piece), batched with each
    other and with two plain requests in one engine: each forward's input rows equal upstream's
    loop fed the same tokens, log-probs within 1e-4, tokens the greedy picks; the outputs are
    those of each request alone; plain requests are unaffected."""
    all_cases = cases(inputs)
    chunkings = {"uneven": ([3, 1, 0, 7, 2, 5], [0.0, 0.003, 0.0, 0.001]), "whole": ([1000], [])}
    plain = [GenerationRequest(f"plain{i}", tuple(all_cases["p75"][0] + all_cases["p75"][2][:10 + i]),
                               tuple(all_cases["p75"][1][:30]), min_tokens=0, max_tokens=40, ras=GREEDY)
             for i in range(2)]
    recorder = StepRecorder()

    async def batched(engine):
        jobs = [collect(engine.generate_bistream(bistream_request(f"{name}/{how}", case),
                                                 text_source(pieces(case[2], sizes), delays)))
                for name, case in all_cases.items() for how, (sizes, delays) in chunkings.items()]
        jobs += [collect(engine.generate(r)) for r in plain]
        return await asyncio.gather(*jobs)
    engine = make_engine(fill_lm, recorder)
    outs = run(engine, batched)
    assert engine.stats() == EngineStats()
    names = [f"{name}/{how}" for name in all_cases for how in chunkings]
    outs_by = dict(zip(names + [r.request_id for r in plain], outs))

    kinds = set()
    for name, case in all_cases.items():
        a, b = (engine_calls(recorder, f"{name}/{how}") for how in chunkings)
        # the LM inputs depend on the tokens only, not on their chunking or timing
        assert [c[0] for c in a] == [c[0] for c in b] and [c[2] for c in a] == [c[2] for c in b], name
        teacher = [c[2] for c in a]
        ref_calls, ref_out, forced = upstream_bistream(fill_lm, *case, teacher)
        assert ref_out == teacher
        assert len(ref_calls) == len(a), name
        for k, ((ref_rows, ref_logp), (rows_, logp, token)) in enumerate(zip(ref_calls, a)):
            assert rows_ == ref_rows, (name, k)
            assert (logp - ref_logp).abs().max() <= 1e-4, (name, k)
        # what the consumer got: the outputs without fills and EOS
        assert outs_by[f"{name}/uneven"] == [t for t in teacher if t < EOS_TOKEN], name
        kinds |= {(name, "eos" if teacher[-1] == EOS_TOKEN else "max_tokens")}
        kinds |= {"forced fill" if k in forced else "sampled fill" for k, t in enumerate(teacher) if t == FILL_TOKEN}
        assert sum(len(r) for r, _ in ref_calls[1:] if r[0][0] is Table.TEXT) > 0, name  # text fed after fills
    assert {"forced fill", "sampled fill"} <= kinds
    assert any(end == "eos" for _, end in (k for k in kinds if isinstance(k, tuple)))

    # each alone gives the same tokens as in the crowd
    async def alone(engine):
        res = {}
        for name, case in all_cases.items():
            res[name] = await collect(engine.generate_bistream(bistream_request(name, case),
                                                               text_source(pieces(case[2], [4]))))
        for r in plain:
            res[r.request_id] = await collect(engine.generate(r))
        return res
    solo = run(make_engine(fill_lm), alone)
    for name in all_cases:
        assert solo[name] == outs_by[f"{name}/uneven"] == outs_by[f"{name}/whole"], name
    for r in plain:
        ref = fill_lm.generate_reference(r.text_tokens, r.prompt_speech_tokens, 0, r.max_tokens,
                                         lambda logp, decoded: ras_sample(logp, decoded, GREEDY))
        assert solo[r.request_id] == outs_by[r.request_id] == ref


def test_training_consistent_variant(fill_lm, inputs):
    """P = 75: the fill comes first, and the final input does not repeat the last fed one; the
    engine still matches the loop with those two changes."""
    prompt_text, speech, text = cases(inputs)["p75"]
    case = (prompt_text, speech, text[:20])
    recorder = StepRecorder()

    async def body(engine):
        return await collect(engine.generate_bistream(bistream_request("tc", case, training_consistent=True),
                                                      text_source(pieces(case[2], [2, 5]))))
    run(make_engine(fill_lm, recorder), body)
    calls = engine_calls(recorder, "tc")
    teacher = [c[2] for c in calls]
    # 16 prompt + 9 text tokens fill the 5 pairs; the fill comes at once, then the next 5 text tokens
    assert teacher[0] == FILL_TOKEN and calls[1][0] == T(*text[9:14])
    ref_calls, _, forced = upstream_bistream(fill_lm, *case, teacher, training_consistent=True)
    assert forced[0] == 0
    assert [r for r, _ in ref_calls] == [c[0] for c in calls]
    assert all((c[1] - logp).abs().max() <= 1e-4 for c, (_, logp) in zip(calls, ref_calls))
    final = next(c[0] for c in calls if c[0][-1] == TASK_ROW)
    assert final[0][0] is Table.TEXT  # upstream's loop would start it with the last fed speech token


def test_cancel_abort_and_errors_free_the_slot(fill_lm, inputs):
    """A request that waits for text holds its slot but not the others; cancelling its consumer
    mid-text, aborting it, a failing text source and bad token ids all end it and free the slot."""
    prompt_text, speech, text = cases(inputs)["p20"]
    case = (prompt_text, speech, text)

    async def body(engine):
        never = asyncio.Event()
        closed = []

        async def stalled_text():
            try:
                yield text[:12]
                await never.wait()  # the client stops sending without ending the text
                yield text[12:]
            finally:
                closed.append(True)

        got = []

        async def consume():
            async for tokens in engine.generate_bistream(bistream_request("stalled", case), stalled_text()):
                got.extend(tokens)
        task = asyncio.create_task(consume())
        # a plain request runs to the end next to the stalled one
        plain = GenerationRequest("plain", tuple(prompt_text + text), tuple(speech), min_tokens=0, max_tokens=30,
                                  ras=GREEDY, ignore_stop_tokens=True)
        assert len(await collect(engine.generate(plain))) == 30
        seq = engine.scheduler.running[0]
        for _ in range(500):  # test side: wait until it has used up the 12 tokens
            if got and not seq.decoding and not seq.needs_prefill:
                break
            await asyncio.sleep(0.01)
        assert engine.stats().running == 1 and not seq.decoding and not seq.needs_prefill  # out of the steps
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert engine.stats() == EngineStats() and closed == [True]

        stream = engine.generate_bistream(bistream_request("aborted", case), stalled_text())
        assert await stream.__anext__()
        await engine.abort("aborted")
        await collect(stream)  # ends, without an error
        assert engine.stats() == EngineStats()

        async def failing_text():
            yield text[:7]
            raise ConnectionError("client went away")
        with pytest.raises(ConnectionError, match="client went away"):
            await collect(engine.generate_bistream(bistream_request("failing", case), failing_text()))
        assert engine.stats() == EngineStats()

        with pytest.raises(InvalidRequest, match="text token ids"):
            await collect(engine.generate_bistream(bistream_request("bad", case),
                                                   text_source([text[:3], [10 ** 9]])))
        with pytest.raises(InvalidRequest, match="max_model_len"):
            long_text = (text * 20)[:400]
            await collect(engine.generate_bistream(bistream_request("long", case, max_tokens=10_000),
                                                   text_source([long_text])))
        assert engine.stats() == EngineStats()
        # max_tokens ends a stream early, text or not
        out = await collect(engine.generate_bistream(bistream_request("short", case, max_tokens=7),
                                                     text_source(pieces(text, [3]))))
        assert len(out) == 7
        assert engine.stats() == EngineStats()
    run(make_engine(fill_lm, max_num_seqs=2), body)

