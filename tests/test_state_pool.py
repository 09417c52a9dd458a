"""The exact flow cache through the state pool (token2wav/state_pool.py, slot_calls.py,
models/flow/prefix.py SlotCursor): every streamed chunk equals the full recompute, alone and batched
across streams at different positions, padded to the graph buckets (off CUDA the same padded
function runs without a graph); a full pool or an outgrown slot recomputes exactly; a dropped
stream gives its slot back. On CUDA the captured graphs are checked against the eager call. The
compiled step (by regions) against the eager one: tests/test_slot_regions.py."""
import gc

import pytest
import torch
from test_flow_cache import ATOL, drive, flow, new_stream, prompts, target_tokens  # noqa: F401  (fixtures)

from async_cosyvoice.token2wav import ChunkSchedule, Token2WavRunner, Token2WavStream
from async_cosyvoice.token2wav.slot_calls import SlotCalls
from async_cosyvoice.token2wav.state_pool import StatePool


def pooled(flow, hift, slots=3, slot_tokens=300, speaker_slots=1, **kw) -> Token2WavRunner:  # noqa: F811
    pool = StatePool(flow, slots=slots, slot_tokens=slot_tokens, speaker_slots=speaker_slots)
    return Token2WavRunner(flow, hift, slot_calls=SlotCalls(flow, pool, cuda_graphs=False), **kw)


def test_pool_chunks_equal_the_recompute_batched_at_different_positions(flow, hift, prompts):  # noqa: F811
    cached = pooled(flow, hift, length_bucket_ratio=100)  # one call per round: all streams together
    recompute = Token2WavRunner(flow, hift, flow_cache=False)
    streams = [new_stream(prompts, "p24", 15, key="spk"), new_stream(prompts, "p16", 25),
               new_stream(prompts, "p24", 10, key="spk")]
    tokens = [target_tokens(n, seed) for n, seed in ((90, 1), (70, 2), (60, 3))]
    assert drive(cached, recompute, streams, tokens, first_round=[0, 0, 2]) >= 8
    pool = cached.state_pool
    assert pool.free_slots == 3  # every final chunk gave its slot back
    assert pool.stats.leases == 3 and pool.stats.speaker_hits == 1 and pool.stats.speaker_misses == 1
    assert cached.stats.flow_cached_frames > 0 and cached.stats.flow_items > cached.stats.flow_calls
    assert cached.slot_calls.replays > 0  # padded to the buckets, as the graphs run


def test_a_full_pool_and_an_outgrown_slot_recompute_exactly(flow, hift, prompts):  # noqa: F811
    cached = pooled(flow, hift, slots=1, slot_tokens=110, speaker_slots=0)
    recompute = Token2WavRunner(flow, hift, flow_cache=False)
    streams = [new_stream(prompts, "p24", 15), new_stream(prompts, "p16", 15)]  # 75 and 74 prompt tokens
    drive(cached, recompute, streams, [target_tokens(80, 4), target_tokens(80, 5)])
    st = cached.state_pool.stats
    assert st.full >= 1       # the second stream found no slot: it recomputed
    assert st.outgrown >= 1   # a stream ran past 110 tokens: it recomputed from then on
    assert cached.state_pool.free_slots == 1


def test_a_dropped_stream_gives_its_slot_back(flow, hift, prompts):  # noqa: F811
    cached = pooled(flow, hift, slots=2)
    s = new_stream(prompts, "p24", 15)
    s.append(target_tokens(40, 6))
    cached.flow_mels([s.next_job(llm_done=False)])
    assert cached.state_pool.free_slots == 1 and s.flow_lease is not None
    del s  # cancelled: the stream is dropped mid-utterance
    gc.collect()
    assert cached.state_pool.free_slots == 2


def test_a_speaker_slot_is_replaced_and_dropped(flow, hift, prompts):  # noqa: F811
    cached = pooled(flow, hift, slots=2, speaker_slots=1)
    for name in ("p24", "p16"):  # two speakers, one speaker slot: the second evicts the first
        s = new_stream(prompts, name, 15, key=name)
        assert cached.prepare_speaker(s)
    assert "p16" in cached.speaker_prefixes and "p24" not in cached.speaker_prefixes
    cached.speaker_prefixes.drop("p16")
    assert len(cached.speaker_prefixes) == 0


def test_a_prompt_longer_than_a_slot_is_refused_cleanly(flow, hift, prompts):  # noqa: F811
    cached = pooled(flow, hift, slots=1, slot_tokens=60, speaker_slots=0)
    recompute = Token2WavRunner(flow, hift, flow_cache=False)
    drive(cached, recompute, [new_stream(prompts, "p24", 15)], [target_tokens(40, 7)])  # 75-token prompt
    assert cached.state_pool.stats.leases == 0 and cached.state_pool.free_slots == 1


def sequence(prompts, name: str, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # noqa: F811
    """(tokens (1, P + 120), prompt_feat, embedding) of a prompt followed by 120 target tokens."""
    tok, feat, emb = prompts[name]
    return torch.cat([tok.reshape(1, -1), torch.tensor([target_tokens(120, seed)])], dim=1), feat, emb


def slot_call(calls: SlotCalls, seqs, slots, start, end, keep) -> list[torch.Tensor]:
    """One batched call through the pool: item b computes tokens [start, end) of seqs[b] in its slot
    and keeps [0, keep). Returns each item's mel (80, ratio·(end − start))."""
    look = calls.flow.dims.pre_lookahead_len
    tokens = torch.zeros(len(slots), max(e - s for s, e in zip(start, end)) + look, dtype=torch.int32)
    for b, (seq, s, e) in enumerate(zip(seqs, start, end)):
        tokens[b, :e + look - s] = seq[0][0, s:e + look]
    calls(tokens, slots, start, end, keep)
    ratio = calls.flow.dims.token_mel_ratio
    return [calls.pool.mel[slot, ratio * s:ratio * e].T.clone() for slot, s, e in zip(slots, start, end)]


def recomputed(flow, seq, start: int, end: int) -> torch.Tensor:  # noqa: F811
    """Upstream's streaming call over tokens [0, end) (+ look-ahead): the mel of frames [ratio·start, ratio·end)."""
    tokens, feat, emb = seq
    look, ratio = flow.dims.pre_lookahead_len, flow.dims.token_mel_ratio
    with torch.inference_mode():
        mel, _ = flow(tokens[:, :end + look], torch.tensor([end]), torch.tensor([look]), feat,
                      torch.tensor([feat.shape[1]]), emb, streaming=True)
    return mel[0, :, ratio * start:ratio * end]


# two rounds of three streams at different fill lengths, one call each; round 1's longest item
# ends at 128 = a key bucket edge (step 32), so its keys are exactly the bucket; round 2 reads
# the state round 1 wrote (and one item starts fresh from a filled prefix call)
ROUNDS = [{"start": [100, 75, 0], "end": [128, 100, 90], "keep": [125, 100, 75]},
          {"start": [125, 100, 75], "end": [150, 160, 130], "keep": [150, 150, 125]}]


def run_rounds(flow, prompts, **calls_kw):  # noqa: F811
    """The rounds through a pool of 3 slots."""
    pool = StatePool(flow, slots=3, slot_tokens=300)
    calls = SlotCalls(flow, pool, cuda_graphs=False, **({"key_token_step": 32} | calls_kw))
    seqs = [sequence(prompts, "p24", 11), sequence(prompts, "p16", 12), sequence(prompts, "p24", 13)]
    slots = [1, 2, 3]
    for slot, (_, feat, emb) in zip(slots, seqs):
        pool.load_prompt(slot, feat, emb)
    slot_call(calls, seqs[:2], slots[:2], [0, 0], [100, 75], [100, 75])  # the prefixes round 1 starts from
    mels = [slot_call(calls, seqs, slots, **r) for r in ROUNDS]
    return calls, seqs, mels


def test_key_bucketed_calls_equal_the_recompute_at_different_fill_lengths(flow, prompts):  # noqa: F811
    calls, seqs, mels = run_rounds(flow, prompts)
    for r, got in zip(ROUNDS, mels):
        for seq, s, e, m in zip(seqs, r["start"], r["end"], got):
            err = (m - recomputed(flow, seq, s, e)).abs().max().item()
            assert err <= ATOL, (s, e, err)
    # each call read its filled length, not the 301-position capacity: its longest item's end
    # (prefixes 100, round 1 128, round 2 160) rounded up to 32
    assert calls.key_buckets == {128: 2, 160: 1}
    assert calls.key_bucket(128) == 128 and calls.key_bucket(129) == 160 and calls.key_bucket(300) == 301


def test_capacity_wide_keys_give_the_same_mels(flow, prompts):  # noqa: F811
    _, _, bucketed = run_rounds(flow, prompts)
    calls, _, capacity = run_rounds(flow, prompts, key_token_step=None)
    assert set(calls.key_buckets) == {301}
    for a, b in zip(bucketed, capacity):
        for x, y in zip(a, b):
            assert (x - y).abs().max().item() <= ATOL


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
@pytest.mark.parametrize("compile", [False, True])
def test_graphed_pool_matches_the_recompute_on_cuda(model_dir, prompts, compile):  # noqa: F811
    from async_cosyvoice.model_dir import build_models
    models = build_models(model_dir, device="cuda", dtype=torch.float32, with_llm=False)
    pool = StatePool(models.flow, slots=3, slot_tokens=300, speaker_slots=1)
    calls = SlotCalls(models.flow, pool, cuda_graphs=True, compile=compile)
    cached = Token2WavRunner(models.flow, models.hift, slot_calls=calls, length_bucket_ratio=100)
    recompute = Token2WavRunner(models.flow, models.hift, flow_cache=False)
    torch.backends.cudnn.allow_tf32 = False  # fp32 convolutions, so both paths round alike
    tokens = [target_tokens(n, seed) for n, seed in ((90, 1), (70, 2), (60, 3))]
    # first the buckets run padded without graphs (wanted), then, captured, in their graphs
    for graphed in (False, True):
        streams = [Token2WavStream(*prompts[name], schedule=ChunkSchedule(first_hop=hop), prompt_key=key, device="cuda")
                   for name, hop, key in (("p24", 15, "spk"), ("p16", 25, None), ("p24", 10, "spk"))]
        assert drive(cached, recompute, streams, tokens, first_round=[0, 0, 2]) >= 8
        assert (calls.replays > 0) == graphed and calls.deferred > 0
        while cached.capture_wanted():
            pass
        assert calls.graphs and not calls.wanted
    assert calls.compiled == compile and all(k < pool.positions for k in calls.key_buckets)


def test_slot_bytes_count_what_a_pool_allocates(flow):  # noqa: F811
    pool = StatePool(flow, slots=2, slot_tokens=120, speaker_slots=1)
    assert StatePool.slot_nbytes(flow, 120) * pool.n_slots == pool.nbytes


def test_a_pool_too_large_for_the_device_fails_start_before_allocating(model_dir, flow, hift):  # noqa: F811
    from async_cosyvoice.config import Config
    from async_cosyvoice.model_dir import Models
    from async_cosyvoice.token2wav.pool_size import PoolTooLarge
    from async_cosyvoice.token2wav.stage import token2wav_batcher
    config = Config.model_validate({"token2wav": {"flow_cache_slots": 10**7}})
    with pytest.raises(PoolTooLarge, match="token2wav.flow_cache_slots: 10000000 slots"):
        token2wav_batcher(config, Models(llm=None, flow=flow, hift=hift), model_dir)
    config = Config.model_validate({"token2wav": {"flow_cache_slots": "auto"}, "limits": {"max_concurrent_streams": 5}})
    assert token2wav_batcher(config, Models(llm=None, flow=flow, hift=hift), model_dir).runner.state_pool.n_stream_slots == 5

