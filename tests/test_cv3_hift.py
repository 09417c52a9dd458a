"""CosyVoice3 vocoder (CausalHiFT) parity against the upstream goldens (golden/README.md sections d,
e, f): final / non-final calls with the real (fixed) and zeroed NSF noise, the NSF noise replay,
and whole token2wav runs (flow + vocoder + the stream's carry) against the end-to-end audio."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from async_cosyvoice.errors import ModelDirError
from async_cosyvoice.model_dir import load_strict, normalize_hift_state_dict
from async_cosyvoice.models.cosyvoice3.flow import DiTFlow
from async_cosyvoice.models.cosyvoice3.hift import F0_PREDICTOR_PREFIX, CausalHiFT
from async_cosyvoice.models.cosyvoice3.nsf_noise import FixedNSFNoise
from async_cosyvoice.token2wav.carry import CausalCarry

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
def state_dict(d):
    raw = torch.load(d / "hift.pt", map_location="cpu", weights_only=True)
    return normalize_hift_state_dict(raw, "hift.pt", float64_under=(F0_PREDICTOR_PREFIX,))


def _vocoder(d, state_dict, noise: FixedNSFNoise) -> CausalHiFT:
    m = CausalHiFT(hift_dims(d), noise)
    load_strict(m, state_dict, "hift.pt")
    return m.eval()


@pytest.fixture(scope="module")
def noise(d) -> FixedNSFNoise:
    return FixedNSFNoise.replay(flow_dims(d), hift_dims(d))


@pytest.fixture(scope="module")
def vocoders(d, state_dict, noise) -> dict[str, CausalHiFT]:
    return {"real": _vocoder(d, state_dict, noise), "zero": _vocoder(d, state_dict, FixedNSFNoise.zeros())}


@pytest.fixture(scope="module")
def golden(d):
    return np.load(d / "golden" / "hift.npz")


def _max_err(ours: torch.Tensor, ref: np.ndarray) -> float:
    assert tuple(ours.shape) == ref.shape, f"shape {tuple(ours.shape)} != golden {ref.shape}"
    return float(np.abs(ours.double().numpy() - ref).max())


def test_nsf_noise_replay_is_upstreams(d, golden, noise):
    """The replay of the yaml's construction draws gives upstream's generator state, buffers and all."""
    before = torch.get_rng_state()
    again = FixedNSFNoise.replay(flow_dims(d), hift_dims(d))
    assert torch.equal(torch.get_rng_state(), before)  # the caller's generator is untouched
    recorded = FixedNSFNoise.from_generator_state(torch.from_numpy(np.load(d / "golden" / "nsf_rng_state.npy")))
    for n in (noise, again, recorded):
        assert torch.equal(n.rand_ini, torch.from_numpy(golden["nsf/rand_ini"]))
        assert torch.equal(n.sine_noise(4800, "cpu"), torch.from_numpy(golden["nsf/sine_waves_prefix"]))
    # drawn lazily: a longer prefix starts with the shorter one
    assert torch.equal(noise.sine_noise(500_000, "cpu")[:, :4800], torch.from_numpy(golden["nsf/sine_waves_prefix"]))
    with pytest.raises(ValueError, match="300 s"):
        noise.sine_noise(300 * 24000 + 1, "cpu")


@pytest.mark.parametrize("kind", ["real", "zero"])
@pytest.mark.parametrize("call", ["final", "nonfinal"])
def test_vocoder_matches_golden(vocoders, golden, kind, call):
    trace: dict = {}
    speech, source = vocoders[kind].inference(torch.from_numpy(golden["mel"]), finalize=call == "final", trace=trace)
    assert trace["f0"].dtype == torch.float64
    ref_f0 = golden[f"{kind}/{call}/f0"]
    assert np.abs(trace["f0"].numpy() - ref_f0).max() <= 1e-6 * np.abs(ref_f0).max()
    assert _max_err(source, golden[f"{kind}/{call}/source"]) <= 1e-3
    assert _max_err(speech, golden[f"{kind}/{call}/speech"]) <= ATOL


def test_nonfinal_call_is_a_prefix_of_the_final_one(vocoders, golden):
    """Causal: the samples a non-final call emits are those of any longer call on the same mel."""
    hift = vocoders["real"]
    mel = torch.from_numpy(golden["mel"])
    final, _ = hift.inference(mel, finalize=True)
    part, _ = hift.inference(mel[:, :, :50], finalize=False)
    assert part.shape[1] == hift.emitted_samples(50, finalize=False) == 42 * 480
    torch.testing.assert_close(part, final[:, :part.shape[1]], atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind", ["real", "zero"])
def test_render_batches_streams_exactly(vocoders, golden, kind):
    """Final and non-final calls of different lengths in one padded call equal their own calls (and
    items too short to emit anything come back empty)."""
    hift = vocoders[kind]
    mel = torch.from_numpy(golden["mel"]) + 0.3 * torch.randn(1, 80, 80, generator=torch.Generator().manual_seed(1))
    mels = [mel, mel[:, :, :50], mel[:, :, :50], mel[:, :, :61], mel[:, :, :13], mel[:, :, :8], mel[:, :, :7],
            mel[:, :, :1], mel[:, :, :0], mel[:, :, :79]]
    flags = [True, False, True, False, False, False, False, True, True, True]
    for m, f, out in zip(mels, flags, hift.render(mels, flags)):
        assert out.shape[1] == hift.emitted_samples(m.shape[2], f)
        if out.numel():
            torch.testing.assert_close(out, hift.inference(m, finalize=f)[0], atol=1e-6, rtol=0)


def test_f0_predictor_stays_float64(d, state_dict):
    hift = _vocoder(d, state_dict, FixedNSFNoise.zeros()).half()
    assert all(p.dtype == torch.float64 for p in hift.f0_predictor.parameters())
    assert hift.conv_pre.weight.dtype == torch.float16


def test_hift_pt_loads_strictly(d, state_dict):
    sd = dict(state_dict)
    del sd["source_downs.0.weight"]
    with pytest.raises(ModelDirError, match="hift.pt.*source_downs.0.weight"):
        load_strict(CausalHiFT(hift_dims(d)), sd, "hift.pt")


# ---- whole token2wav runs: the flow, the vocoder and the stream's carry --------------------------

@pytest.fixture(scope="module")
def flow(d) -> DiTFlow:
    model = DiTFlow(flow_dims(d))
    load_strict(model, torch.load(d / "flow.pt", map_location="cpu", weights_only=True), "flow.pt")
    return model.eval()


def _run(flow, hift, tokens, prompt_token, prompt_feat, embedding, calls):
    """Upstream's CosyVoice3Model.token2wav sequence: calls = [(n_tokens, token_offset, finalize)]."""
    carry, chunks, mels = CausalCarry(), [], []
    for n, offset, final in calls:
        flow_mel = flow.inference(tokens[:, :n], prompt_token, prompt_feat, embedding,
                                  streaming=not final, finalize=final)
        mel, cache_source = carry.hift_input(flow_mel[:, :, 2 * offset:], final)
        assert cache_source is None
        speech, source = hift.inference(mel, finalize=final)
        chunks.append(carry.finish(mel, speech, source, final)[0])
        mels.append(flow_mel)
    return chunks, carry.mel, mels


def _calls(z, n_tokens: int):
    """(n_tokens, token_offset, finalize) per call, from the goldens' chunk lengths and mels."""
    n = len(z["chunk_lengths"])
    calls, offset = [], 0
    for i in range(n):
        final = i == n - 1
        frames = z[f"call{i}/flow_mel"].shape[2]
        seen = frames // 2 if final else frames // 2 + 3
        calls.append((seen, offset, final))
        offset = frames // 2
    assert calls[-1][0] == n_tokens
    return calls


def _check_run(z, chunks, hift_mel, mels, audio_key):
    assert [c.numel() for c in chunks] == z["chunk_lengths"].tolist()
    for i, mel in enumerate(mels):
        assert _max_err(mel, z[f"call{i}/flow_mel"]) <= ATOL
    assert _max_err(hift_mel, z["hift_in_mel_final"]) <= ATOL
    assert _max_err(torch.cat(chunks)[None], z[audio_key]) <= ATOL


@pytest.mark.parametrize("run", E2E_VC)
@pytest.mark.parametrize("kind", ["real", "zero"])
def test_e2e_vc_audio(d, flow, vocoders, run, kind):
    z = np.load(d / "golden" / f"{run}.npz")
    tokens = torch.from_numpy(z["token"])
    chunks, hift_mel, mels = _run(flow, vocoders[kind], tokens, torch.from_numpy(z["prompt_token"]),
                                  torch.from_numpy(z["prompt_feat"]), torch.from_numpy(z["embedding"]),
                                  _calls(z, tokens.shape[1]))
    _check_run(z, chunks, hift_mel, mels, "audio" if kind == "real" else "audio_zero_noise")


@pytest.mark.parametrize("run", E2E_LLM)
def test_e2e_llm_audio(d, flow, vocoders, run):
    """The seeded end-to-end runs from their (golden) speech tokens: CosyVoice3 streams are deterministic."""
    z = np.load(d / "golden" / f"{run}.npz")
    mode = run[len("e2e_llm_"):].rsplit("_", 1)[0]
    inputs = np.load(d / "golden" / "model_inputs.npz")
    prompt = [torch.from_numpy(inputs[f"{mode}/{k}"])
              for k in ("flow_prompt_speech_token", "prompt_speech_feat", "flow_embedding")]
    tokens = torch.from_numpy(z["speech_tokens"])
    chunks, hift_mel, mels = _run(flow, vocoders["real"], tokens, *prompt, _calls(z, tokens.shape[1]))
    _check_run(z, chunks, hift_mel, mels, "audio")
