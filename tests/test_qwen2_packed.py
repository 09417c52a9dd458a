"""The packed q/k/v and gate/up GEMMs of the native Qwen2: the checkpoint's names load strictly and
come back out of `state_dict()` unchanged, and the logits equal an unfused oracle written here
from the separate tensors (HF Qwen2 math: three q/k/v linears, repeat_kv, gate and up apart)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from async_cosyvoice.model_dir import load_state_dict_file, normalize_llm_state_dict
from async_cosyvoice.models.llm import CosyVoice2LM
from async_cosyvoice.models.qwen2 import apply_rope, rope_cos_sin

pytestmark = pytest.mark.usefixtures("_one_thread")

LOGIT_ATOL = 1e-5


def unfused_backbone(sd: dict[str, torch.Tensor], dims, x: torch.Tensor) -> torch.Tensor:
    """A causal pass of the Qwen2 backbone with the checkpoint's separate tensors (`backbone.*`)."""
    B, T, _ = x.shape
    nh, nkv, hd = dims.num_heads, dims.num_kv_heads, dims.head_dim
    cos, sin = rope_cos_sin(torch.arange(T).expand(B, T), hd, dims.rope_theta, x.dtype)

    def norm(h, w):
        f = h.float()
        return w * (f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + dims.rms_norm_eps)).to(h.dtype)

    for i in range(dims.num_layers):
        p = f"backbone.layers.{i}."
        h = norm(x, sd[p + "input_layernorm.weight"])
        q = F.linear(h, sd[p + "self_attn.q_proj.weight"], sd[p + "self_attn.q_proj.bias"]).view(B, T, nh, hd)
        k = F.linear(h, sd[p + "self_attn.k_proj.weight"], sd[p + "self_attn.k_proj.bias"]).view(B, T, nkv, hd)
        v = F.linear(h, sd[p + "self_attn.v_proj.weight"], sd[p + "self_attn.v_proj.bias"]).view(B, T, nkv, hd)
        q, k = apply_rope(q, cos, sin).transpose(1, 2), apply_rope(k, cos, sin).transpose(1, 2)
        k = k.repeat_interleave(nh // nkv, dim=1)
        v = v.transpose(1, 2).repeat_interleave(nh // nkv, dim=1)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, -1)
        x = x + F.linear(a, sd[p + "self_attn.o_proj.weight"])
        h = norm(x, sd[p + "post_attention_layernorm.weight"])
        gate = F.linear(h, sd[p + "mlp.gate_proj.weight"])
        up = F.linear(h, sd[p + "mlp.up_proj.weight"])
        x = x + F.linear(F.silu(gate) * up, sd[p + "mlp.down_proj.weight"])
    return norm(x, sd["backbone.norm.weight"])


@pytest.fixture(scope="module")
def checkpoint(tiny_dir):
    return normalize_llm_state_dict(load_state_dict_file(tiny_dir / "llm.pt", "llm.pt"))


def test_state_dict_keeps_the_checkpoint_names(lm, checkpoint):
    sd = lm.state_dict()
    assert set(sd) == set(checkpoint)
    assert not any("qkv_proj" in k or "gate_up_proj" in k for k in sd)
    for k, v in checkpoint.items():
        assert torch.equal(sd[k], v), k
    # and the packed parameters really are the concatenation, in q, k, v / gate, up order
    attn = lm.backbone.layers[1].self_attn
    parts = [checkpoint[f"backbone.layers.1.self_attn.{n}_proj.weight"] for n in "qkv"]
    assert torch.equal(attn.qkv_proj.weight, torch.cat(parts))
    mlp = lm.backbone.layers[0].mlp
    assert torch.equal(mlp.gate_up_proj.weight, torch.cat([checkpoint["backbone.layers.0.mlp.gate_proj.weight"],
                                                           checkpoint["backbone.layers.0.mlp.up_proj.weight"]]))
    # a state dict round trip into a fresh module
    copy = CosyVoice2LM(lm.dims)
    copy.load_state_dict(sd, strict=True)
    assert all(torch.equal(a, b) for a, b in zip(copy.parameters(), lm.parameters()))


def test_strict_loading_still_names_missing_parts(lm, checkpoint):
    bad = dict(checkpoint)
    del bad["backbone.layers.0.self_attn.k_proj.bias"]
    with pytest.raises(RuntimeError, match="qkv_proj.bias"):
        CosyVoice2LM(lm.dims).load_state_dict(bad, strict=True)


def test_packed_logits_equal_the_unfused_math(lm, checkpoint):
    g = torch.Generator().manual_seed(0)
    speech = torch.randint(0, 6561, (2, 40), generator=g)
    with torch.no_grad():
        x = lm.embed_speech(speech)
        want = lm.logits(unfused_backbone(checkpoint, lm.dims.qwen, x)).log_softmax(-1)
        full = lm.logits(lm.backbone(x)).log_softmax(-1)
        # the cached path: prefill 30, then decode the last 10 one at a time
        cache = lm.new_cache(2, 48)
        slots = torch.tensor([1, 0])
        steps = [lm.backbone(x[:, :30], torch.arange(30).expand(2, 30), cache, slots)]
        for t in range(30, 40):
            steps.append(lm.backbone(x[:, t:t + 1], torch.full((2, 1), t), cache, slots, kv_len=40))
        cached = lm.logits(torch.cat(steps, dim=1)).log_softmax(-1)
    err_full = (full - want).abs().max().item()
    err_cached = (cached - want).abs().max().item()
    print(f"packed vs unfused log-prob max err: full {err_full:.2e}, cached {err_cached:.2e}")
    assert err_full <= LOGIT_ATOL and err_cached <= LOGIT_ATOL
    np.testing.assert_array_equal(full.argmax(-1).numpy(), want.argmax(-1).numpy())
