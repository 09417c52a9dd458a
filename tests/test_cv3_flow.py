"""CosyVoice3 DiT flow parity against the upstream goldens (golden/README.md sections c, e, f),
batching invariance, and strict loading of flow.pt."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from async_cosyvoice.errors import ModelDirError
from async_cosyvoice.model_dir import load_strict
from async_cosyvoice.models.cosyvoice3.flow import DiTFlow

from cv3_fixture import cv3_dir, flow_dims

torch.set_num_threads(1)

ATOL = 1e-4
GOLDEN_CALLS = {"nonstream": dict(streaming=False, finalize=True), "chunk": dict(streaming=True, finalize=False)}
# DiT internals of CFG step 1 (nonstream only): module outputs recorded by forward hooks
INTERNALS = {"est_step1_time_embed": "time_embed", "est_step1_input_embed": "input_embed",
             "est_step1_block0_out": "transformer_blocks.0", "est_step1_norm_out": "norm_out"}
E2E_VC = ["e2e_vc_nonstream", "e2e_vc_stream_hop25", "e2e_vc_stream_hop15", "e2e_vc_stream_hop25_p16"]
E2E_LLM = [f"e2e_llm_{mode}_{kind}" for mode in ("zero_shot", "cross_lingual", "instruct2")
           for kind in ("nonstream", "stream")]


@pytest.fixture(scope="module")
def d():
    return cv3_dir()


@pytest.fixture(scope="module")
def flow(d) -> DiTFlow:
    model = DiTFlow(flow_dims(d))
    load_strict(model, torch.load(d / "flow.pt", map_location="cpu", weights_only=True), "flow.pt")
    return model.eval()


@pytest.fixture(scope="module")
def golden(d):
    return np.load(d / "golden" / "flow.npz")


def _t(a) -> torch.Tensor:
    return torch.from_numpy(np.asarray(a))


def _max_err(ours: torch.Tensor, ref: np.ndarray) -> float:
    assert tuple(ours.shape) == ref.shape, f"shape {tuple(ours.shape)} != golden {ref.shape}"
    return float(np.abs(ours.detach().float().numpy() - ref).max())


@pytest.mark.parametrize("case", list(GOLDEN_CALLS))
def test_flow_matches_golden(flow, golden, case):
    trace: dict = {}
    est = flow.decoder.estimator
    modules = dict(est.named_modules())

    def record(key):
        def hook(module, args, out):
            trace.setdefault(key, out)  # CFG step 1 is the first call
        return hook

    hooks = [modules[name].register_forward_hook(record(key)) for key, name in INTERNALS.items()]
    try:
        flow.inference(_t(golden["token"]), _t(golden["prompt_token"]), _t(golden["prompt_feat"]),
                       _t(golden["embedding"]), trace=trace, **GOLDEN_CALLS[case])
    finally:
        for h in hooks:
            h.remove()
    trace["spk_proj"] = trace["spks"]  # the affine layer on the normalized x-vector is the CFM's spks
    keys = [k for k in golden.files if k.startswith(case + "/")]
    assert len(keys) >= 16
    errors = {k: _max_err(trace[k.split("/", 1)[1]], golden[k]) for k in keys}
    bad = {k: e for k, e in errors.items() if e > ATOL}
    assert not bad, f"over {ATOL}: {bad}"
    if case == "nonstream":
        assert set(INTERNALS) <= {k.split("/", 1)[1] for k in keys}


def _calls(z):
    """(n_tokens, finalize) of each token2wav call of an e2e golden: a non-final call renders all
    but the 3 look-ahead tokens, 2 frames each; the last call renders all."""
    n = sum(1 for k in z.files if k.startswith("call") and k.endswith("/flow_mel"))
    out = []
    for i in range(n):
        frames = z[f"call{i}/flow_mel"].shape[2]
        final = i == n - 1
        out.append((frames // 2 if final else frames // 2 + 3, final))
    return out


@pytest.mark.parametrize("run", E2E_VC)
def test_e2e_vc_flow_calls(flow, d, run):
    z = np.load(d / "golden" / f"{run}.npz")
    tokens = _t(z["token"])
    calls = _calls(z)
    assert calls[-1][0] == tokens.shape[1]
    for i, (n, final) in enumerate(calls):
        mel = flow.inference(tokens[:, :n], _t(z["prompt_token"]), _t(z["prompt_feat"]), _t(z["embedding"]),
                             streaming=not final, finalize=final)
        assert _max_err(mel, z[f"call{i}/flow_mel"]) <= ATOL, f"call {i}"


@pytest.mark.parametrize("run", E2E_LLM)
def test_e2e_llm_flow_calls(flow, d, run):
    """The seeded end-to-end runs: their speech tokens (after the silent filter) and the frontend's prompt."""
    z = np.load(d / "golden" / f"{run}.npz")
    mode = run[len("e2e_llm_"):].rsplit("_", 1)[0]
    inputs = np.load(d / "golden" / "model_inputs.npz")
    prompt_token, prompt_feat, embedding = (_t(inputs[f"{mode}/{k}"]) for k in
                                            ("flow_prompt_speech_token", "prompt_speech_feat", "flow_embedding"))
    tokens = _t(z["speech_tokens"])
    for i, (n, final) in enumerate(_calls(z)):
        mel = flow.inference(tokens[:, :n], prompt_token, prompt_feat, embedding, streaming=not final, finalize=final)
        assert _max_err(mel, z[f"call{i}/flow_mel"]) <= ATOL, f"call {i}"


def test_padded_batch_equals_single_calls(flow, golden):
    """Items of different lengths, look-ahead and attention in one right-padded call equal their own calls."""
    prompt, feat, emb = _t(golden["prompt_token"]), _t(golden["prompt_feat"]), _t(golden["embedding"])
    token = _t(golden["token"])
    items = [(token[:, :40], True), (token[:, :23], False), (token[:, :31], True)]
    singles = [flow.inference(t, prompt, feat, emb, streaming=not final, finalize=final) for t, final in items]
    P = prompt.shape[1]
    S = max(P + t.shape[1] for t, _ in items)
    tokens = torch.zeros(len(items), S, dtype=torch.int32)
    for b, (t, _) in enumerate(items):
        tokens[b, :P + t.shape[1]] = torch.cat([prompt, t], dim=1)[0]
    contexts = torch.tensor([0 if final else 3 for _, final in items])
    token_lens = torch.tensor([P + t.shape[1] for t, _ in items]) - contexts
    with torch.inference_mode():
        mel, mel_lens = flow(tokens, token_lens, contexts, feat.expand(len(items), -1, -1),
                             torch.tensor([feat.shape[1]] * len(items)), emb.expand(len(items), -1),
                             torch.tensor([not final for _, final in items]))
    for b, single in enumerate(singles):
        batched = mel[b:b + 1, :, feat.shape[1]:int(mel_lens[b])]
        assert batched.shape == single.shape
        torch.testing.assert_close(batched, single, atol=1e-5, rtol=0)


def test_flow_pt_loads_strictly(d):
    sd = torch.load(d / "flow.pt", map_location="cpu", weights_only=True)
    del sd["decoder.estimator.rotary_embed.inv_freq"]
    with pytest.raises(ModelDirError, match="flow.pt.*rotary_embed.inv_freq"):
        load_strict(DiTFlow(flow_dims(d)), sd, "flow.pt")


def test_half_precision_flow_runs_close_to_fp32(d, golden):
    """The flow in float16 (the GPU serving dtype): the rotary runs in float32 and casts back as
    x_transformers does, so q, k and v share a dtype; the mel stays near the fp32 golden."""
    model = DiTFlow(flow_dims(d))
    load_strict(model, torch.load(d / "flow.pt", map_location="cpu", weights_only=True), "flow.pt")
    model = model.eval().to(torch.float16)
    mel = model.inference(_t(golden["token"]), _t(golden["prompt_token"]), _t(golden["prompt_feat"]),
                          _t(golden["embedding"]), streaming=True, finalize=False)
    assert mel.dtype == torch.float32 and _max_err(mel, golden["chunk/mel"]) < 2e-2
