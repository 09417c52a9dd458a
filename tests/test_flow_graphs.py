"""Whole flow calls per (streams, tokens) bucket (token2wav/flow_graphs.py).

On CPU the padded call runs without a graph: padding to the bucket must change no item's frames
(atol 1e-5: summation order only), calls past the buckets must fall back to the plain flow, and a
streamed utterance through the runner must give the same audio. The CUDA test captures real
graphs and compares them with the eager flow (run on the GPU machine; skipped here).
"""
from __future__ import annotations

import pytest
import torch

from async_cosyvoice.config import Token2WavConfig
from async_cosyvoice.estimator import TorchEstimator
from async_cosyvoice.model_dir import build_models, load_model_dir
from async_cosyvoice.token2wav import ChunkSchedule, Token2WavRunner, Token2WavStream
from async_cosyvoice.token2wav.flow_graphs import FlowGraphs

PAD_ATOL = 1e-5


@pytest.fixture(scope="module")
def models(tiny_dir):
    return build_models(load_model_dir(tiny_dir))


def batch_inputs(flow, items, seed=0, device="cpu"):
    """items: (prompt tokens, target tokens, context, streaming) -> Flow.forward's inputs, right-padded."""
    g = torch.Generator().manual_seed(seed)
    dims = flow.dims
    B = len(items)
    S = max(p + n for p, n, _, _ in items)
    F = max(dims.token_mel_ratio * p for p, _, _, _ in items)
    tokens = torch.zeros(B, S, dtype=torch.int32)
    prompt_feat = torch.zeros(B, F, dims.output_size)
    for b, (p, n, _, _) in enumerate(items):
        tokens[b, :p + n] = torch.randint(0, dims.vocab_size, (p + n,), generator=g, dtype=torch.int32)
        prompt_feat[b, :dims.token_mel_ratio * p] = torch.randn(dims.token_mel_ratio * p, dims.output_size, generator=g)
    token_lens = torch.tensor([p + n - c for p, n, c, _ in items])
    context = torch.tensor([c for _, _, c, _ in items])
    feat_lens = torch.tensor([dims.token_mel_ratio * p for p, _, _, _ in items])
    embedding = torch.randn(B, dims.spk_embed_dim, generator=g)
    streaming = torch.tensor([s for _, _, _, s in items])
    return [t.to(device) for t in (tokens, token_lens, context, prompt_feat, feat_lens, embedding)] + [streaming]


ITEMS = [(20, 33, 3, True), (7, 18, 3, True), (12, 40, 0, False)]  # a final call beside two chunks


def assert_same_frames(mel_a, lens_a, mel_b, lens_b, atol=PAD_ATOL):
    assert lens_a.tolist() == lens_b.tolist()
    for b, n in enumerate(lens_a.tolist()):
        diff = (mel_a[b, :, :n].float() - mel_b[b, :, :n].float()).abs().max().item()
        assert diff <= atol, f"item {b}: {diff}"


def test_padding_to_the_bucket_is_exact(models):
    flow = models.flow
    inputs = batch_inputs(flow, ITEMS)
    graphs = FlowGraphs(flow, flow.decoder.estimator, cuda_graphs=False, min_token_step=32)
    assert graphs.bucket(3, 53) == (4, 64)
    mel, lens = graphs(*inputs)
    ref, ref_lens = flow(*inputs)
    assert mel.shape[0] == 3 and mel.shape[2] == flow.dims.token_mel_ratio * 64  # padded to the bucket
    assert_same_frames(mel, lens, ref, ref_lens)
    assert (graphs.replays, graphs.fallbacks) == (1, 0)


def test_calls_past_the_buckets_run_the_flow(models):
    flow = models.flow
    inputs = batch_inputs(flow, ITEMS, seed=1)
    graphs = FlowGraphs(flow, flow.decoder.estimator, cuda_graphs=False, max_bucket_tokens=128)  # 4 x 64 > 128
    assert graphs.bucket(3, 53) is None and graphs.bucket(2, 53) == (2, 64)
    mel, lens = graphs(*inputs)
    ref, ref_lens = flow(*inputs)
    assert graphs.fallbacks == 1 and graphs.replays == 0
    assert mel.shape == ref.shape
    assert_same_frames(mel, lens, ref, ref_lens)
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        FlowGraphs(flow, flow.decoder.estimator, cuda_graphs=True)


def render(models, flow_graphs):
    runner = Token2WavRunner(models.flow, models.hift, flow_cache=False, flow_graphs=flow_graphs)
    g = torch.Generator().manual_seed(3)
    P = 11
    stream = Token2WavStream(torch.randint(0, 6561, (1, P), generator=g, dtype=torch.int32),
                             torch.randn(1, 2 * P, 80, generator=g), torch.randn(1, 192, generator=g),
                             schedule=ChunkSchedule(first_hop=5, prompt_align=1))
    torch.manual_seed(0)  # the NSF noise
    tokens = torch.randint(0, models.flow.dims.vocab_size, (47,), generator=g).tolist()
    return torch.cat(runner.render(stream, tokens))


def test_streamed_audio_is_the_same_with_bucketed_calls(models):
    graphs = FlowGraphs(models.flow, models.flow.decoder.estimator, cuda_graphs=False)
    audio = render(models, graphs)
    ref = render(models, None)
    assert graphs.replays >= 3 and graphs.fallbacks == 0
    assert audio.shape == ref.shape
    assert (audio - ref).abs().max().item() <= 1e-4  # through HiFT (|audio| ~ 0.1)


def test_config_needs_a_torch_estimator():
    assert Token2WavConfig(flow_graphs=True, estimator="compiled").flow_graphs
    with pytest.raises(ValueError, match="flow_graphs needs estimator torch or compiled"):
        Token2WavConfig(flow_graphs=True, estimator="onnxruntime")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_captured_graphs_match_the_eager_flow(tiny_dir):
    models = build_models(load_model_dir(tiny_dir), device="cuda")
    flow = models.flow
    graphs = FlowGraphs(flow, TorchEstimator(flow.decoder.estimator).capturable)
    assert graphs.warmup([1, 2], [40]) == 2
    padded_eager = FlowGraphs(flow, flow.decoder.estimator, cuda_graphs=False)
    for graphed in (False, True):  # new buckets first run padded without a graph, then in their graphs
        for seed, items in enumerate([ITEMS, ITEMS[:1], ITEMS[1:], [(20, 30, 3, True)] * 4]):
            inputs = batch_inputs(flow, items, seed=seed, device="cuda")
            mel, lens = graphs(*inputs)
            # the graph replays the padded call: same shapes, same kernels
            assert_same_frames(mel, lens, *padded_eager(*inputs), atol=1e-5)
            # against the unpadded call: other shapes pick other cuDNN / cuBLAS kernels, and float32
            # convolutions use TF32 by default on CUDA (measured on an H100: 2.4e-4 on |mel| <= 4)
            assert_same_frames(mel, lens, *flow(*inputs), atol=1e-3)
        if not graphed:
            assert graphs.wanted and graphs.deferred >= len(graphs.wanted)
            while graphs.capture_wanted():
                pass
    assert graphs.fallbacks == 0 and len(graphs.graphs) >= 3 and not graphs.wanted
    before = {k: id(v) for k, v in graphs.graphs.items()}
    mel2, _ = graphs(*batch_inputs(flow, ITEMS, seed=0, device="cuda"))  # a replay: no new capture
    assert {k: id(v) for k, v in graphs.graphs.items()} == before
