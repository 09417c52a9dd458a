"""HiFT over many streams' chunks: padded group calls with caches, and their CUDA graphs
(token2wav/hift_graphs.py, HiFT.inference_padded / render_padded).

On CPU: the written-out iSTFT equals torch.istft; a padded call of streaming-shaped items (8 cached
mel frames + the chunk's, each with its cache_source and its own NSF noise) equals each item's own
call; padding to a bucket changes nothing; a streamed render through the runner with the graphs
object gives the same audio as without, with chunks of different lengths in one call. The CUDA test
captures real graphs and compares them with the eager padded call (run on the GPU machine;
skipped here).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from async_cosyvoice.model_dir import build_models, load_model_dir
from async_cosyvoice.models.hift import HiFT, NSFNoise, istft
from async_cosyvoice.token2wav import ChunkSchedule, Token2WavRunner, Token2WavStream
from async_cosyvoice.token2wav.hift_graphs import HiFTGraphs, render_group

SPEECH_ATOL = 1e-5   # float summation order (|speech| <= 0.99)
SOURCE_ATOL = 1e-3   # the NSF phase reaches ~1e4 rad in float32
CACHE = ChunkSchedule().source_cache_len
LENGTHS = [38, 128, 70, 8, 40]  # a first chunk (no cache), later chunks, a cache-only final call


@pytest.fixture(scope="module")
def items(golden_dir):
    g = np.load(golden_dir / "hift.npz")
    mel = torch.cat([torch.from_numpy(g["mel1"]), torch.from_numpy(g["mel2"])], dim=2)
    mel = torch.cat([mel, mel.flip(2)], dim=2)
    gen = torch.Generator().manual_seed(7)
    mels = [mel[:, :, :n] * (1 + 0.1 * b) for b, n in enumerate(LENGTHS)]
    caches = [None if b == 0 else 0.1 * torch.randn(1, 1, CACHE, generator=gen) for b in range(len(LENGTHS))]
    return mels, caches


def noises():
    """One seeded NSF noise per item (a zero one among them), fresh each call (generators advance)."""
    return [NSFNoise.zero() if b == 2 else NSFNoise.random(torch.Generator().manual_seed(b)) for b in range(len(LENGTHS))]


def padded_batch(mels):
    batch = mels[0].new_zeros(len(mels), 80, max(m.shape[2] for m in mels))
    for b, m in enumerate(mels):
        batch[b, :, :m.shape[2]] = m[0]
    return batch


def assert_each_item_alone(hift, mels, caches, speech, sources):
    for b, (m, cache, noise) in enumerate(zip(mels, caches, noises())):
        ref, ref_source = hift.inference(m, cache, noise)
        n = ref.shape[1]
        assert (speech[b, :n] - ref[0]).abs().max().item() <= SPEECH_ATOL, b
        assert not speech[b, n:].any()
        assert sources[b].shape == ref_source.shape
        assert (sources[b] - ref_source).abs().max().item() <= SOURCE_ATOL, b
        if cache is not None:  # the cache is the head of the source
            assert torch.equal(sources[b][..., :CACHE], cache)


def test_istft_is_torch_istft():
    window = HiFT._hann(16)
    spec = torch.randn(3, 9, 50, dtype=torch.complex64, generator=torch.Generator().manual_seed(0))
    ref = torch.istft(spec, 16, 4, 16, window=window)
    assert (istft(spec, 4, window) - ref).abs().max().item() <= 1e-6


def test_padded_streaming_chunks_equal_each_chunk_alone(hift, items):
    mels, caches = items
    speech, sources = hift.inference_padded(padded_batch(mels), LENGTHS, noises(), caches)
    assert_each_item_alone(hift, mels, caches, speech, sources)


def test_bucket_padding_changes_nothing(hift, items):
    mels, caches = items
    graphs = HiFTGraphs(hift, cache_samples=CACHE, cuda_graphs=False)
    assert graphs.bucket(5, 128) == (8, 128) and graphs.bucket(1, 3) == (1, 16)
    speech, sources = graphs(padded_batch(mels), LENGTHS, noises(), caches)
    assert speech.shape[0] == len(LENGTHS)
    assert_each_item_alone(hift, mels, caches, speech, sources)
    assert (graphs.replays, graphs.fallbacks) == (1, 0)
    small = HiFTGraphs(hift, cache_samples=CACHE, cuda_graphs=False, max_bucket_frames=512)  # 8 x 128 > 512
    speech, sources = small(padded_batch(mels), LENGTHS, noises(), caches)
    assert (small.replays, small.fallbacks) == (0, 1)
    assert_each_item_alone(hift, mels, caches, speech, sources)
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        HiFTGraphs(hift, cache_samples=CACHE, cuda_graphs=True)


def test_render_group_runs_short_items_alone(hift, items):
    mels, caches = items
    group = [mels[0], mels[0][:, :, :1], mels[0][:, :, :0], mels[3]]
    outs = render_group(hift, None, group, [None, None, None, caches[3]], [NSFNoise.zero()] * 4)
    assert [s.shape[1] for s, _ in outs] == [480 * 38, 480, 0, 480 * 8]
    for (speech, source), m, c in zip(outs, group, [None, None, None, caches[3]]):
        if m.shape[2]:
            ref, ref_source = hift.inference(m, c, NSFNoise.zero())
            assert (speech - ref).abs().max().item() <= SPEECH_ATOL


def test_padded_inputs_reject_bad_shapes(hift, items):
    mels, caches = items
    batch = padded_batch(mels[:2])
    with pytest.raises(ValueError, match="2 lengths and 1 noises"):
        hift.padded_inputs(batch, [38, 128], [None])
    with pytest.raises(ValueError, match="within"):
        hift.padded_inputs(batch, [38, 129], [None, None])
    with pytest.raises(ValueError, match="longer than its item"):
        hift.padded_inputs(batch, [4, 128], [None, None], [caches[1], None])


@pytest.fixture(scope="module")
def models(tiny_dir):
    return build_models(load_model_dir(tiny_dir))


def render_three(models, hift_graphs):
    """Three streams of different hops through one runner, their jobs batched: the chunks' audio."""
    runner = Token2WavRunner(models.flow, models.hift, flow_cache=False, hift_graphs=hift_graphs)
    g = torch.Generator().manual_seed(3)
    streams = []
    for k, (P, hop) in enumerate([(11, 5), (13, 8), (9, 6)]):
        s = Token2WavStream(torch.randint(0, 6561, (1, P), generator=g, dtype=torch.int32),
                            torch.randn(1, 2 * P, 80, generator=g), torch.randn(1, 192, generator=g),
                            schedule=ChunkSchedule(first_hop=hop, prompt_align=1),
                            noise=NSFNoise.random(torch.Generator().manual_seed(k)))
        s.append(torch.randint(0, models.flow.dims.vocab_size, (41 + 3 * k,), generator=g).tolist())
        streams.append(s)
    chunks = [[] for _ in streams]
    while jobs := [j for s in streams if (j := s.next_job(llm_done=True)) is not None]:
        for job, out in zip(jobs, runner.run_many(jobs)):
            chunks[streams.index(job.stream)].append(out)
    return chunks, runner


def test_streams_of_different_chunk_lengths_share_a_call(models):
    graphs = HiFTGraphs(models.hift, cache_samples=CACHE, cuda_graphs=False)
    got, runner = render_three(models, graphs)
    ref, ref_runner = render_three(models, None)
    assert graphs.replays >= 3 and graphs.fallbacks == 0
    assert runner.stats.hift_items > runner.stats.hift_calls  # chunks of different lengths shared calls
    for mine, alone in zip(got, ref):
        assert [c.shape for c in mine] == [c.shape for c in alone]
        assert max((a - b).abs().max().item() for a, b in zip(mine, alone)) <= 1e-4


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_captured_graphs_match_the_eager_padded_call(tiny_dir):
    models = build_models(load_model_dir(tiny_dir), device="cuda")
    hift = models.hift
    graphs = HiFTGraphs(hift, cache_samples=CACHE)
    assert graphs.warmup([1, 4], [40, 128]) == 4
    gen = torch.Generator().manual_seed(7)
    mel = (2 * torch.randn(1, 80, max(LENGTHS), generator=gen) - 4).cuda()  # a log-mel's range
    for graphed in (False, True):  # buckets the warm-up missed run padded without a graph, then in theirs
        for lengths in (LENGTHS, LENGTHS[:1], LENGTHS[1:4], [38] * 3):
            mels = [mel[:, :, :n] * (1 + 0.1 * b) for b, n in enumerate(lengths)]
            caches = [None if b == 0 else (0.1 * torch.randn(1, 1, CACHE, generator=gen)).cuda()
                      for b in range(len(lengths))]
            zero = [NSFNoise.zero()] * len(lengths)
            speech, sources = graphs(padded_batch(mels), lengths, zero, caches)
            ref, ref_sources = hift.inference_padded(padded_batch(mels), lengths, zero, caches)
            for b, n in enumerate(lengths):
                assert (speech[b, :480 * n] - ref[b, :480 * n]).abs().max().item() <= 1e-4
                assert (sources[b] - ref_sources[b]).abs().max().item() <= SOURCE_ATOL
        while graphs.capture_wanted():
            pass
    assert graphs.fallbacks == 0 and not graphs.wanted
    before = {k: id(v) for k, v in graphs.graphs.items()}
    graphs(padded_batch(mels), lengths, zero, caches)  # a replay: no new capture
    assert {k: id(v) for k, v in graphs.graphs.items()} == before
