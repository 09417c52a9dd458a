"""The exact flow state cache (token2wav/flow_cache.py, models/flow/prefix.py): every streamed chunk's flow mel
equals the full recompute (upstream's path), alone and batched across streams with different
cached prefixes, with and without a registered speaker's prompt prefix."""
import numpy as np
import pytest
import torch

from async_cosyvoice.models.flow.flow import Flow
from async_cosyvoice.models.flow.prefix import FlowState, Geometry
from async_cosyvoice.token2wav import ChunkSchedule, Token2WavRunner, Token2WavStream
from async_cosyvoice.token2wav.flow_cache import (
    SpeakerPrefixCache,
    speaker_prefix_tokens,
)

torch.set_num_threads(1)

ATOL = 1e-5  # fp32 CPU; the difference is float summation order (measured ~1e-6)
PROMPTS = {"p24": "e2e_stream_hop15.npz", "p16": "e2e_stream_hop25_p16.npz"}  # 75 and 74 prompt tokens


@pytest.fixture(scope="module")
def flow(model_dir):
    f = Flow(model_dir.dims.flow).eval()
    f.load_state_dict(model_dir.flow_state_dict(), strict=True)
    return f


@pytest.fixture(scope="module")
def prompts(golden_dir):
    out = {}
    for name, file in PROMPTS.items():
        z = np.load(golden_dir / file)
        out[name] = tuple(torch.from_numpy(z[k]) for k in ("prompt_token", "prompt_feat", "embedding"))
    return out


def target_tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 6561, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def new_stream(prompts, name, first_hop, key=None):
    tok, feat, emb = prompts[name]
    return Token2WavStream(tok, feat, emb, schedule=ChunkSchedule(first_hop=first_hop), prompt_key=key)


def advance(stream, job, mel):
    """Apply a job with silent HiFT output (the flow is what is under test)."""
    hift_mel, _ = stream.hift_input(job, mel)
    n = hift_mel.shape[2] * stream.schedule.samples_per_frame
    stream.finish(job, hift_mel, torch.zeros(1, n), torch.zeros(1, 1, n))


def drive(cached: Token2WavRunner, recompute: Token2WavRunner, streams: list, tokens: list[list[int]],
          first_round: list[int] | None = None) -> int:
    """Run every stream's chunks in lockstep (one cached flow batch per round; stream i joins at
    round first_round[i]) and compare each chunk's mel with the recompute of that job alone.
    Returns the number of chunks compared."""
    compared, rnd = 0, 0
    first_round = first_round or [0] * len(streams)
    for s, t in zip(streams, tokens):
        s.append(t)
    while True:
        jobs = [j for s, r in zip(streams, first_round) if r <= rnd and (j := s.next_job(llm_done=True)) is not None]
        if not jobs and rnd >= max(first_round):
            return compared
        rnd += 1
        expected = [recompute.flow_mel(j) for j in jobs]
        got = cached.flow_mels(jobs)
        for j, e, m in zip(jobs, expected, got):
            assert m.shape == e.shape, (j.index, m.shape, e.shape)
            err = (m - e).abs().max().item() if e.numel() else 0.0
            assert err <= ATOL, f"chunk {j.index} (offset {j.token_offset}, {j.n_tokens} tokens): {err:.2e}"
            advance(j.stream, j, m)
            compared += 1


@pytest.mark.parametrize("name,first_hop,key", [("p24", 15, None), ("p16", 25, None), ("p16", 10, "spk")])
def test_every_streamed_chunk_equals_the_recompute(flow, hift, prompts, name, first_hop, key):
    cached = Token2WavRunner(flow, hift)
    recompute = Token2WavRunner(flow, hift, flow_cache=False)
    stream = new_stream(prompts, name, first_hop, key)
    n = drive(cached, recompute, [stream], [target_tokens(120, seed=first_hop)])
    assert n >= 3
    assert stream.finished and stream.flow_state is None  # the final call dropped the cache
    st = cached.stats
    assert st.flow_cached_frames > 0
    assert st.flow_frames < recompute.stats.flow_frames  # each frame once (plus partial chunks, finals)
    if key is not None:
        assert len(cached.speaker_prefixes) == 1


def test_batched_streams_with_different_cached_prefixes(flow, hift, prompts):
    """One cached call per round over streams at different points (prefix lengths, hops, a speaker
    prefix, a stream joining late): each chunk equals its own recompute."""
    cached = Token2WavRunner(flow, hift, length_bucket_ratio=100)  # one group: all items in each call
    recompute = Token2WavRunner(flow, hift, flow_cache=False)
    streams = [new_stream(prompts, "p24", 15), new_stream(prompts, "p16", 25, key="p16"),
               new_stream(prompts, "p24", 10, key="p24")]
    tokens = [target_tokens(n, seed) for n, seed in ((70, 1), (60, 2), (45, 3))]
    assert drive(cached, recompute, streams, tokens, first_round=[0, 0, 2]) >= 7
    assert all(s.finished for s in streams)
    assert cached.stats.flow_items > cached.stats.flow_calls  # several streams per call


def test_speaker_prefix_is_shared_and_exact(flow, hift, prompts):
    runner = Token2WavRunner(flow, hift)
    a, b = new_stream(prompts, "p24", 15, key="spk"), new_stream(prompts, "p24", 15, key="spk")
    a.append(target_tokens(40, 5))
    b.append(target_tokens(40, 6))
    ja, jb = a.next_job(llm_done=False), b.next_job(llm_done=False)
    runner.flow_mels([ja, jb])
    P = prompts["p24"][0].shape[1]
    prefix = runner.speaker_prefixes.get("spk", prompts["p24"][0][0, :53])
    assert prefix.tokens == speaker_prefix_tokens(P, 25, 3) == 50  # not 75: the last chunk sees the target
    shared = {id(t) for t in prefix.tensors()}
    for s in (a, b):
        own = s.flow_state.tensors()
        assert shared & {id(t) for t in own}  # the prompt's segments are the speaker's, not copies
        assert s.flow_state.nbytes(excluding=prefix) < s.flow_state.nbytes()
    # the prefix itself equals a cached call from nothing over the same prompt tokens
    tok, feat, emb = prompts["p24"]
    mel, (alone,) = flow.forward_cached(tok[:, :53], Geometry([0], [50], [50], torch.device("cpu")), feat,
                                        torch.tensor([feat.shape[1]]), emb, [None])
    assert torch.equal(torch.cat(alone.mel, 2), torch.cat(prefix.mel, 2))
    assert torch.equal(mel, torch.cat(prefix.mel, 2))


def test_speaker_cache_budget_evicts_and_falls_back(flow, hift, prompts):
    runner = Token2WavRunner(flow, hift)
    one = runner._speaker_prefix(new_stream(prompts, "p24", 15, key="x"))
    size = one.nbytes()
    tok = prompts["p24"][0][0, :53]
    cache = SpeakerPrefixCache(budget_bytes=2 * size + size // 2)
    for key in ("a", "b", "c"):
        assert cache.put(key, one, tok)
    assert len(cache) == 2 and cache.get("a", tok) is None and cache.stats.evictions == 1
    assert cache.get("b", tok) is one  # b is now the most recent: d evicts c
    cache.put("d", one, tok)
    assert cache.get("c", tok) is None and cache.get("b", tok) is one and cache.stats.bytes == 2 * size
    assert cache.get("b", prompts["p16"][0][0, :53]) is None  # re-registered with other audio: a miss
    assert not SpeakerPrefixCache(size - 1).put("a", one, tok)  # larger than the budget: recomputed per stream

    # budget 0: no speaker prefixes, every stream computes its prompt (still exact)
    runner = Token2WavRunner(flow, hift, speaker_cache_bytes=0)
    recompute = Token2WavRunner(flow, hift, flow_cache=False)
    assert drive(runner, recompute, [new_stream(prompts, "p16", 15, key="k")], [target_tokens(60, 7)]) >= 2
    assert len(runner.speaker_prefixes) == 0


def test_cap_on_cached_tokens(flow, hift, prompts):
    """Past max_cached_tokens a stream keeps no more state; later chunks recompute after the cap."""
    runner = Token2WavRunner(flow, hift, max_cached_tokens=80)
    recompute = Token2WavRunner(flow, hift, flow_cache=False)
    stream = new_stream(prompts, "p24", 15)  # chunks end at 90 and 120 tokens: keep 75, then (capped) 75
    states = []
    stream.append(target_tokens(60, 8))
    while (job := stream.next_job(llm_done=True)) is not None:
        mel = runner.flow_mel(job)
        assert (mel - recompute.flow_mel(job)).abs().max() <= ATOL
        states.append(stream.flow_state)
        advance(stream, job, mel)
    assert [s and s.tokens for s in states] == [75, 75, None] and len({id(s) for s in states[:2]}) == 1


def test_geometry_rejects_bad_ranges_and_state_mismatch(flow, prompts):
    with pytest.raises(ValueError, match="start"):
        Geometry([10], [5], [5], torch.device("cpu"))
    tok, feat, emb = prompts["p24"]
    state = FlowState(25, (), (), ())
    with pytest.raises(ValueError, match="covers 25 tokens"):
        flow.forward_cached(tok[:, :53], Geometry([0], [50], [50], torch.device("cpu")), feat,
                            torch.tensor([feat.shape[1]]), emb, [state])
    with pytest.raises(ValueError, match="multiple"):
        flow.forward_cached(tok[:, :43], Geometry([0], [40], [40], torch.device("cpu")), feat,
                            torch.tensor([feat.shape[1]]), emb, [None])


def test_state_size_from_dims_matches_the_state(flow, hift, prompts):
    """state_nbytes (used for the full-size memory report) counts exactly what a state holds."""
    from async_cosyvoice.token2wav.flow_cache import state_nbytes
    runner = Token2WavRunner(flow, hift)
    state = runner._speaker_prefix(new_stream(prompts, "p24", 15, key="x"))
    assert state.nbytes() == state_nbytes(flow.dims, state.tokens, torch.float32)


def test_chunked_final_is_the_chunked_recompute(flow, hift, prompts):
    """The optional chunked final (not upstream's: see NOTES) equals a chunked-attention recompute
    with zero look-ahead, and drops the stream's cache."""
    runner = Token2WavRunner(flow, hift, chunked_final=True)
    stream = new_stream(prompts, "p16", 15, key="k")
    tokens = target_tokens(40, 9)
    stream.append(tokens)
    while (job := stream.next_job(llm_done=True)) is not None:
        frames = runner.stats.flow_frames
        mel = runner.flow_mel(job)
        if job.finalize:
            start = 2 * (74 + len(tokens)) - (runner.stats.flow_frames - frames)
            assert 0 < start <= 2 * (74 + job.token_offset)  # only the frames after the cached prefix
            tok, feat, emb = prompts["p16"]
            seq = torch.cat([tok, torch.tensor([tokens], dtype=torch.int32)], dim=1)
            with torch.inference_mode():
                ref, _ = flow(seq, torch.tensor([seq.shape[1]]), torch.tensor([0]), feat,
                              torch.tensor([feat.shape[1]]), emb, streaming=True)
            assert (mel - ref[:, :, feat.shape[1]:]).abs().max() <= ATOL
            assert stream.flow_state is None
        advance(stream, job, mel)
    assert job is None and stream.finished


class CountingEstimator:
    """An estimator backend (the flow's own module) that counts its calls."""
    name = "counting"
    supports_streaming = True

    def __init__(self, module):
        self.module, self.calls = module, 0

    def __call__(self, x, mask, mu, t, spks, cond, streaming=False):
        self.calls += 1
        return self.module(x, mask, mu, t, spks, cond, streaming)


def test_backend_runs_the_final_and_cached_chunks_run_the_module(flow, hift, prompts):
    """With an estimator backend, cached streaming chunks run the flow's PyTorch module and the
    final call runs on the backend; with flow_cache=False every call does (the recompute)."""
    backend = CountingEstimator(flow.decoder.estimator)
    cached = Token2WavRunner(flow, hift, estimator=backend)
    recompute = Token2WavRunner(flow, hift, estimator=CountingEstimator(flow.decoder.estimator), flow_cache=False)
    n = drive(cached, recompute, [new_stream(prompts, "p24", 25)], [target_tokens(40, 10)])
    steps = flow.dims.cfm.n_timesteps
    assert n == 2 and backend.calls == steps  # only the final call: one estimator call per CFM step
    assert recompute.estimator.calls == n * steps
