"""Flow-estimator backends: the ONNX export, onnxruntime parity with eager, the compiled backend's
bucket padding, the missing-TensorRT error, and reduced-precision flow tolerances (all on CPU).

Tolerances (max abs):
- onnxruntime vs eager estimator output: 1e-4 (upstream's check; measured ~2e-6 on the fixture);
- flow with the onnxruntime backend vs the upstream goldens (flow_mel): 1e-4, like the eager flow;
- compiled backend (bucket padding of batch and length) vs eager: 1e-5 (summation order only);
- reduced-precision flow vs float32 goldens, mel frames (|mel| <= 4.2 on the fixture):
  bfloat16 <= 0.1 (measured 5.6e-2 max, 6.6e-3 mean), float16 <= 0.02 (measured 6.7e-3 max, 1.0e-3
  mean); the resulting audio through a float32 HiFT (rms 0.058) differs by <= 3.1e-2 (bf16) and
  <= 1.5e-2 (fp16) max, 2.9e-3 / 1.0e-3 mean.
TensorRT and CUDA graphs need a GPU and are not run here.
"""
from __future__ import annotations

import copy
import importlib.util

import numpy as np
import onnx
import pytest
from conftest import next_job_upto
from estimator_inputs import estimator_inputs
import torch

from async_cosyvoice.estimator import MissingBackendError, TorchEstimator, make_estimator
from async_cosyvoice.estimator.base import INPUT_NAMES, OUTPUT_NAME, RowSplitEstimator
from async_cosyvoice.estimator.onnx_export import cached_export, export_key
from async_cosyvoice.estimator.torch_backend import CompiledEstimator
from async_cosyvoice.graph_buckets import GRAPH_MEMORY_RESERVE, batch_bucket, length_bucket, room_for_graphs
from async_cosyvoice.model_dir import build_models, load_model_dir
from async_cosyvoice.token2wav import ChunkSchedule, Token2WavRunner, Token2WavStream

torch.set_num_threads(1)

ORT_ATOL = 1e-4
GOLDEN_ATOL = 1e-4
PAD_ATOL = 1e-5


@pytest.fixture(scope="module")
def models(tiny_dir):
    return build_models(load_model_dir(tiny_dir))


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("estimator_cache")


@pytest.fixture(scope="module")
def ort_estimator(models, cache_dir, tiny_dir):
    return make_estimator("onnxruntime", models.flow, cache_dir=cache_dir, flow_pt=tiny_dir / "flow.pt", threads=1)


def test_onnx_graph_inputs_and_dynamic_axes(ort_estimator, cache_dir):
    files = sorted(cache_dir.glob("estimator.*.onnx"))
    assert [f.name.split(".")[1] for f in files] == ["chunked", "full"]
    for f in files:
        graph = onnx.load(str(f)).graph
        assert [i.name for i in graph.input] == list(INPUT_NAMES)
        assert [o.name for o in graph.output] == [OUTPUT_NAME]
        dims = {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]
                for v in list(graph.input) + list(graph.output)}
        for name in ("x", "mu", "cond", OUTPUT_NAME):
            assert dims[name][0] == "batch" and dims[name][2] == "seq_len" and dims[name][1] == 80
        assert dims["mask"] == ["batch", 1, "seq_len"]
        assert dims["t"] == ["batch"] and dims["spks"] == ["batch", 80]
    assert isinstance(ort_estimator, RowSplitEstimator) and ort_estimator.supports_streaming


def test_export_cache(models, cache_dir, ort_estimator, tiny_dir):
    module = models.flow.decoder.estimator
    before = {f: f.stat().st_mtime_ns for f in cache_dir.glob("*.onnx")}
    path = cached_export(module, streaming=False, cache_dir=cache_dir, flow_pt=tiny_dir / "flow.pt")
    assert path in before and path.stat().st_mtime_ns == before[path]  # reused, not exported again
    assert export_key(module, False) != export_key(module, True)
    changed = copy.deepcopy(module)
    with torch.no_grad():
        next(changed.parameters()).add_(1)
    assert export_key(changed, False) != export_key(module, False)


@pytest.mark.parametrize("batch,frames", [(2, 100), (4, 333)])
@pytest.mark.parametrize("streaming", [False, True, "mixed"])
def test_onnxruntime_matches_eager(models, ort_estimator, batch, frames, streaming):
    module = models.flow.decoder.estimator
    args = estimator_inputs(module, batch, frames, seed=batch * frames)
    flag = torch.arange(batch) % 2 == 0 if streaming == "mixed" else streaming
    with torch.inference_mode():
        want = module(*args, flag)
        got = ort_estimator(*args, flag)
        if streaming is True:  # the chunk mask matters at these lengths: a full graph would be wrong
            assert (module(*args, False) - want).abs().max() > 1e-3
    err = (got - want).abs().max().item()
    print(f"onnxruntime vs eager B={batch} T={frames} streaming={streaming}: {err:.1e}")
    assert got.shape == want.shape and got.dtype == want.dtype
    assert err <= ORT_ATOL
    assert got[args[1].expand_as(got) == 0].abs().max() == 0  # masked frames are zero


def _golden_stream(golden_dir, run):
    z = np.load(golden_dir / f"e2e_{run}.npz")
    g = {k: torch.from_numpy(z[k]) for k in z.files}
    stream = Token2WavStream(g["prompt_token"], g["prompt_feat"], g["embedding"], stream=run != "nonstream",
                             schedule=ChunkSchedule(first_hop=int(g["token_hop_len"][0])))
    return stream, g


@pytest.mark.parametrize("run", ["nonstream", "stream_hop15"])
def test_flow_with_onnxruntime_matches_golden(models, ort_estimator, golden_dir, run):
    """The final (full attention) call of the non-streaming golden, and the first streaming chunk
    (chunked graph) of the hop-15 golden."""
    stream, g = _golden_stream(golden_dir, run)
    job = next_job_upto(stream, g["token"][0], llm_done=True)
    assert job.finalize == (run == "nonstream")
    mel = Token2WavRunner(models.flow, models.hift, estimator=ort_estimator).flow_mel(job)
    want = g["call0/flow_mel"]
    err = (mel - want).abs().max().item()
    print(f"flow + onnxruntime vs golden {run} call0 flow_mel: {err:.1e}")
    assert mel.shape == want.shape and err <= GOLDEN_ATOL


def test_onnxruntime_without_chunked_graph_falls_back(models, ort_estimator):
    module = models.flow.decoder.estimator
    full_only = RowSplitEstimator("onnxruntime", ort_estimator.full, None, TorchEstimator(module))
    assert not full_only.supports_streaming
    args = estimator_inputs(module, 4, 120, seed=1)
    flag = torch.tensor([True, False, True, False])
    with torch.inference_mode():
        assert (full_only(*args, flag) - module(*args, flag)).abs().max() <= ORT_ATOL
    with pytest.raises(ValueError, match="fallback"):
        RowSplitEstimator("x", ort_estimator.full, None, None)


def test_buckets():
    assert [length_bucket(t) for t in (1, 64, 65, 500, 512, 513, 1000, 1500, 3000)] == [
        64, 64, 128, 512, 512, 576, 1024, 1536, 3072]
    for t in range(1, 4000, 7):
        b = length_bucket(t)
        assert t <= b and (b - t < 64 or (b - t) / t <= 0.125)
    assert [batch_bucket(b, (2, 4, 8)) for b in (1, 2, 3, 8, 9)] == [2, 2, 4, 8, None]


def test_compiled_bucket_padding_is_exact(models):
    """Eager run of the padded shapes a CUDA graph would see: batch 6 -> 8 rows, 100 -> 128 frames."""
    module = models.flow.decoder.estimator
    est = CompiledEstimator(module, compile=False, cuda_graphs=False, pad_to_buckets=True, batch_buckets=(2, 4, 8))
    args = estimator_inputs(module, 6, 100, seed=3)
    for flag in (False, True, torch.tensor([True, False] * 3)):
        with torch.inference_mode():
            err = (est(*args, flag) - module(*args, flag)).abs().max().item()
        assert err <= PAD_ATOL, (flag, err)
    assert (est.replays, est.fallbacks) == (3, 0)
    wide = estimator_inputs(module, 10, 70, seed=4)  # past the largest batch bucket: the module as is
    with torch.inference_mode():
        assert (est(*wide) - module(*wide)).abs().max().item() <= PAD_ATOL
    assert (est.replays, est.fallbacks) == (3, 1)
    with pytest.raises(ValueError, match="CUDA"):
        CompiledEstimator(module, cuda_graphs=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_compiled_graphs_match_the_padded_eager_call(models):
    """The captured buckets (graph_buckets.GraphBuckets) replay the padded call; a batch past the
    buckets runs without a graph; a second call of a bucket replays, it does not capture."""
    module = copy.deepcopy(models.flow.decoder.estimator).to("cuda")
    graphs = CompiledEstimator(module, compile=False, cuda_graphs=True, batch_buckets=(2, 4, 8))
    padded = CompiledEstimator(module, compile=False, cuda_graphs=False, pad_to_buckets=True, batch_buckets=(2, 4, 8))
    calls = [(6, 100), (2, 64), (6, 90), (3, 130)]
    for graphed in (False, True):  # first calls run padded without a graph; then their graphs replay
        for seed, (batch, frames) in enumerate(calls):
            args = [a.to("cuda") for a in estimator_inputs(module, batch, frames, seed=seed)]
            flag = torch.tensor([True, False] * (batch // 2) + [True] * (batch % 2), device="cuda")
            with torch.inference_mode():
                out, ref = graphs(*args, flag), padded(*args, flag)
            assert out.shape == ref.shape and (out - ref).abs().max().item() <= PAD_ATOL
        if not graphed:
            assert not graphs.graphs and list(graphs.wanted) == [(8, 128), (2, 64), (4, 192)]
            assert (graphs.deferred, graphs.replays) == (4, 0)
            while graphs.capture_wanted():  # captured from _example inputs
                pass
    assert sorted(graphs.graphs) == [(2, 64), (4, 192), (8, 128)] and graphs.replays == 4
    wide = [a.to("cuda") for a in estimator_inputs(module, 10, 70, seed=9)]
    with torch.inference_mode():
        assert (graphs(*wide) - module(*wide)).abs().max().item() <= 1e-3  # TF32 convolutions
    assert graphs.fallbacks == 1 and len(graphs.graphs) == 3


def test_make_estimator_kinds(models):
    assert make_estimator("torch", models.flow).name == "torch"
    est = make_estimator("compiled", models.flow, max_batch=16)
    assert est.name == "compiled" and not est.cuda_graphs and est.batch_buckets == (2, 4, 8, 16)
    with pytest.raises(ValueError, match="unknown estimator"):
        make_estimator("tvm", models.flow)
    with pytest.raises(ValueError, match="move it"):
        make_estimator("torch", models.flow, dtype=torch.float16)


@pytest.mark.skipif(importlib.util.find_spec("tensorrt") is not None, reason="tensorrt is installed")
def test_tensorrt_missing_is_a_clear_error(models):
    import async_cosyvoice.estimator.tensorrt_backend  # noqa: F401  importable without tensorrt
    with pytest.raises(MissingBackendError, match="'tensorrt'") as e:
        make_estimator("tensorrt", models.flow)
    assert "pip install" in str(e.value) and isinstance(e.value, ImportError)


@pytest.mark.parametrize("dtype,mel_atol", [
    (torch.bfloat16, 0.1),
    pytest.param(torch.float16, 0.02, marks=pytest.mark.slow),  # float16 convolutions are slow on CPU
])
def test_reduced_precision_flow(models, golden_dir, dtype, mel_atol):
    g = dict(np.load(golden_dir / "flow.npz"))
    inp = {k: torch.from_numpy(g[k]) for k in ("prompt_token", "prompt_feat", "embedding")}
    flow = copy.deepcopy(models.flow).to(dtype)
    mel = flow.inference(torch.from_numpy(g["token"]), **inp, streaming=False, finalize=True)
    err = (mel - torch.from_numpy(g["nonstream/mel"])).abs()
    print(f"{dtype} flow mel vs float32 golden: max {err.max():.1e} mean {err.mean():.1e}")
    assert err.max() <= mel_atol


@pytest.mark.slow
def test_dynamo_export_matches_eager(models, tmp_path):
    """The torch.export-based exporter gives the same graph interface and numbers (slow: ~40 s)."""
    import onnxruntime as ort

    from async_cosyvoice.estimator.onnx_export import export_estimator
    module = models.flow.decoder.estimator
    path = export_estimator(module, tmp_path / "est.onnx", streaming=True, exporter="dynamo")
    assert [i.name for i in onnx.load(str(path)).graph.input] == list(INPUT_NAMES)
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    args = estimator_inputs(module, 4, 150, seed=5)
    got = sess.run([OUTPUT_NAME], {n: a.numpy() for n, a in zip(INPUT_NAMES, args)})[0]
    with torch.inference_mode():
        want = module(*args, True)
    assert np.abs(got - want.numpy()).max() <= ORT_ATOL


@pytest.mark.slow
def test_torch_compile_on_cpu(models):
    """torch.compile without CUDA graphs on the CPU (inductor C++; slow)."""
    module = models.flow.decoder.estimator
    est = make_estimator("compiled", models.flow)
    args = estimator_inputs(module, 2, 80, seed=7)
    with torch.inference_mode():
        assert (est(*args, True) - module(*args, True)).abs().max() <= 1e-4


def test_new_graphs_leave_the_memory_reserve_to_calls_without_one():
    """A graph's pool keeps its memory for good, so new graphs stop while less than the reserve
    (a fraction of the device's memory) is free; calls of new shapes then run without a graph."""
    gib = 2**30
    assert room_for_graphs(40 * gib, 80 * gib)
    assert room_for_graphs(int(GRAPH_MEMORY_RESERVE * 80 * gib), 80 * gib)
    assert not room_for_graphs(int(GRAPH_MEMORY_RESERVE * 80 * gib) - 1, 80 * gib)
    assert not room_for_graphs(8 * 2**20, 80 * gib)  # what the CosyVoice3 run left free before its OOM
    assert room_for_graphs(1 * gib, 80 * gib, reserve=0.0)
