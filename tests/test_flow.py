"""Flow parity against the upstream goldens (golden/README.md section c) and batching invariance."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from async_cosyvoice.model_dir import load_model_dir
from async_cosyvoice.models.dims import FlowDims
from async_cosyvoice.models.flow.cfm import fixed_noise
from async_cosyvoice.models.flow.flow import Flow

torch.set_num_threads(1)

ATOL = 1e-4
GOLDEN_CALLS = {"nonstream": dict(streaming=False, finalize=True), "chunk": dict(streaming=True, finalize=False)}
TRACED = ["encoder_out", "mu", "spks", "cond", "mask", "est_step1_out", "est_step10_out", "est_t_per_step", "mel"]
E2E_RUNS = ["e2e_nonstream", "e2e_stream_hop25", "e2e_stream_hop15", "e2e_stream_hop25_p16"]


def flow_dims(tiny_dir) -> FlowDims:
    return load_model_dir(tiny_dir).dims.flow


# ---- fixtures -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def flow_state(tiny_dir):
    return torch.load(tiny_dir / "flow.pt", map_location="cpu", weights_only=True)


@pytest.fixture(scope="module")
def flow(tiny_dir, flow_state) -> Flow:
    model = Flow(flow_dims(tiny_dir))
    model.load_state_dict(flow_state, strict=True)
    return model.eval()


@pytest.fixture(scope="module")
def golden(golden_dir) -> dict[str, np.ndarray]:
    return dict(np.load(golden_dir / "flow.npz"))


def _inputs(g: dict) -> dict[str, torch.Tensor]:
    return {k: torch.from_numpy(np.asarray(g[k])) for k in ("prompt_token", "prompt_feat", "embedding")}


def _max_err(a: torch.Tensor, b: np.ndarray) -> float:
    a = a.detach().float().cpu().numpy()
    assert a.shape == b.shape, (a.shape, b.shape)
    return float(np.abs(a - b).max()) if a.size else 0.0


# ---- tests --------------------------------------------------------------------------------------

def test_strict_load(tiny_dir, flow_state):
    model = Flow(flow_dims(tiny_dir))
    model.load_state_dict(flow_state, strict=True)
    assert set(model.state_dict()) == set(flow_state)  # no buffers (noise, pos tables) in the state dict


def test_noise_bit_exact(golden_dir, flow):
    prefix = np.load(golden_dir / "cfm_rand_noise_prefix.npy")
    noise = fixed_noise(prefix.shape[1], flow.dims.cfm.noise_frames, torch.device("cpu"), torch.float32)
    assert noise.shape == (1, prefix.shape[1], flow.dims.cfm.noise_frames)
    assert np.array_equal(noise[:, :, : prefix.shape[2]].numpy(), prefix)


@pytest.mark.parametrize("prefix", list(GOLDEN_CALLS))
def test_golden_pipeline(flow, golden, prefix):
    trace = {}
    mel = flow.inference(torch.from_numpy(golden["token"]), **_inputs(golden), **GOLDEN_CALLS[prefix], trace=trace)
    assert mel.dtype == torch.float32 and torch.equal(mel, trace["mel"])
    errors = {name: _max_err(trace[name], golden[f"{prefix}/{name}"]) for name in TRACED}
    print(prefix, " ".join(f"{k}={v:.2e}" for k, v in errors.items()))
    assert max(errors.values()) <= ATOL, errors


@pytest.mark.parametrize("prefix", list(GOLDEN_CALLS))
def test_golden_estimator_direct(flow, golden, prefix):
    args = [torch.from_numpy(golden[f"{prefix}/est_step1_in_{n}"]) for n in ("x", "mask", "mu", "t", "spks", "cond")]
    with torch.inference_mode():
        out = flow.decoder.estimator(*args, streaming=GOLDEN_CALLS[prefix]["streaming"])
    err = _max_err(out, golden[f"{prefix}/est_step1_out"])
    print(prefix, f"est_step1_out (golden inputs) = {err:.2e}")
    assert err <= ATOL


def _e2e_calls(golden_dir, run):
    g = dict(np.load(golden_dir / f"{run}.npz"))
    calls = []
    i = 0
    while f"call{i}/n_tokens" in g:
        calls.append(dict(
            n_tokens=int(g[f"call{i}/n_tokens"][0]),
            finalize=bool(g[f"call{i}/finalize"][0]),
            streaming=bool(g[f"call{i}/flow_streaming"][0]),
            mel=g[f"call{i}/flow_mel"],
        ))
        i += 1
    return g, calls


@pytest.mark.parametrize("run", E2E_RUNS)
def test_e2e_flow_calls(flow, golden_dir, run):
    """Every flow call of the upstream token2wav schedules (growing token prefixes, mixed flags)."""
    g, calls = _e2e_calls(golden_dir, run)
    errors = []
    for c in calls:
        mel = flow.inference(torch.from_numpy(g["token"][:, : c["n_tokens"]]), **_inputs(g),
                             streaming=c["streaming"], finalize=c["finalize"])
        errors.append(_max_err(mel, c["mel"]))
    print(run, " ".join(f"{e:.2e}" for e in errors))
    assert max(errors) <= ATOL


def _batch(items: list[dict]):
    """items: tokens (1-D, prompt + target), n_context, prompt_feat (F, 80), embedding (192,)."""
    B, S = len(items), max(len(it["tokens"]) for it in items)
    F = max(it["prompt_feat"].shape[0] for it in items)
    tokens = torch.zeros(B, S, dtype=torch.long)
    feats = torch.zeros(B, F, items[0]["prompt_feat"].shape[1])
    for b, it in enumerate(items):
        tokens[b, : len(it["tokens"])] = it["tokens"]
        feats[b, : it["prompt_feat"].shape[0]] = it["prompt_feat"]
    return dict(
        tokens=tokens,
        token_lens=torch.tensor([len(it["tokens"]) - it["n_context"] for it in items]),
        context_lens=torch.tensor([it["n_context"] for it in items]),
        prompt_feat=feats,
        prompt_feat_lens=torch.tensor([it["prompt_feat"].shape[0] for it in items]),
        embedding=torch.stack([it["embedding"] for it in items]),
        streaming=torch.tensor([it["streaming"] for it in items]),
    )


def test_batched_equals_single(flow, golden):
    """Two different-length items (one streaming chunk, one shorter final call) padded into one batch."""
    ratio, context = flow.dims.token_mel_ratio, flow.dims.pre_lookahead_len
    inp = _inputs(golden)
    token, prompt = torch.from_numpy(golden["token"])[0].long(), inp["prompt_token"][0].long()
    P2 = max(1, prompt.numel() // 2)
    items = [
        dict(tokens=torch.cat([prompt, token]), n_context=context, prompt_feat=inp["prompt_feat"][0],
             embedding=inp["embedding"][0], streaming=True),
        dict(tokens=torch.cat([prompt[:P2], token[: token.numel() // 2]]), n_context=0,
             prompt_feat=inp["prompt_feat"][0, : ratio * P2], embedding=-inp["embedding"][0], streaming=False),
    ]
    with torch.inference_mode():
        mel, mel_lens = flow(**_batch(items))
        errors = []
        for b, it in enumerate(items):
            single, single_lens = flow(**_batch([it]))
            assert mel_lens[b] == single_lens[0]
            errors.append((mel[b, :, : mel_lens[b]] - single[0]).abs().max().item())
            assert mel[b, :, mel_lens[b]:].count_nonzero() == 0  # padding frames stay zero
    print("batched vs single", " ".join(f"{e:.2e}" for e in errors))
    assert max(errors) <= 1e-5


def test_batched_e2e_schedule(flow, golden_dir):
    """All calls of a streaming schedule (chunked and final, 4 lengths) in one batch, against the goldens."""
    g, calls = _e2e_calls(golden_dir, "e2e_stream_hop15")
    inp = _inputs(g)
    prompt, token = inp["prompt_token"][0].long(), torch.from_numpy(g["token"])[0].long()
    context, F = flow.dims.pre_lookahead_len, inp["prompt_feat"].shape[1]
    items = [dict(tokens=torch.cat([prompt, token[: c["n_tokens"]]]), n_context=0 if c["finalize"] else context,
                  prompt_feat=inp["prompt_feat"][0], embedding=inp["embedding"][0], streaming=c["streaming"])
             for c in calls]
    with torch.inference_mode():
        mel, mel_lens = flow(**_batch(items))
    errors = [_max_err(mel[b: b + 1, :, F: mel_lens[b]], c["mel"]) for b, c in enumerate(calls)]
    print("batched schedule", " ".join(f"{e:.2e}" for e in errors))
    assert max(errors) <= ATOL


def test_estimator_batched_mixed_streaming(flow, golden):
    """The two golden estimator inputs (different T, one chunked, one full) padded into one call."""
    names = ("x", "mask", "mu", "t", "spks", "cond")
    args = {p: [torch.from_numpy(golden[f"{p}/est_step1_in_{n}"]) for n in names] for p in GOLDEN_CALLS}
    T = max(a[0].shape[-1] for a in args.values())
    pad = lambda a: torch.nn.functional.pad(a, (0, T - a.shape[-1])) if a.dim() == 3 else a  # noqa: E731
    batched = [torch.cat([pad(args[p][i]) for p in GOLDEN_CALLS]) for i in range(len(names))]
    streaming = torch.tensor([GOLDEN_CALLS[p]["streaming"] for p in GOLDEN_CALLS for _ in range(2)])
    with torch.inference_mode():
        out = flow.decoder.estimator(*batched, streaming=streaming)
    for i, p in enumerate(GOLDEN_CALLS):
        got = out[2 * i: 2 * i + 2, :, : args[p][0].shape[-1]]
        assert _max_err(got, golden[f"{p}/est_step1_out"]) <= ATOL
        assert out[2 * i: 2 * i + 2, :, args[p][0].shape[-1]:].count_nonzero() == 0


def test_bfloat16_cpu(flow, golden):
    model = copy.deepcopy(flow).to(torch.bfloat16)
    mel = model.inference(torch.from_numpy(golden["token"]), **_inputs(golden), **GOLDEN_CALLS["nonstream"])
    assert mel.dtype == torch.float32
    err = _max_err(mel, golden["nonstream/mel"])
    print(f"bfloat16 mel max err {err:.3f} (|mel| max {np.abs(golden['nonstream/mel']).max():.2f})")
    assert err < 0.25


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cuda(flow, golden, dtype):
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    model = copy.deepcopy(flow).to("cuda", dtype)
    for prefix, flags in GOLDEN_CALLS.items():
        mel = model.inference(torch.from_numpy(golden["token"]).cuda(), **_inputs(golden), **flags)
        assert mel.dtype == torch.float32 and mel.is_cuda
        err = _max_err(mel, golden[f"{prefix}/mel"])
        print(f"cuda {dtype} {prefix} mel max err {err:.2e}")
        assert err <= (ATOL if dtype == torch.float32 else 0.25)
