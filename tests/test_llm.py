"""CosyVoice2 LM + Qwen2 backbone against the upstream goldens (llm.npz), and KV-cache behaviour."""
import numpy as np
import pytest
import torch

from async_cosyvoice.engine.base import length_limits
from async_cosyvoice.model_dir import load_model_dir, load_strict
from async_cosyvoice.models.dims import EOS_TOKEN, STOP_TOKENS, RASParams
from async_cosyvoice.models.llm import CosyVoice2LM
from async_cosyvoice.sampling import ras_sample, suppress_batch

pytestmark = pytest.mark.usefixtures("_one_thread")

CASES = ["zero_shot", "cross_lingual"]
ATOL = 1e-4


def load_tiny_lm(tiny_dir) -> CosyVoice2LM:
    """The fixture's llm.pt through model_dir (llm.model.model.* -> backbone.*, lm_head dropped)."""
    md = load_model_dir(tiny_dir)
    model = CosyVoice2LM(md.dims.lm)
    load_strict(model, md.llm_state_dict(), "llm.pt")
    return model.eval()


def prompt_of(inputs, mode: str) -> tuple[list[int], list[int], int]:
    """(text tokens = prompt text ++ text, LLM prompt speech tokens, target text length) of a golden mode."""
    get = lambda key: inputs[f"{mode}/{key}"][0].tolist() if f"{mode}/{key}" in inputs.files else []  # noqa: E731
    return get("prompt_text") + get("text"), get("llm_prompt_speech_token"), len(get("text"))


@pytest.fixture(scope="module")
def golden(golden_dir):
    return np.load(golden_dir / "llm.npz")


@pytest.fixture(scope="module")
def inputs(golden_dir):
    return np.load(golden_dir / "model_inputs.npz")


def _max_err(a: torch.Tensor, b: np.ndarray) -> float:
    a = a.detach().numpy()
    both_inf = np.isinf(a) & np.isinf(b) & (np.sign(a) == np.sign(b))
    return float(np.abs(np.subtract(a, b, where=~both_inf, out=np.zeros_like(a))).max())


@pytest.mark.parametrize("case", CASES)
def test_prompt_embedding_and_lengths(lm, golden, inputs, case):
    text, speech, n_target = prompt_of(inputs, case)
    with torch.no_grad():
        x = lm.embed_prompt(text, speech)
    assert x.shape == golden[f"{case}/lm_input"].shape[1:]
    assert _max_err(x, golden[f"{case}/lm_input"][0]) <= 1e-7
    assert length_limits(n_target) == (int(golden[f"{case}/min_len"][0]), int(golden[f"{case}/max_len"][0]))


@pytest.mark.parametrize("case", CASES)
def test_incremental_decode_matches_upstream(lm, golden, inputs, case):
    text, speech, n_target = prompt_of(inputs, case)
    min_len, _ = length_limits(n_target)
    forced = golden[f"{case}/forced_tokens"].tolist()
    with torch.no_grad():
        x = lm.embed_prompt(text, speech)[None]
        L = x.shape[1]
        cache = lm.new_cache(num_slots=2, max_len=L + len(forced))
        slots = torch.tensor([1])  # not slot 0, so the slot indexing is exercised
        positions = torch.arange(L)[None]
        hidden, decoded, sampler_in = [], [], []
        for tok in forced:
            hidden.append(lm.backbone(x, positions, cache, slots)[0, -1])
            logp = lm.logits(hidden[-1]).log_softmax(-1)
            suppress_batch(logp[None], torch.tensor([len(decoded)]), torch.tensor([min_len]), torch.tensor([False]))
            sampler_in.append(logp)
            decoded.append(tok)
            x = lm.embed_speech(torch.tensor([[tok]]))
            positions = torch.tensor([[L + len(decoded) - 1]])
        hidden = torch.stack(hidden)
        logits = lm.logits(hidden)
    errs = {"hidden_last": _max_err(hidden, golden[f"{case}/hidden_last"]),
            "logits": _max_err(logits, golden[f"{case}/logits"]),
            "logp": _max_err(logits.log_softmax(-1), golden[f"{case}/logp"]),
            "sampler_in": _max_err(torch.stack(sampler_in), golden[f"{case}/sampler_in"])}
    print(case, errs)
    assert max(errs.values()) <= ATOL, errs
    assert np.isneginf(golden[f"{case}/sampler_in"][:, EOS_TOKEN]).all()


@pytest.mark.parametrize("case", CASES)
def test_full_pass_matches_upstream(lm, golden, inputs, case):
    text, speech, _ = prompt_of(inputs, case)
    forced = golden[f"{case}/forced_tokens"].tolist()
    with torch.no_grad():
        prompt = lm.embed_prompt(text, speech)
        x = torch.cat([prompt, lm.embed_speech(torch.tensor(forced[:-1]))])[None]
        logp = lm.logits(lm.backbone(x)[0, prompt.shape[0] - 1:]).log_softmax(-1)
    err = _max_err(logp, golden[f"{case}/full_forward_logp"])
    print(case, "full pass logp", err)
    assert err <= ATOL


def test_padded_batch_prefill_and_decode_match_single(lm, inputs):
    """Two prompts of different lengths in one padded batch, in arbitrary slots, then batched
    decode steps, give what each gives alone (and what the no-cache pass gives)."""
    prompts = [lm.embed_prompt(*prompt_of(inputs, m)[:2]) for m in ("zero_shot", "instruct2")]
    lens = [p.shape[0] for p in prompts]
    T = max(lens)
    steps = [[5, 77, 6000], [9, 9, 1]]
    with torch.no_grad():
        x = torch.zeros(2, T, prompts[0].shape[1])
        positions = torch.full((2, T), -1)
        for b, p in enumerate(prompts):  # right padding for one, left padding for the other
            sl = slice(0, lens[b]) if b == 0 else slice(T - lens[b], T)
            x[b, sl] = p
            positions[b, sl] = torch.arange(lens[b])
        cache = lm.new_cache(num_slots=4, max_len=T + 8)
        slots = torch.tensor([3, 0])
        h = lm.backbone(x, positions, cache, slots)
        batched = [[h[0, lens[0] - 1]], [h[1, T - 1]]]
        for i in range(len(steps[0])):
            tok = torch.tensor([[steps[0][i]], [steps[1][i]]])
            pos = torch.tensor([[lens[0] + i], [lens[1] + i]])
            # a smaller static attention window than the cache is enough and must not change anything
            h = lm.backbone(lm.embed_speech(tok), pos, cache, slots, kv_len=T + 4)
            batched[0].append(h[0, 0])
            batched[1].append(h[1, 0])

        for b, p in enumerate(prompts):
            full = torch.cat([p, lm.embed_speech(torch.tensor(steps[b]))])[None]
            ref = lm.backbone(full)[0, lens[b] - 1:]
            np.testing.assert_allclose(torch.stack(batched[b]).numpy(), ref.numpy(), atol=1e-5)


def test_padded_no_cache_pass_matches_single(lm, inputs):
    prompts = [lm.embed_prompt(*prompt_of(inputs, m)[:2]) for m in ("cross_lingual", "sft")]
    T = max(p.shape[0] for p in prompts)
    x = torch.zeros(2, T, prompts[0].shape[1])
    positions = torch.full((2, T), -1)
    for b, p in enumerate(prompts):
        x[b, :len(p)] = p
        positions[b, :len(p)] = torch.arange(len(p))
    with torch.no_grad():
        h = lm.backbone(x, positions)
        assert torch.isfinite(h).all()
        for b, p in enumerate(prompts):
            np.testing.assert_allclose(h[b, :len(p)].numpy(), lm.backbone(p[None])[0].numpy(), atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_runs_close(lm, inputs, dtype):
    text, speech, _ = prompt_of(inputs, "zero_shot")
    with torch.no_grad():
        ref = lm.logits(lm.backbone(lm.embed_prompt(text, speech)[None])).log_softmax(-1)
        low = CosyVoice2LM(lm.dims)
        low.load_state_dict(lm.state_dict())
        low = low.to(dtype).eval()
        x = low.embed_prompt(text, speech)[None]
        cache = low.new_cache(1, x.shape[1] + 1)
        h = low.backbone(x, torch.arange(x.shape[1])[None], cache, torch.tensor([0]))
        assert h.dtype == dtype and cache.dtype == dtype
        out = low.logits(h).float().log_softmax(-1)
    assert torch.isfinite(out).all()
    assert (out - ref).abs().max() < 0.5  # a precision smoke test, not parity
    assert (out.argmax(-1) == ref.argmax(-1)).float().mean() > 0.8


def test_generate_reference_greedy_matches_recompute(lm, inputs):
    """The cached loop equals a from-scratch greedy loop; min/max length and stop ids honoured."""
    text, speech, n_target = prompt_of(inputs, "cross_lingual")
    greedy = lambda logp, decoded: ras_sample(logp, decoded, RASParams(top_k=1))  # noqa: E731
    out = lm.generate_reference(text, speech, min_len=3, max_len=12, sampler=greedy)
    with torch.no_grad():
        prompt = lm.embed_prompt(text, speech)
        ref: list[int] = []
        for step in range(12):
            x = torch.cat([prompt, lm.embed_speech(torch.tensor(ref, dtype=torch.long))])[None]
            logp = lm.logits(lm.backbone(x)[0, -1]).log_softmax(-1)
            if step < 3:
                logp[EOS_TOKEN] = -float("inf")
            tok = int(logp.argmax())
            if tok in STOP_TOKENS:
                break
            ref.append(tok)
    assert out == ref
    assert 3 <= len(out) <= 12 and not set(out) & set(STOP_TOKENS)


def test_generate_reference_stops_on_stop_ids(lm, inputs):
    text, speech, _ = prompt_of(inputs, "sft")
    calls = []

    def sampler(logp, decoded):
        calls.append((logp[EOS_TOKEN].item(), len(decoded)))
        return 6562 if len(decoded) == 4 else 100 + len(decoded)

    assert lm.generate_reference(text, speech, min_len=2, max_len=50, sampler=sampler) == [100, 101, 102, 103]
    assert [c[1] for c in calls] == [0, 1, 2, 3, 4]
    assert all(c[0] == -float("inf") for c in calls[:2]) and all(c[0] > -float("inf") for c in calls[2:])
    assert lm.generate_reference(text, speech, min_len=0, max_len=3, sampler=sampler) == [100, 101, 102]
