"""CosyVoice3's CausalHiFT through HiFT's graph buckets (token2wav/hift_graphs.py,
HiFTGraphs.render_causal, CausalHiFT.render_padded).

On CPU (no graphs: the same call on inputs padded to the bucket): final and non-final items of
different lengths, padded to a bucket longer than any of them, equal each item's own call, with the
fixed NSF noise and without; past the buckets the eager call gives the same; streams rendered by
the runner with the graphs object give the same audio as without. The CUDA test captures real
graphs and compares them with the eager padded call (run on the GPU machine; skipped here).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from async_cosyvoice.config import Config
from async_cosyvoice.model_dir import build_models, load_model_dir
from async_cosyvoice.models.cosyvoice3.hift import CausalHiFT
from async_cosyvoice.models.cosyvoice3.nsf_noise import FixedNSFNoise
from async_cosyvoice.token2wav import ChunkSchedule, Token2WavRunner, Token2WavStream
from async_cosyvoice.token2wav.hift_graphs import HiFTGraphs, render_group
from async_cosyvoice.token2wav.stage import token2wav_batcher

from cv3_fixture import cv3_dir

torch.set_num_threads(1)

LENGTHS = [80, 50, 50, 61, 13, 8, 7, 1, 79]  # 8 and 7 non-final: nothing to emit; 1: one final frame
FINAL = [True, False, True, False, False, False, False, True, True]


@pytest.fixture(scope="module")
def d():
    return cv3_dir()


@pytest.fixture(scope="module")
def models(d):
    return build_models(load_model_dir(d))


@pytest.fixture(scope="module", params=["real", "zero"])
def hift(request, models) -> CausalHiFT:
    h = models.hift
    assert isinstance(h, CausalHiFT) and not h.nsf_noise.is_zero
    if request.param == "real":
        return h
    quiet = CausalHiFT(h.dims, FixedNSFNoise.zeros())
    quiet.load_state_dict(h.state_dict())
    return quiet.eval()


@pytest.fixture(scope="module")
def mels(d):
    mel = torch.from_numpy(np.load(d / "golden" / "hift.npz")["mel"])
    mel = mel + 0.3 * torch.randn(1, 80, mel.shape[2], generator=torch.Generator().manual_seed(1))
    return [mel[:, :, :n] for n in LENGTHS]


def assert_each_item_alone(hift, mels, outs):
    for m, fin, out in zip(mels, FINAL, outs):
        assert out.shape[1] == hift.emitted_samples(m.shape[2], fin)
        if out.numel():
            torch.testing.assert_close(out, hift.inference(m, finalize=fin)[0], atol=1e-6, rtol=0)


def test_bucket_padding_changes_nothing(hift, mels):
    graphs = HiFTGraphs(hift, cache_samples=0, cuda_graphs=False)
    assert graphs.bucket(8, 80) == (8, 80) and graphs.bucket(1, 1) == (1, 16)
    eager = hift.render(mels, FINAL)
    outs = [s for s, _ in render_group(hift, graphs, mels, [None] * len(mels), [None] * len(mels), FINAL)]
    assert (graphs.replays, graphs.fallbacks) == (1, 0)
    assert_each_item_alone(hift, mels, outs)
    for a, b in zip(outs, eager):  # the same length, more (zero) rows: the same floats
        assert torch.equal(a, b)
    # fewer items, shorter than their bucket (41 frames -> 48, 2 -> 2 rows): the padding is zeros
    few = [mels[3][:, :, :41], mels[4]]
    outs = hift.render(few, [True, False], graphs.render_causal)
    assert graphs.replays == 2 and graphs.bucket(2, 41) == (2, 48)
    for m, fin, out in zip(few, [True, False], outs):
        torch.testing.assert_close(out, hift.inference(m, finalize=fin)[0], atol=1e-6, rtol=0)


def test_past_the_buckets_runs_eagerly(hift, mels):
    small = HiFTGraphs(hift, cache_samples=0, cuda_graphs=False, max_bucket_frames=48)  # 1 x 80 > 48
    outs = hift.render(mels, FINAL, small.render_causal)
    # one item per call: the five longer than 48 frames eagerly, the 13- and 1-frame ones in their
    # buckets (the non-final 8 and 7 emit nothing and are not rendered)
    assert (small.replays, small.fallbacks) == (2, 5)
    assert_each_item_alone(hift, mels, outs)


def test_causal_graphs_refuse_what_they_cannot_take(models, mels):
    with pytest.raises(ValueError, match="no cache_source"):
        HiFTGraphs(models.hift, cache_samples=3840, cuda_graphs=False)
    graphs = HiFTGraphs(models.hift, cache_samples=0, cuda_graphs=False)
    with pytest.raises(TypeError, match="render_causal"):
        graphs(mels[0], [80], [None])
    with pytest.raises(ValueError, match="within"):
        models.hift.padded_inputs(mels[0], [81])
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        HiFTGraphs(models.hift, cache_samples=0, cuda_graphs=True)


def render_streams(models, hift_graphs):
    """Three CosyVoice3 streams of different hops through one runner, their jobs batched: the chunks."""
    runner = Token2WavRunner(models.flow, models.hift, flow_cache=False, hift_graphs=hift_graphs,
                             length_bucket_ratio=100)
    g = torch.Generator().manual_seed(3)
    streams = []
    for P, hop, n in [(11, 5, 41), (13, 8, 44), (9, 6, 47)]:
        s = Token2WavStream(torch.randint(0, 6561, (1, P), generator=g, dtype=torch.int32),
                            torch.randn(1, 2 * P, 80, generator=g), torch.randn(1, 192, generator=g),
                            schedule=ChunkSchedule(first_hop=hop, prompt_align=1), causal_vocoder=True)
        s.append(torch.randint(0, 6561, (n,), generator=g).tolist())
        streams.append(s)
    chunks = [[] for _ in streams]
    while jobs := [j for s in streams if (j := s.next_job(llm_done=True)) is not None]:
        for job, out in zip(jobs, runner.run_many(jobs)):
            chunks[streams.index(job.stream)].append(out)
    return chunks, runner


def test_streams_render_the_same_through_the_graph_buckets(models):
    graphs = HiFTGraphs(models.hift, cache_samples=0, cuda_graphs=False)
    got, runner = render_streams(models, graphs)
    ref, _ = render_streams(models, None)
    assert graphs.replays >= 3 and graphs.fallbacks == 0
    assert runner.stats.hift_items > runner.stats.hift_calls  # streams' calls of different lengths shared a call
    for mine, alone in zip(got, ref):
        assert [c.shape for c in mine] == [c.shape for c in alone]
        assert max((a - b).abs().max().item() for a, b in zip(mine, alone)) <= 1e-5


def test_the_stage_leaves_graphs_off_on_cpu(d, models):
    config = Config.model_validate({"model": {"dir": str(d)}, "token2wav": {"hift_graphs": True}})
    assert token2wav_batcher(config, models, load_model_dir(d)).runner.hift_graphs is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_captured_causal_graphs_match_the_eager_call(d):
    model_dir = load_model_dir(d)
    models = build_models(model_dir, device="cuda", with_llm=False)
    hift = models.hift
    config = Config.model_validate({"model": {"dir": str(d)}, "token2wav": {"hift_graphs": True}})
    staged = token2wav_batcher(config, models, model_dir).runner.hift_graphs  # the server's stage builds them
    assert isinstance(staged, HiFTGraphs) and staged.hift is hift and staged.cache_samples == 0
    graphs = HiFTGraphs(hift, cache_samples=0)
    assert graphs.warmup([1, 4], [40, 128]) == 4
    gen = torch.Generator().manual_seed(7)
    mel = (2 * torch.randn(1, 80, 128, generator=gen) - 4).cuda()  # a log-mel's range
    for graphed in (False, True):  # buckets the warm-up missed run padded without a graph, then in theirs
        for lengths, final in (([128, 50, 13, 100], [True, False, True, False]), ([38], [False]),
                               ([20, 21, 22], [True] * 3)):
            mels = [mel[:, :, :n] * (1 + 0.1 * b) for b, n in enumerate(lengths)]
            got = hift.render(mels, final, graphs.render_causal)
            ref = hift.render(mels, final)
            for a, b in zip(got, ref):
                assert a.shape == b.shape
                assert (a - b).abs().max().item() <= 1e-4
        while graphs.capture_wanted():
            pass
    assert graphs.fallbacks == 0 and not graphs.wanted
    before = {k: id(v) for k, v in graphs.graphs.items()}
    hift.render(mels, final, graphs.render_causal)  # a replay: no new capture
    assert {k: id(v) for k, v in graphs.graphs.items()} == before


def test_a_call_past_the_buckets_runs_in_bucket_sized_groups(hift, mels):
    """Items of up to 80 frames with buckets of at most 160 items x frames: 2 x 80 = 160 fits, so
    groups of 2 items, each padded to its own bucket, the same
    floats as the one eager call over all of them; the output is as wide as the longest item."""
    graphs = HiFTGraphs(hift, cache_samples=0, cuda_graphs=False, max_bucket_frames=160)
    assert graphs.items_per_call(80) == 2 and graphs.items_per_call(161) == 1
    eager = hift.render(mels, FINAL)
    outs = hift.render(mels, FINAL, graphs.render_causal)
    # the 7 items that emit (non-final 8 and 7 emit nothing) in ceil(7 / 2) calls, each in a bucket
    assert (graphs.replays, graphs.fallbacks) == (4, 0)
    assert_each_item_alone(hift, mels, outs)
    for a, b in zip(outs, eager):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
