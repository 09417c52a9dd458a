"""Random state dicts with the official key names, order and shapes (`llm.pt`, `flow.pt`, `hift.pt`).

Weights come from `torch.Generator(seed)` on CPU: linears/embeddings N(0, 0.02), norms ~1, snake alpha ~1,
weight-norm g = ||v|| so that the folded weight is v; HiFT's convs are fan-in scaled instead (ResBlock
branches smaller). Biases set from the preset: the LM's EOS logit is raised, the flow's mels sit near
`mel_mean`, the F0 predictor outputs ~`f0_hz` and HiFT's log-magnitude channels start at log(`magnitude`).
"""
from __future__ import annotations

import math

import numpy as np
import torch

from async_cosyvoice.models.dims import (
    EOS2_TOKEN as SPEECH_EOS2, EOS_TOKEN as SPEECH_EOS, DiTFlowDims, EncoderDims, EstimatorDims, FlowDims,
    HiFTDims, LMDims,
)

from .presets import Preset

# A spec is (key, shape, init); init kinds: ("normal", std) | ("norm_w",) | ("norm_b",) | ("alpha",) |
# ("const", mean, std) | ("const_split", n_rows, value, std) | ("wn_g", v_key) | ("tied", other_key) |
# ("rotary", dim_head): the DiT's inv_freq buffer (fixed values, saved in flow.pt)
Spec = tuple[str, tuple[int, ...], tuple]
STD = 0.02
HIFT_GAIN = 1.0
HIFT_RES_GAIN = 0.3  # residual branches of the ResBlocks start small
HIFT_POST_GAIN = 0.5  # log-magnitude and phase channels vary by ~1 around their bias


def _linear(prefix: str, out_f: int, in_f: int, bias: bool = True, std: float = STD) -> list[Spec]:
    specs = [(f"{prefix}.weight", (out_f, in_f), ("normal", std))]
    return specs + ([(f"{prefix}.bias", (out_f,), ("normal", STD))] if bias else [])


def _conv(prefix: str, out_c: int, in_c: int, k: int, std: float = STD) -> list[Spec]:
    return [(f"{prefix}.weight", (out_c, in_c, k), ("normal", std)), (f"{prefix}.bias", (out_c,), ("normal", STD))]


def _norm(prefix: str, n: int, bias: bool = True) -> list[Spec]:
    return [(f"{prefix}.weight", (n,), ("norm_w",))] + ([(f"{prefix}.bias", (n,), ("norm_b",))] if bias else [])


def llm_specs(lm: LMDims) -> list[Spec]:
    """llm.pt of Qwen2LM, or of CosyVoice3LM (`lm.kind`: no llm_embedding, 6561 + 200 speech rows,
    llm_decoder without bias)."""
    q = lm.qwen
    h, kv = q.hidden_size, q.num_kv_heads * q.head_dim
    v3 = lm.kind == "cosyvoice3"
    specs: list[Spec] = [] if v3 else [("llm_embedding.weight", (2, lm.llm_input_size), ("normal", STD))]
    specs += [("llm.model.model.embed_tokens.weight", (q.vocab_size, h), ("normal", STD))]
    for i in range(q.num_layers):
        p = f"llm.model.model.layers.{i}"
        specs += _linear(f"{p}.self_attn.q_proj", h, h)
        specs += _linear(f"{p}.self_attn.k_proj", kv, h)
        specs += _linear(f"{p}.self_attn.v_proj", kv, h)
        specs += _linear(f"{p}.self_attn.o_proj", h, h, bias=False)
        specs += _linear(f"{p}.mlp.gate_proj", q.intermediate_size, h, bias=False)
        specs += _linear(f"{p}.mlp.up_proj", q.intermediate_size, h, bias=False)
        specs += _linear(f"{p}.mlp.down_proj", h, q.intermediate_size, bias=False)
        specs += _norm(f"{p}.input_layernorm", h, bias=False)
        specs += _norm(f"{p}.post_attention_layernorm", h, bias=False)
    specs += _norm("llm.model.model.norm", h, bias=False)
    specs += [("llm.model.lm_head.weight", (q.vocab_size, h), ("tied", "llm.model.model.embed_tokens.weight"))]
    vocab = lm.ids.vocab
    specs += _linear("llm_decoder", vocab, lm.llm_output_size, bias=not v3)
    specs += [("speech_embedding.weight", (vocab, lm.llm_input_size), ("normal", STD))]
    return specs


def _conformer_layer(p: str, e: EncoderDims) -> list[Spec]:
    d, heads = e.output_size, e.attention_heads
    specs: list[Spec] = [(f"{p}.self_attn.pos_bias_u", (heads, d // heads), ("normal", STD)),
                         (f"{p}.self_attn.pos_bias_v", (heads, d // heads), ("normal", STD))]
    for name in ("linear_q", "linear_k", "linear_v", "linear_out"):
        specs += _linear(f"{p}.self_attn.{name}", d, d)
    specs += _linear(f"{p}.self_attn.linear_pos", d, d, bias=False)
    specs += _linear(f"{p}.feed_forward.w_1", e.linear_units, d)
    specs += _linear(f"{p}.feed_forward.w_2", d, e.linear_units)
    return specs + _norm(f"{p}.norm_ff", d) + _norm(f"{p}.norm_mha", d)


def _resnet(p: str, in_c: int, out_c: int, t_dim: int) -> list[Spec]:
    return (_linear(f"{p}.mlp.1", out_c, t_dim)
            + _conv(f"{p}.block1.block.0", out_c, in_c, 3) + _norm(f"{p}.block1.block.2", out_c)
            + _conv(f"{p}.block2.block.0", out_c, out_c, 3) + _norm(f"{p}.block2.block.2", out_c)
            + _conv(f"{p}.res_conv", out_c, in_c, 1))


def _transformer(p: str, ch: int, est: EstimatorDims) -> list[Spec]:
    inner = est.num_heads * est.attention_head_dim
    return (_norm(f"{p}.norm1", ch)
            + _linear(f"{p}.attn1.to_q", inner, ch, bias=False)
            + _linear(f"{p}.attn1.to_k", inner, ch, bias=False)
            + _linear(f"{p}.attn1.to_v", inner, ch, bias=False)
            + _linear(f"{p}.attn1.to_out.0", ch, inner)
            + _norm(f"{p}.norm3", ch)
            + _linear(f"{p}.ff.net.0.proj", 4 * ch, ch)
            + _linear(f"{p}.ff.net.2", ch, 4 * ch))


def flow_specs(f: FlowDims, mel_mean: float = 0.0) -> list[Spec]:
    e, est = f.encoder, f.estimator
    specs: list[Spec] = [("input_embedding.weight", (f.vocab_size, f.input_size), ("normal", STD))]
    specs += _linear("spk_embed_affine_layer", f.output_size, f.spk_embed_dim)
    specs += _linear("encoder.embed.out.0", e.output_size, e.input_size)
    specs += _norm("encoder.embed.out.1", e.output_size)
    specs += _norm("encoder.after_norm", e.output_size)
    specs += _conv("encoder.pre_lookahead_layer.conv1", e.output_size, e.output_size, e.pre_lookahead_len + 1)
    specs += _conv("encoder.pre_lookahead_layer.conv2", e.output_size, e.output_size, 3)
    for i in range(e.num_blocks):
        specs += _conformer_layer(f"encoder.encoders.{i}", e)
    specs += _conv("encoder.up_layer.conv", e.output_size, e.output_size, 2 * e.upsample_stride + 1)
    specs += _linear("encoder.up_embed.out.0", e.output_size, e.input_size)
    specs += _norm("encoder.up_embed.out.1", e.output_size)
    for i in range(e.num_up_blocks):
        specs += _conformer_layer(f"encoder.up_encoders.{i}", e)
    specs += _linear("encoder_proj", f.output_size, e.output_size)

    p = "decoder.estimator"
    t_dim = est.channels[0] * 4
    specs += _linear(f"{p}.time_mlp.linear_1", t_dim, est.in_channels) + _linear(f"{p}.time_mlp.linear_2", t_dim, t_dim)
    out_c = est.in_channels
    for i, ch in enumerate(est.channels):
        in_c, out_c = out_c, ch
        specs += _resnet(f"{p}.down_blocks.{i}.0", in_c, out_c, t_dim)
        for j in range(est.n_blocks):
            specs += _transformer(f"{p}.down_blocks.{i}.1.{j}", out_c, est)
        last = i == len(est.channels) - 1
        specs += _conv(f"{p}.down_blocks.{i}.2" + ("" if last else ".conv"), out_c, out_c, 3)
    for i in range(est.num_mid_blocks):
        specs += _resnet(f"{p}.mid_blocks.{i}.0", est.channels[-1], est.channels[-1], t_dim)
        for j in range(est.n_blocks):
            specs += _transformer(f"{p}.mid_blocks.{i}.1.{j}", est.channels[-1], est)
    up = tuple(est.channels[::-1]) + (est.channels[0],)
    for i in range(len(up) - 1):
        in_c, out_c = up[i] * 2, up[i + 1]
        specs += _resnet(f"{p}.up_blocks.{i}.0", in_c, out_c, t_dim)
        for j in range(est.n_blocks):
            specs += _transformer(f"{p}.up_blocks.{i}.1.{j}", out_c, est)
        last = i == len(up) - 2
        specs += _conv(f"{p}.up_blocks.{i}.2" + ("" if last else ".conv"), out_c, out_c, 3 if last else 4)
    specs += _conv(f"{p}.final_block.block.0", up[-1], up[-1], 3) + _norm(f"{p}.final_block.block.2", up[-1])
    specs += _conv(f"{p}.final_proj", est.out_channels, up[-1], 1)
    # the estimator's velocity starts at `mel_mean`, so the ODE carries N(0, 1) noise to mels at that level
    specs[-1] = (specs[-1][0], specs[-1][1], ("const", mel_mean, STD))
    return specs


def dit_flow_specs(f: DiTFlowDims, mel_mean: float = 0.0) -> list[Spec]:
    """CosyVoice3's flow.pt (CausalMaskedDiffWithDiT): no encoder, a DiT estimator."""
    est, d = f.estimator, f.estimator.dim
    inner, p = est.heads * est.dim_head, "decoder.estimator"
    specs: list[Spec] = [("input_embedding.weight", (f.vocab_size, f.input_size), ("normal", STD))]
    specs += _linear("spk_embed_affine_layer", f.output_size, f.spk_embed_dim)
    specs += _conv("pre_lookahead_layer.conv1", f.lookahead_channels, f.input_size, f.pre_lookahead_len + 1)
    specs += _conv("pre_lookahead_layer.conv2", f.input_size, f.lookahead_channels, 3)
    specs += _linear(f"{p}.time_embed.time_mlp.0", d, 256) + _linear(f"{p}.time_embed.time_mlp.2", d, d)
    specs += _linear(f"{p}.input_embed.proj", d, 2 * est.mel_dim + est.mu_dim + est.spk_dim)
    for conv in ("conv1", "conv2"):  # grouped (16 groups), kernel 31
        specs += _conv(f"{p}.input_embed.conv_pos_embed.{conv}.0", d, d // 16, 31)
    specs.append((f"{p}.rotary_embed.inv_freq", (est.dim_head // 2,), ("rotary", est.dim_head)))
    for i in range(est.depth):
        b = f"{p}.transformer_blocks.{i}"
        specs += _linear(f"{b}.attn_norm.linear", 6 * d, d)
        for name in ("to_q", "to_k", "to_v"):
            specs += _linear(f"{b}.attn.{name}", inner, d)
        specs += _linear(f"{b}.attn.to_out.0", d, inner)
        specs += _linear(f"{b}.ff.ff.0.0", est.ff_mult * d, d) + _linear(f"{b}.ff.ff.2", d, est.ff_mult * d)
    if est.long_skip_connection:
        specs += _linear(f"{p}.long_skip_connection", d, 2 * d, bias=False)
    specs += _linear(f"{p}.norm_out.linear", 2 * d, d)
    specs += _linear(f"{p}.proj_out", est.mel_dim, d)
    # the velocity starts at `mel_mean`, so the ODE carries N(0, 1) noise to mels at that level
    specs[-1] = (specs[-1][0], specs[-1][1], ("const", mel_mean, STD))
    return specs


def _wn(prefix: str, g_rows: int, v_shape: tuple[int, ...], bias_c: int, std: float | None = None,
        bias_init: tuple = ("normal", STD)) -> list[Spec]:
    """A weight-normed conv as upstream saves it: bias, then g (original0), then v (original1).
    v ~ N(0, std), by default 1/sqrt(fan_in) so the vocoder's signal keeps its scale layer to layer."""
    std = HIFT_GAIN / math.sqrt(v_shape[1] * v_shape[2]) if std is None else std
    v_key = f"{prefix}.parametrizations.weight.original1"
    return [(f"{prefix}.bias", (bias_c,), bias_init),
            (f"{prefix}.parametrizations.weight.original0", (g_rows, 1, 1), ("wn_g", v_key)),
            (v_key, v_shape, ("normal", std))]


def _hift_resblock(p: str, ch: int, k: int, dilations: tuple[int, ...]) -> list[Spec]:
    specs: list[Spec] = []
    for name in ("convs1", "convs2"):
        for j in range(len(dilations)):
            specs += _wn(f"{p}.{name}.{j}", ch, (ch, ch, k), ch, std=HIFT_RES_GAIN / math.sqrt(ch * k))
    for name in ("activations1", "activations2"):
        for j in range(len(dilations)):
            specs.append((f"{p}.{name}.{j}.alpha", (ch,), ("alpha",)))
    return specs


def hift_specs(h: HiFTDims, f0_hz: float = 150.0, magnitude: float = 0.05) -> list[Spec]:
    """hift.pt of HiFTGenerator, or of CosyVoice3's CausalHiFTGenerator (`h.causal`: conv_pre of
    kernel conv_pre_look_right + 1, upsampling by repetition + Conv1d, F0 predictor's first kernel 4)."""
    n_bins = h.istft_n_fft // 2 + 1
    specs: list[Spec] = _linear("m_source.l_linear", 1, h.nb_harmonics + 1, std=0.3)
    k_pre = h.conv_pre_look_right + 1 if h.causal else 7
    specs += _wn("conv_pre", h.base_channels, (h.base_channels, h.in_channels, k_pre), h.base_channels)
    for i, (u, k) in enumerate(zip(h.upsample_rates, h.upsample_kernel_sizes)):
        c_in, c_out = h.base_channels // 2 ** i, h.base_channels // 2 ** (i + 1)
        if h.causal:  # Conv1d after repetition: g per output channel
            specs += _wn(f"ups.{i}", c_out, (c_out, c_in, k), c_out, std=HIFT_GAIN / math.sqrt(c_in * k))
        else:  # ConvTranspose1d: g per input channel
            specs += _wn(f"ups.{i}", c_in, (c_in, c_out, k), c_out, std=HIFT_GAIN / math.sqrt(c_in * k / u))
    down_rates = [1, *h.upsample_rates[::-1][:-1]]
    cum = np.cumprod(down_rates).tolist()
    for i, u in enumerate(cum[::-1]):
        ch = h.base_channels // 2 ** (i + 1)
        specs += _conv(f"source_downs.{i}", ch, n_bins * 2, 1 if u == 1 else 2 * u, std=0.1)
    for i, (k, d) in enumerate(zip(h.source_resblock_kernel_sizes, h.source_resblock_dilation_sizes)):
        specs += _hift_resblock(f"source_resblocks.{i}", h.base_channels // 2 ** (i + 1), k, d)
    n_k = len(h.resblock_kernel_sizes)
    for i in range(len(h.upsample_rates)):
        ch = h.base_channels // 2 ** (i + 1)
        for j, (k, d) in enumerate(zip(h.resblock_kernel_sizes, h.resblock_dilation_sizes)):
            specs += _hift_resblock(f"resblocks.{i * n_k + j}", ch, k, d)
    ch_last = h.base_channels // 2 ** len(h.upsample_rates)
    post_bias = ("const_split", n_bins, math.log(magnitude), STD)
    specs += _wn("conv_post", n_bins * 2, (n_bins * 2, ch_last, 7), n_bins * 2, bias_init=post_bias,
                 std=HIFT_POST_GAIN / math.sqrt(ch_last * 7))
    c = h.f0_cond_channels
    for i in range(5):
        c_in = h.f0_in_channels if i == 0 else c
        k = 4 if h.causal and i == 0 else 3  # the causal predictor's first conv looks 3 frames right
        specs += _wn(f"f0_predictor.condnet.{2 * i}", c, (c, c_in, k), c)
    specs += _linear("f0_predictor.classifier", h.f0_num_class, c, std=20.0 / math.sqrt(c))
    specs[-1] = (specs[-1][0], specs[-1][1], ("const", f0_hz, 1.0))
    return specs


def _make_tensor(shape: tuple[int, ...], init: tuple, made: dict[str, torch.Tensor],
                 gen: torch.Generator) -> torch.Tensor:
    kind = init[0]
    if kind == "tied":
        return made[init[1]]
    t = torch.empty(shape, dtype=torch.float32)
    if kind == "normal":
        return t.normal_(0.0, init[1], generator=gen)
    if kind == "norm_w":
        return t.normal_(1.0, STD, generator=gen)
    if kind == "norm_b":
        return t.normal_(0.0, STD, generator=gen)
    if kind == "alpha":
        return t.uniform_(0.8, 1.2, generator=gen)
    if kind == "const":
        return t.normal_(init[1], init[2], generator=gen)
    if kind == "const_split":  # first n rows at `value`, the rest ~0 (HiFT conv_post: log-magnitude | phase)
        t.normal_(0.0, init[3], generator=gen)
        t[: init[1]] += init[2]
        return t
    if kind == "rotary":  # x_transformers' RotaryEmbedding(dim_head).inv_freq
        return 1.0 / 10000.0 ** (torch.arange(0, init[1], 2).float() / init[1])
    if kind == "wn_g":  # g = ||v|| over all dims but 0, so the folded weight equals v
        v = made[init[1]]
        return v.flatten(1).norm(dim=1).reshape(shape).clone()
    raise ValueError(f"unknown init {init}")


def random_state_dict(specs: list[Spec], gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Materialise specs in order (weight-norm g keys are computed after their v)."""
    made: dict[str, torch.Tensor] = {}
    deferred = {s[2][1]: s for s in specs if s[2][0] == "wn_g"}
    for key, shape, init in specs:
        if init[0] == "wn_g":
            continue
        made[key] = _make_tensor(shape, init, made, gen)
        if key in deferred:
            g_key, g_shape, g_init = deferred[key]
            made[g_key] = _make_tensor(g_shape, g_init, made, gen)
    return {key: made[key] for key, _, _ in specs}


def llm_state_dict(preset: Preset, gen: torch.Generator) -> dict[str, torch.Tensor]:
    sd = random_state_dict(llm_specs(preset.dims.lm), gen)
    if preset.dims.lm.kind == "cosyvoice3":
        # no decoder bias to lift EOS with: the special rows (6561..6760) are zeroed, so their
        # logit 0 never reaches RAS's top-25 nucleus (speech logits there are ~+2.5 sigma); a
        # generation then ends at max_len, or where a repetition redraw from the full softmax
        # happens to pick a stop id (CosyVoice3 stops on any of them)
        sd["llm_decoder.weight"][preset.dims.lm.speech_token_size:] = 0
        return sd
    logit_std = STD * math.sqrt(preset.dims.lm.llm_output_size)
    sd["llm_decoder.bias"][SPEECH_EOS] += preset.eos_logit_boost * logit_std
    sd["llm_decoder.bias"][SPEECH_EOS2] -= preset.eos2_logit_drop * logit_std
    return sd
