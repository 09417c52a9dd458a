"""CosyVoice3 through the production token2wav path: Token2WavStream (schedule, causal vocoder
carry) + Token2WavRunner (batched DiT flow, exact flow state cache, CausalHiFT) reproduce upstream's
end-to-end audio goldens (golden/README.md sections e, f), chunk by chunk."""
import numpy as np
import pytest
import torch

from async_cosyvoice.model_dir import load_strict, normalize_hift_state_dict
from async_cosyvoice.models.cosyvoice3.flow import DiTFlow
from async_cosyvoice.models.cosyvoice3.hift import F0_PREDICTOR_PREFIX, CausalHiFT
from async_cosyvoice.models.cosyvoice3.nsf_noise import FixedNSFNoise
from async_cosyvoice.estimator import make_estimator
from async_cosyvoice.token2wav import ChunkSchedule, Token2WavRunner, Token2WavStream
from async_cosyvoice.token2wav.flow_graphs import FlowGraphs

from cv3_fixture import cv3_dir, flow_dims, hift_dims

torch.set_num_threads(1)

ATOL = 1e-4
E2E_VC = ["e2e_vc_nonstream", "e2e_vc_stream_hop25", "e2e_vc_stream_hop15", "e2e_vc_stream_hop25_p16"]
E2E_LLM = [f"e2e_llm_{mode}_{kind}" for mode in ("zero_shot", "cross_lingual", "instruct2")
           for kind in ("nonstream", "stream")]


@pytest.fixture(scope="module")
def d():
    return cv3_dir()


@pytest.fixture(scope="module")
def flow(d):
    f = DiTFlow(flow_dims(d))
    load_strict(f, torch.load(d / "flow.pt", map_location="cpu", weights_only=True), "flow.pt")
    return f.eval()


@pytest.fixture(scope="module")
def vocoders(d):
    sd = normalize_hift_state_dict(torch.load(d / "hift.pt", map_location="cpu", weights_only=True), "hift.pt",
                                   float64_under=(F0_PREDICTOR_PREFIX,))
    out = {}
    for kind, noise in (("real", FixedNSFNoise.replay(flow_dims(d), hift_dims(d))), ("zero", FixedNSFNoise.zeros())):
        out[kind] = CausalHiFT(hift_dims(d), noise)
        load_strict(out[kind], sd, "hift.pt")
        out[kind].eval()
    return out


def _render(flow, hift, prompt, tokens, streaming: bool, hop: int, flow_cache: bool):
    runner = Token2WavRunner(flow, hift, flow_cache=flow_cache)
    assert runner.causal_vocoder
    stream = Token2WavStream(*prompt, stream=streaming, schedule=ChunkSchedule(first_hop=hop), causal_vocoder=True)
    return runner.render(stream, tokens)


def _check(z, chunks, audio_key):
    assert [c.numel() for c in chunks] == z["chunk_lengths"].tolist()
    err = float(np.abs(torch.cat(chunks).numpy() - z[audio_key][0]).max())
    assert err <= ATOL, err


@pytest.mark.parametrize("flow_cache", [True, False], ids=["cached", "recompute"])
@pytest.mark.parametrize("run", E2E_VC)
def test_e2e_vc(d, flow, vocoders, run, flow_cache):
    z = np.load(d / "golden" / f"{run}.npz")
    prompt = [torch.from_numpy(z[k]) for k in ("prompt_token", "prompt_feat", "embedding")]
    hop = int(z["token_hop_len"][0])
    streaming = run != "e2e_vc_nonstream"
    for kind, key in (("real", "audio"), ("zero", "audio_zero_noise")):
        _check(z, _render(flow, vocoders[kind], prompt, z["token"][0].tolist(), streaming, hop, flow_cache), key)


@pytest.mark.parametrize("run", E2E_LLM)
def test_e2e_llm(d, flow, vocoders, run):
    z = np.load(d / "golden" / f"{run}.npz")
    mode = run[len("e2e_llm_"):].rsplit("_", 1)[0]
    inputs = np.load(d / "golden" / "model_inputs.npz")
    prompt = [torch.from_numpy(inputs[f"{mode}/{k}"])
              for k in ("flow_prompt_speech_token", "prompt_speech_feat", "flow_embedding")]
    chunks = _render(flow, vocoders["real"], prompt, z["speech_tokens"][0].tolist(), run.endswith("_stream"), 25,
                     flow_cache=True)
    _check(z, chunks, "audio")


def test_streams_of_both_lengths_batch_together(d, flow, vocoders):
    """Two streams' chunks in one run_many call (flow and vocoder batched) equal each stream alone, up to
    float summation order (a padded flow batch moves the mel ~1e-6; the NSF phase amplifies it ~10x)."""
    z = np.load(d / "golden" / "e2e_vc_stream_hop15.npz")
    prompt = [torch.from_numpy(z[k]) for k in ("prompt_token", "prompt_feat", "embedding")]
    hift = vocoders["real"]
    alone = [_render(flow, hift, prompt, z["token"][0, :n].tolist(), True, 15, True) for n in (90, 60)]
    runner = Token2WavRunner(flow, hift, length_bucket_ratio=100)
    streams = [Token2WavStream(*prompt, schedule=ChunkSchedule(first_hop=15), causal_vocoder=True) for _ in range(2)]
    for s, n in zip(streams, (90, 60)):
        s.append(z["token"][0, :n].tolist())
    together: list[list[torch.Tensor]] = [[], []]
    while jobs := [j for s in streams if (j := s.next_job(llm_done=True)) is not None]:
        for j, out in zip(jobs, runner.run_many(jobs)):
            together[streams.index(j.stream)].append(out)
    for a, t in zip(alone, together):
        assert [c.numel() for c in a] == [c.numel() for c in t]
        torch.testing.assert_close(torch.cat(t), torch.cat(a), atol=ATOL, rtol=0)


def test_estimator_backend_and_flow_graphs_path(d, flow, vocoders, tmp_path):
    """The stage's other flow paths take the DiT as they take CosyVoice2's U-Net: the 'torch',
    'compiled' (no torch.compile, no graphs on CPU) and 'onnxruntime' (the DiT exported to ONNX,
    chunked and full attention) estimator backends, and FlowGraphs' bucketed whole-flow calls
    (padded to the bucket, no graph on CPU; for the backends with a capturable form), reproduce a
    streamed golden."""
    z = np.load(d / "golden" / "e2e_vc_stream_hop25.npz")
    prompt = [torch.from_numpy(z[k]) for k in ("prompt_token", "prompt_feat", "embedding")]
    for kind in ("torch", "compiled", "onnxruntime"):
        est = make_estimator(kind, flow, compile=False, cuda_graphs=False, cache_dir=tmp_path, threads=1,
                             flow_pt=d / "flow.pt")
        graphs = (FlowGraphs(flow, est.capturable, est, cuda_graphs=False, min_token_step=16)
                  if hasattr(est, "capturable") else None)
        runner = Token2WavRunner(flow, vocoders["real"], estimator=est, flow_cache=False, flow_graphs=graphs)
        stream = Token2WavStream(*prompt, schedule=ChunkSchedule(first_hop=25), causal_vocoder=True)
        _check(z, runner.render(stream, z["token"][0].tolist()), "audio")
