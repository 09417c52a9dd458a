"""token2wav: chunk schedule, HiFT caches / cross-fade, and end-to-end parity with the upstream
driver (golden/e2e_*.npz, README section e)."""
import numpy as np
import pytest
from conftest import next_job_upto
import torch

from async_cosyvoice.models.hift import NSFNoise
from async_cosyvoice.token2wav import ChunkSchedule, Token2WavRunner, Token2WavStream, crossfade

torch.set_num_threads(1)

ATOL = 1e-4          # flow mel, HiFT speech, emitted audio
SOURCE_ATOL = 1e-3   # NSF source (phase is numerically fragile)
BATCH_ATOL = 2e-5    # batched vs single HiFT calls
RUNS = ["nonstream", "stream_hop25", "stream_hop15", "stream_hop25_p16"]




def load_run(golden_dir, run):
    z = np.load(golden_dir / f"e2e_{run}.npz")
    return {k: torch.from_numpy(z[k]) for k in z.files}


def golden_calls(g):
    n = 0
    while f"call{n}/n_tokens" in g:
        n += 1
    return [{k.split("/", 1)[1]: v for k, v in g.items() if k.startswith(f"call{i}/")} for i in range(n)]


def make_stream(g, noise, **kw):
    stream = len(golden_calls(g)) > 1 or not bool(g["call0/finalize"][0])
    sched = ChunkSchedule(first_hop=int(g["token_hop_len"][0]))
    return Token2WavStream(g["prompt_token"], g["prompt_feat"], g["embedding"], stream=stream, schedule=sched,
                           noise=noise, **kw)


class GoldenFlow:
    """Stand-in for the Flow: returns the recorded `call<i>/flow_mel` and checks the call."""

    def __init__(self, calls):
        self.calls, self.i = calls, 0

    def inference(self, token, prompt_token, prompt_feat, embedding, streaming, finalize):
        c = self.calls[self.i]
        self.i += 1
        assert token.shape[1] == int(c["n_tokens"][0])
        assert bool(streaming) == bool(c["flow_streaming"][0]) and bool(finalize) == bool(c["finalize"][0])
        return c["flow_mel"]


class FakeFlow:
    """Deterministic mel from the tokens (+ a speaker offset), with upstream's length rules."""

    def __init__(self, pre_lookahead=3):
        self.table = torch.randn(6561, 80, generator=torch.Generator().manual_seed(0)) - 2
        self.pre_lookahead = pre_lookahead
        self.calls = []

    def inference(self, token, prompt_token, prompt_feat, embedding, streaming, finalize):
        self.calls.append((token.shape[1], streaming, finalize))
        n = token.shape[1] - (0 if finalize else self.pre_lookahead)
        mel = self.table[token[0, :n].long()].T.repeat_interleave(2, dim=1)
        return (mel + embedding[0, :80, None])[None]


def check_against_golden(g, records, chunks, audio_key="audio_zero_noise", check_flow_mel=False):
    calls = golden_calls(g)
    assert len(records) == len(calls)
    for r, c in zip(records, calls):
        assert (r.n_tokens, r.token_offset, r.finalize, r.flow_streaming) == (
            int(c["n_tokens"][0]), int(c["token_offset"][0]), bool(c["finalize"][0]), bool(c["flow_streaming"][0]))
        if check_flow_mel:
            assert r.flow_mel.shape == c["flow_mel"].shape
            assert (r.flow_mel - c["flow_mel"]).abs().max() <= ATOL
        assert r.hift_in_mel.shape == c["hift_in_mel"].shape
        assert (r.hift_in_mel - c["hift_in_mel"]).abs().max() <= ATOL
        assert r.hift_in_cache_source.shape == c["hift_in_cache_source"].shape
        if c["hift_in_cache_source"].numel():
            assert (r.hift_in_cache_source - c["hift_in_cache_source"]).abs().max() <= SOURCE_ATOL
        assert r.hift_speech.shape == c["hift_speech"].shape
        assert (r.hift_speech - c["hift_speech"]).abs().max() <= ATOL
        assert (r.hift_source - c["hift_source"]).abs().max() <= SOURCE_ATOL
        assert r.out.shape == c["out"].shape
        assert (r.out - c["out"]).abs().max() <= ATOL
    assert [len(x) for x in chunks] == g["chunk_lengths"].tolist()
    audio = torch.cat(chunks)
    assert audio.dtype == torch.float32
    assert (audio - g[audio_key][0]).abs().max() <= ATOL


# --------------------------------------------------------------------------- golden parity


@pytest.mark.parametrize("run", RUNS)
def test_golden_schedule_and_hift_with_recorded_flow_mel(golden_dir, hift, run):
    g = load_run(golden_dir, run)
    records = []
    runner = Token2WavRunner(GoldenFlow(golden_calls(g)), hift, recorder=records.append)
    chunks = runner.render(make_stream(g, NSFNoise.zero()), g["token"][0].tolist())
    check_against_golden(g, records, chunks)


@pytest.mark.parametrize("run", RUNS)
def test_golden_seeded_audio(golden_dir, hift, run):
    """A generator seeded like upstream's global RNG reproduces the audio with real NSF noise."""
    g = load_run(golden_dir, run)
    gen = torch.Generator().manual_seed(int(g["seeded_torch_seed"][0]))
    runner = Token2WavRunner(GoldenFlow(golden_calls(g)), hift)
    chunks = runner.render(make_stream(g, NSFNoise.random(gen)), g["token"][0])
    assert (torch.cat(chunks) - g["audio_seeded"][0]).abs().max() <= ATOL


@pytest.fixture(scope="module")
def flow(model_dir):
    from async_cosyvoice.models.flow.flow import Flow
    f = Flow(model_dir.dims.flow).eval()
    f.load_state_dict(model_dir.flow_state_dict(), strict=True)
    return f


@pytest.mark.slow
@pytest.mark.parametrize("run", RUNS)
def test_golden_end_to_end_with_flow(golden_dir, flow, hift, run):
    g = load_run(golden_dir, run)
    records = []
    runner = Token2WavRunner(flow, hift, recorder=records.append)
    chunks = runner.render(make_stream(g, NSFNoise.zero()), g["token"][0].tolist())
    check_against_golden(g, records, chunks, check_flow_mel=True)
    assert (runner.stats.flow_cached_frames > 0) == (run != "nonstream")  # streaming: through the cache


# --------------------------------------------------------------------------- schedule


def plan_only(stream, tokens, llm_done=True):
    """Drive the schedule with silent HiFT outputs; returns [(n_tokens, offset, finalize, samples)]."""
    sched, out = stream.schedule, []
    while (job := next_job_upto(stream, tokens, llm_done)) is not None:
        mel, _ = stream.hift_input(job, torch.zeros(1, 80, 2 * (job.n_tokens - (0 if job.finalize else 3))))
        n = mel.shape[2] * sched.samples_per_frame
        samples = stream.finish(job, mel, torch.zeros(1, n), torch.zeros(1, 1, n))
        out.append((job.n_tokens, job.token_offset, job.finalize, len(samples)))
    return out


def silent_stream(P, **kw):
    stream = kw.pop("stream", True)
    return Token2WavStream(torch.zeros(1, P, dtype=torch.int32), torch.zeros(1, 2 * P, 80), torch.zeros(1, 192),
                           stream=stream, schedule=ChunkSchedule(**kw))


@pytest.mark.parametrize("run", RUNS)
def test_schedule_matches_golden(golden_dir, run):
    g = load_run(golden_dir, run)
    stream = make_stream(g, NSFNoise.zero())
    got = plan_only(stream, g["token"][0].tolist())
    want = [(int(c["n_tokens"][0]), int(c["token_offset"][0]), bool(c["finalize"][0]), c["out"].shape[1])
            for c in golden_calls(g)]
    assert got == want


def test_first_hop_pad_and_hop_growth():
    assert ChunkSchedule(first_hop=25).first_hop_pad(75) == 0
    assert ChunkSchedule(first_hop=25).first_hop_pad(74) == 1
    assert ChunkSchedule(first_hop=25).first_hop_pad(0) == 0
    assert ChunkSchedule(first_hop=15).first_hop_pad(74) == 1
    assert ChunkSchedule(first_hop=15, prompt_align=25).first_hop_pad(60) == 15
    assert ChunkSchedule(first_hop=15).max_hop == 60 and ChunkSchedule().max_hop == 100

    # hops 15+pad, 30, 60, 60, ... (cap 4 x 15); each chunk needs hop + 3 tokens
    got = plan_only(silent_stream(74, first_hop=15), list(range(300)))
    offsets = [o for _, o, _, _ in got]
    assert offsets == [0, 16, 46, 106, 166, 226, 286]
    assert [n for n, _, f, _ in got if not f] == [19, 49, 109, 169, 229, 289]
    assert got[-1][:3] == (300, 286, True)


@pytest.mark.parametrize("P,first_hop,n", [(75, 15, 110), (74, 25, 97), (0, 15, 7), (0, 25, 0), (3, 15, 18), (75, 25, 1)])
def test_every_token_is_rendered_once(P, first_hop, n):
    for stream in (True, False):
        got = plan_only(silent_stream(P, first_hop=first_hop, stream=stream), list(range(n)))
        assert sum(s for *_, s in got) == 960 * n
        assert got[-1][2] is True and sum(1 for *_, f, _ in got if f) == 1


@pytest.mark.parametrize("first_hop", [1, 2, 3])
def test_first_chunk_shorter_than_the_hift_cache(hift, first_hop):
    stream = Token2WavStream(torch.zeros(1, 0, dtype=torch.int32), torch.zeros(1, 0, 80), torch.zeros(1, 192),
                             schedule=ChunkSchedule(first_hop=first_hop), noise=NSFNoise.zero())
    chunks = Token2WavRunner(FakeFlow(), hift).render(stream, list(range(40)))
    assert len(chunks[0]) == 0 and sum(len(c) for c in chunks) == 40 * 960


def test_waits_for_hop_plus_lookahead():
    stream = silent_stream(75, first_hop=15)
    tokens = list(range(40))
    assert next_job_upto(stream, tokens[:17], llm_done=False) is None
    job = next_job_upto(stream, tokens[:18], llm_done=False)
    assert (job.n_tokens, job.token_offset, job.hop, job.finalize, job.streaming) == (18, 0, 15, False, True)
    again = next_job_upto(stream, tokens[:30], llm_done=False)  # planning is pure: same job until it is applied
    assert (again.index, again.n_tokens, again.token_offset) == (0, 18, 0)
    plan_only(stream, tokens[:18], llm_done=False)
    assert stream.token_offset == 15 and stream.hop == 30
    assert next_job_upto(stream, tokens[:47], llm_done=False) is None
    job = next_job_upto(stream, tokens[:40], llm_done=True)  # LLM done, no full chunk left: final call
    assert (job.n_tokens, job.token_offset, job.finalize, job.streaming) == (40, 15, True, False)

    nonstream = silent_stream(75, stream=False)
    assert next_job_upto(nonstream, tokens, llm_done=False) is None
    job = next_job_upto(nonstream, torch.tensor([tokens]), llm_done=True)
    assert (job.n_tokens, job.token_offset, job.finalize, job.streaming) == (40, 0, True, False)
    assert job.tokens.dtype == torch.int32 and job.tokens.tolist() == [tokens]


def test_a_new_stream_starts_from_the_first_hop():
    """Upstream keeps the doubled hop on the model for the next request; ours is per stream."""
    first = plan_only(silent_stream(75, first_hop=25), list(range(300)))
    second = plan_only(silent_stream(75, first_hop=25), list(range(300)))
    assert first == second and first[0][:2] == (28, 0)


def test_stale_and_foreign_jobs_are_rejected():
    a, b = silent_stream(75, first_hop=15), silent_stream(75, first_hop=15)
    tokens = list(range(40))
    job = next_job_upto(a, tokens, False)
    with pytest.raises(ValueError):
        b.hift_input(job, torch.zeros(1, 80, 30))
    plan_only(a, tokens[:18], llm_done=False)
    with pytest.raises(RuntimeError):
        a.hift_input(job, torch.zeros(1, 80, 30))


def test_argument_checks():  # request-level rules (speed, hops) are tests/test_rules.py
    with pytest.raises(ValueError, match="prompt_feat"):
        Token2WavStream(torch.zeros(1, 10, dtype=torch.int32), torch.zeros(1, 19, 80), torch.zeros(1, 192))
    with pytest.raises(ValueError):
        ChunkSchedule(first_hop=0)


# --------------------------------------------------------------------------- HiFT caches / runner


def test_crossfade_is_float64_hamming():
    new, old = torch.rand(1, 7700), torch.rand(1, 3840)
    w = np.hamming(7680)
    want = (new[0, :3840].double().numpy() * w[:3840] + old[0].double().numpy() * w[3840:]).astype(np.float32)
    got = crossfade(new, old)
    assert np.array_equal(got[0, :3840].numpy(), want) and torch.equal(got[0, 3840:], new[0, 3840:])


def test_speed_in_non_streaming(hift):
    stream = Token2WavStream(torch.zeros(1, 0, dtype=torch.int32), torch.zeros(1, 0, 80), torch.zeros(1, 192),
                             stream=False, speed=1.5, noise=NSFNoise.zero())
    chunks = Token2WavRunner(FakeFlow(), hift).render(stream, list(range(100, 133)))
    assert [len(c) for c in chunks] == [int(66 / 1.5) * 480]


def test_final_call_with_no_new_tokens(hift):
    """With pre_lookahead 0 a stream can end exactly on a chunk; the final call then only
    renders the 8 cached mel frames (3840 samples), and the flow is not called."""
    flow = FakeFlow(pre_lookahead=0)
    stream = Token2WavStream(torch.zeros(1, 0, dtype=torch.int32), torch.zeros(1, 0, 80), torch.zeros(1, 192),
                             schedule=ChunkSchedule(first_hop=5, pre_lookahead=0), noise=NSFNoise.zero())
    chunks = Token2WavRunner(flow, hift).render(stream, list(range(15)))
    assert [len(c) for c in chunks] == [5 * 960 - 3840, 10 * 960, 3840]
    assert flow.calls == [(5, True, False), (15, True, False)]


def two_streams(golden_dir):
    a, b = load_run(golden_dir, "stream_hop15"), load_run(golden_dir, "stream_hop25_p16")
    tok_a = a["token"][0].tolist()
    tok_b = [(t * 7 + 3) % 6561 for t in b["token"][0].tolist()][:97]

    def make():
        return (Token2WavStream(a["prompt_token"], a["prompt_feat"], a["embedding"],
                                schedule=ChunkSchedule(first_hop=15), noise=NSFNoise.zero()),
                Token2WavStream(b["prompt_token"], b["prompt_feat"], b["embedding"],
                                schedule=ChunkSchedule(first_hop=25), noise=NSFNoise.zero()))
    return make, tok_a, tok_b


def test_interleaved_streams_do_not_affect_each_other(golden_dir, hift):
    make, tok_a, tok_b = two_streams(golden_dir)
    sa, sb = make()
    rec_a, rec_b = [], []
    alone_a = Token2WavRunner(FakeFlow(), hift, recorder=rec_a.append).render(sa, tok_a)
    alone_b = Token2WavRunner(FakeFlow(), hift, recorder=rec_b.append).render(sb, tok_b)
    sched = lambda recs: [(r.n_tokens, r.token_offset, r.finalize) for r in recs]
    assert sched(rec_a) == [(18, 0, False), (48, 15, False), (108, 45, False), (110, 105, True)]
    assert sched(rec_b) == [(29, 0, False), (79, 26, False), (97, 76, True)]

    # tokens arrive one at a time for both streams; one shared runner serves them alternately
    sa, sb = make()
    recs = []
    runner = Token2WavRunner(FakeFlow(), hift, recorder=recs.append)
    got = {id(sa): [], id(sb): []}
    for step in range(1, max(len(tok_a), len(tok_b)) + 1):
        for s, toks in ((sb, tok_b), (sa, tok_a)) if step % 2 else ((sa, tok_a), (sb, tok_b)):
            so_far, done = toks[:step], step >= len(toks)
            while (job := next_job_upto(s, so_far, done)) is not None:
                got[id(s)].append(runner.run(job))
    assert sa.finished and sb.finished
    for alone, mine in ((alone_a, got[id(sa)]), (alone_b, got[id(sb)])):
        assert [len(c) for c in alone] == [len(c) for c in mine]
        assert all(torch.equal(x, y) for x, y in zip(alone, mine))


def test_run_many_batches_streams(golden_dir, hift):
    make, tok_a, tok_b = two_streams(golden_dir)
    tok_c = tok_b[::-1] + tok_b[:13]  # a third stream shaped like A (same prompt and hops), other tokens

    def make3():
        sa, sb = make()
        sc = Token2WavStream(sa.prompt_token, sa.prompt_feat, sa.embedding * -1, schedule=ChunkSchedule(first_hop=15),
                             noise=NSFNoise.zero())
        return [(sa, tok_a), (sb, tok_b), (sc, tok_c)]

    alone = [Token2WavRunner(FakeFlow(), hift).render(s, toks) for s, toks in make3()]

    streams = make3()
    batch_sizes = []

    class CountingHiFT:
        def __getattr__(self, name):
            return getattr(hift, name)

        def inference(self, mel, *args):
            batch_sizes.append(("plain", mel.shape[0]))
            return hift.inference(mel, *args)

        def inference_padded(self, mel, *args):
            batch_sizes.append(("padded", mel.shape[0]))
            return hift.inference_padded(mel, *args)

    runner = Token2WavRunner(FakeFlow(), CountingHiFT())
    got = [[] for _ in streams]
    for step in range(10, 121, 10):  # tokens arrive in bursts of 10
        jobs = [j for s, toks in streams if (j := next_job_upto(s, toks[:step], step >= len(toks))) is not None]
        for job, out in zip(jobs, runner.run_many(jobs)):
            got[[s for s, _ in streams].index(job.stream)].append(out)
    assert all(s.finished for s, _ in streams)
    assert ("plain", 2) in batch_sizes  # A and C chunks (equal lengths) went through HiFT together
    for ref, mine in zip(alone, got):
        assert [len(c) for c in ref] == [len(c) for c in mine]
        assert max((x - y).abs().max().item() for x, y in zip(ref, mine)) <= BATCH_ATOL

    with pytest.raises(ValueError, match="one job per stream"):
        s, _ = make()
        job = next_job_upto(s, tok_a, True)
        runner = Token2WavRunner(FakeFlow(), hift)
        runner.run_many([job, job])


def test_adaptive_hop_grows_when_ahead_and_takes_pending_when_behind():
    from async_cosyvoice.token2wav import ChunkSchedule, adaptive_hop
    s = ChunkSchedule(first_hop=15, max_hop_multiple=4, prompt_align=1)
    # comfortably ahead: upstream's doubled hop
    assert adaptive_hop(s, 30, pending=10, lead_s=5.0, chunk_s=0.1, token_s=0.02) == 30
    # behind: render what is pending now, within [first_hop, max_hop]
    assert adaptive_hop(s, 30, pending=25, lead_s=0.1, chunk_s=0.2, token_s=0.02) == 22
    assert adaptive_hop(s, 30, pending=5, lead_s=0.1, chunk_s=0.2, token_s=0.02) == 15
    assert adaptive_hop(s, 60, pending=400, lead_s=0.0, chunk_s=0.2, token_s=0.02) == 60
    # the wait for missing tokens counts: ahead by 1 s is not enough for 60 tokens at 40 ms each
    assert adaptive_hop(s, 60, pending=0, lead_s=1.0, chunk_s=0.1, token_s=0.04) == 15
