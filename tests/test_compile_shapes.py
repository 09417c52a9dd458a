"""Every batch size's compiled programs made before serving (GraphBuckets.compile_shapes).

Once the server serves, nothing compiles (compile_cache.stop_compiling): a call whose shape needs a
program torch.compile has not made runs eagerly, and so does every replay of a graph captured of
it. The warm-up runs at 1 stream; on the CPU the flow estimator's compiled resnet blocks guard on
2 <= rows <= 15, so a 16-stream call needs programs of its own. `compile_shapes` runs each batch
bucket once; after it, calls of every stream count and length compile nothing new.
"""
from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from async_cosyvoice.estimator import CompiledEstimator
from async_cosyvoice.model_dir import build_models, load_model_dir
from async_cosyvoice.token2wav.flow_graphs import FlowGraphs

from estimator_inputs import estimator_inputs
from test_flow_graphs import batch_inputs

STREAM_BUCKETS = (1, 2, 4, 8, 16)


@pytest.fixture(scope="module")
def models(tiny_dir):
    return build_models(load_model_dir(tiny_dir), with_llm=False)


def programs() -> int:
    return counters["stats"]["unique_graphs"]


def flow_graphs(models) -> FlowGraphs:
    torch._dynamo.reset()  # programs are cached per code object: start from none
    estimator = CompiledEstimator(models.flow.decoder.estimator, compile=True, compile_regions=True, cuda_graphs=False)
    return FlowGraphs(models.flow, estimator.capturable, estimator, cuda_graphs=False, min_token_step=32,
                      stream_buckets=STREAM_BUCKETS, compiled=estimator.compiled)


def call(graphs, streams: int, tokens: int, seed: int) -> None:
    items = [(10, tokens - 10, 0, bool(b % 2)) for b in range(streams)]
    graphs(*batch_inputs(graphs.flow, items, seed=seed))


@pytest.mark.slow
def test_after_compile_shapes_no_stream_count_or_length_compiles_anything(models):
    graphs = flow_graphs(models)
    call(graphs, 1, 40, seed=0)  # what the warm-up ran
    before = programs()
    call(graphs, 16, 40, seed=1)
    assert programs() > before, "a 16-stream call compiled nothing new: the guard this test is about is gone"

    graphs = flow_graphs(models)
    assert graphs.compile_shapes([32, 96]) == 2 * len(STREAM_BUCKETS)
    made = programs()
    for seed, (streams, tokens) in enumerate([(1, 20), (3, 70), (5, 40), (9, 90), (16, 60), (12, 33)]):
        call(graphs, streams, tokens, seed)
    assert programs() == made


def test_compile_shapes_runs_nothing_where_nothing_is_compiled(models):
    estimator = CompiledEstimator(models.flow.decoder.estimator, compile=False, cuda_graphs=False)
    graphs = FlowGraphs(models.flow, estimator.capturable, estimator, cuda_graphs=False, compiled=estimator.compiled)
    assert graphs.compile_shapes([32, 96]) == 0


@pytest.mark.slow
def test_the_estimators_own_buckets_compile_every_row_count_too(models):
    """Configs without whole-flow graphs (configs/multi-gpu.yaml) run the compiled estimator in
    per-step graphs of (rows, frames) buckets: the warm-up runs those buckets the same way."""
    torch._dynamo.reset()
    module = models.flow.decoder.estimator
    estimator = CompiledEstimator(module, compile=True, compile_regions=True, cuda_graphs=False,
                                  pad_to_buckets=True, batch_buckets=(2, 4, 8, 16, 32))
    assert estimator.compile_shapes([64, 192]) == 10
    made = programs()
    for seed, (rows, frames) in enumerate([(2, 50), (6, 130), (20, 90), (32, 190)]):
        with torch.inference_mode():
            estimator(*estimator_inputs(module, rows, frames, seed=seed))
    assert programs() == made
