"""A call whose bucket has no CUDA graph yet runs in a captured larger bucket's graph that adds
little work (GraphBuckets.cover), while its own bucket waits for the capture thread.

On CPU: the rule that picks the cover, and that padding as far as a cover pads is exact (the
flow of 3 items padded to 8 rows x 128 tokens). On a GPU: a covered call replays the larger
graph, equals the call padded to its own bucket, and leaves its own bucket wanted.
"""
from __future__ import annotations

import pytest
import torch

from async_cosyvoice.config import Config
from async_cosyvoice.estimator import TorchEstimator
from async_cosyvoice.model_dir import build_models, load_model_dir
from async_cosyvoice.token2wav.flow_graphs import FlowGraphs
from async_cosyvoice.warmup import capture_plan

from test_flow_graphs import ITEMS, assert_same_frames, batch_inputs


@pytest.fixture(scope="module")
def models(tiny_dir):
    return build_models(load_model_dir(tiny_dir), with_llm=False)


def test_the_cover_is_the_smallest_captured_bucket_within_the_extra_work(models):
    graphs = FlowGraphs(models.flow, models.flow.decoder.estimator, cuda_graphs=False, max_cover_tokens=1024)
    assert graphs.cover((2, 96)) is None  # nothing captured
    graphs.graphs.update(dict.fromkeys([(1, 512), (2, 512), (4, 256), (4, 512), (8, 512)]))
    assert graphs.cover((1, 64)) == (1, 512)    # 448 extra
    assert graphs.cover((2, 96)) == (2, 512)    # 832 extra; (4, 256) adds 832 too but is the same size
    assert graphs.cover((3, 160)) == (4, 256)   # 544 extra, smaller than (4, 512)
    assert graphs.cover((4, 288)) == (4, 512)   # 896 extra
    assert graphs.cover((4, 224)) == (4, 256)   # 128 extra
    assert graphs.cover((8, 384)) == (8, 512)   # 1024 extra: at the limit
    assert graphs.cover((8, 352)) is None       # 1280 extra
    assert graphs.cover((16, 64)) is None       # no larger batch captured
    graphs.max_cover_extra = 0
    assert graphs.cover((1, 64)) is None        # covers off


def test_padding_as_far_as_a_cover_pads_is_exact(models):
    flow = models.flow
    inputs = batch_inputs(flow, ITEMS, seed=2)
    wide = FlowGraphs(flow, flow.decoder.estimator, cuda_graphs=False, stream_buckets=(8,), min_token_step=128)
    assert wide.bucket(3, 53) == (8, 128)  # 1024 streams x tokens for 3 x 53 = 159 of them
    mel, lens = wide(*inputs)
    assert_same_frames(mel, lens, *flow(*inputs))


def test_the_plan_captures_its_covers_first():
    config = Config()
    plan = capture_plan(config)
    longest = plan.flow[0][1][-1]  # every token bucket of prompt + speech: 512 for 250 + 250
    assert longest >= config.warmup.capture_prompt_tokens + config.warmup.capture_speech_tokens
    assert plan.covers == (2, 4, 8)
    assert plan.with_covers(plan.flow)[0] == ((2, 4, 8), (longest // 2, longest))
    assert plan.with_covers(plan.flow)[1:] == plan.flow
    assert capture_plan(config, before_serving=True).covers == ()  # before SERVING: first chunks only
    config.warmup.cover_streams = 1
    assert capture_plan(config).with_covers(plan.flow) == plan.flow


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_a_covered_call_replays_the_larger_graph_and_waits_for_its_own(tiny_dir):
    models = build_models(load_model_dir(tiny_dir), device="cuda", with_llm=False)
    flow = models.flow
    graphs = FlowGraphs(flow, TorchEstimator(flow.decoder.estimator).capturable, max_cover_tokens=1024)
    assert graphs.warmup([4], [128]) == 1
    padded_eager = FlowGraphs(flow, flow.decoder.estimator, cuda_graphs=False)
    inputs = batch_inputs(flow, ITEMS, seed=4, device="cuda")  # bucket (4, 64): not captured
    mel, lens = graphs(*inputs)
    assert (graphs.covered, graphs.replays, graphs.deferred) == (1, 1, 0)
    assert list(graphs.wanted) == [(4, 64)]
    # other shapes pick other kernels, and float32 convolutions use TF32 on CUDA (test_flow_graphs: 2.4e-4)
    assert_same_frames(mel, lens, *padded_eager(*inputs), atol=1e-3)
    assert graphs.capture_wanted() and (4, 64) in graphs.graphs
    graphs(*inputs)
    assert (graphs.covered, graphs.replays) == (1, 2)
