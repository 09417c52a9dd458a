"""Write a randomly initialised CosyVoice2 model directory in exactly the official format.

    python -m async_cosyvoice.tools.make_random_model --preset tiny --out DIR --seed 0

Files: cosyvoice2.yaml (official tag structure, the preset's dims), llm.pt / flow.pt / hift.pt (official
state-dict keys: tied `llm.model.lm_head.weight`, HiFT weight norm as `parametrizations.weight.original0/1`),
campplus.onnx and speech_tokenizer_v2.onnx stand-ins (official I/O names and shapes), spk2info.pt ({}),
configuration.json (provenance) and CosyVoice-BlankEN/ (Qwen2 config.json plus a byte-level BPE trained
offline on a small built-in corpus; no model.safetensors).

Presets: `tiny` has the dims of the shared `cosyvoice2-tiny` fixture; `cosyvoice2-0.5b` the official dims
(~2.5 GB of fp32 weights, written one file at a time). Weights come from `torch.Generator(seed)` on CPU:
linears/embeddings N(0, 0.02), norms ~1, snake alpha ~1, weight-norm g = ||v|| so that the folded weight
is v; HiFT's convs are fan-in scaled instead (ResBlock branches smaller). Four biases are set so a
demo behaves like a TTS model rather than pure chance: the LM's EOS logit is raised (generation ends
some tokens after min_len), the flow's mels sit near -5 (a natural log-mel level), the F0 predictor
outputs ~150 Hz (voiced source) and HiFT's log-magnitude channels start at log(0.05): the demo speaks
quiet noise (around -40 dBFS), finite and unclipped.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from async_cosyvoice.frontend.tokenizer import (
    COSYVOICE2_SPECIAL_TOKENS, EOS_TOKEN, qwen2_pipeline,
)
from async_cosyvoice.models.dims import (
    EOS_TOKEN as SPEECH_EOS, SPEECH_VOCAB, EncoderDims, EstimatorDims, FlowDims, HiFTDims, LMDims,
    ModelDims, Qwen2Dims,
)

GENERATOR_VERSION = 2
BASE_SPECIALS = (EOS_TOKEN, "<|im_start|>", "<|im_end|>")  # in BlankEN's tokenizer_config.json


@dataclass(frozen=True)
class Preset:
    name: str
    dims: ModelDims
    bpe_vocab: int  # entries of vocab.json; the specials follow
    campplus_hidden: int
    s3tok_hidden: int
    eos_logit_boost: float = 4.0  # in units of the llm_decoder logit std
    f0_hz: float = 150.0  # HiFT F0 predictor output (voiced source)
    magnitude: float = 0.05  # HiFT initial STFT magnitude
    mel_mean: float = -5.0  # level of the flow's mels (a natural log-mel level)


def _tiny_dims() -> ModelDims:
    qwen = Qwen2Dims(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                     vocab_size=1024)
    base = ModelDims()
    return replace(
        base,
        lm=LMDims(qwen=qwen, llm_input_size=64, llm_output_size=64),
        flow=FlowDims(
            encoder=EncoderDims(linear_units=64, num_blocks=1),
            estimator=EstimatorDims(channels=(64,), attention_head_dim=16, n_blocks=1, num_mid_blocks=2,
                                    num_heads=2),
        ),
        hift=HiFTDims(base_channels=32, f0_cond_channels=32),
    )


PRESETS: dict[str, Preset] = {
    "tiny": Preset("tiny", _tiny_dims(), bpe_vocab=1000, campplus_hidden=32, s3tok_hidden=16),
    "cosyvoice2-0.5b": Preset("cosyvoice2-0.5b", ModelDims(), bpe_vocab=1000, campplus_hidden=64,
                              s3tok_hidden=64),
}


# ---------------------------------------------------------------------------------------------------
# Parameter layouts (official key names, order and shapes)
# ---------------------------------------------------------------------------------------------------

# A spec is (key, shape, init); init kinds: ("normal", std) | ("norm_w",) | ("norm_b",) | ("alpha",) |
# ("const", mean, std) | ("const_split", n_rows, value, std) | ("wn_g", v_key) | ("tied", other_key)
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
    q = lm.qwen
    h, kv = q.hidden_size, q.num_kv_heads * q.head_dim
    specs: list[Spec] = [("llm_embedding.weight", (2, lm.llm_input_size), ("normal", STD)),
                         ("llm.model.model.embed_tokens.weight", (q.vocab_size, h), ("normal", STD))]
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
    specs += _linear("llm_decoder", SPEECH_VOCAB, lm.llm_output_size)
    specs += [("speech_embedding.weight", (SPEECH_VOCAB, lm.llm_input_size), ("normal", STD))]
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
    n_bins = h.istft_n_fft // 2 + 1
    specs: list[Spec] = _linear("m_source.l_linear", 1, h.nb_harmonics + 1, std=0.3)
    specs += _wn("conv_pre", h.base_channels, (h.base_channels, h.in_channels, 7), h.base_channels)
    for i, (u, k) in enumerate(zip(h.upsample_rates, h.upsample_kernel_sizes)):
        c_in, c_out = h.base_channels // 2 ** i, h.base_channels // 2 ** (i + 1)
        specs += _wn(f"ups.{i}", c_in, (c_in, c_out, k), c_out,  # ConvTranspose1d: g per input channel
                     std=HIFT_GAIN / math.sqrt(c_in * k / u))
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
        specs += _wn(f"f0_predictor.condnet.{2 * i}", c, (c, c_in, 3), c)
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
    logit_std = STD * math.sqrt(preset.dims.lm.llm_output_size)
    sd["llm_decoder.bias"][SPEECH_EOS] += preset.eos_logit_boost * logit_std
    return sd


# ---------------------------------------------------------------------------------------------------
# cosyvoice2.yaml
# ---------------------------------------------------------------------------------------------------

def _num(x) -> str:
    if x is None:
        return "null"
    if isinstance(x, bool):
        return "True" if x else "False"
    if isinstance(x, float) and x.is_integer() and abs(x) < 1e15:
        return str(int(x))
    return repr(x)


def _list(xs) -> str:
    return "[" + ", ".join(_list(x) if isinstance(x, (list, tuple)) else _num(x) for x in xs) + "]"


def recipe_yaml(d: ModelDims) -> str:
    """A `cosyvoice2.yaml` with the official structure and tags, holding the dims `d`."""
    f, e, est, cfm, h, m = d.flow, d.flow.encoder, d.flow.estimator, d.flow.cfm, d.hift, d.feat

    def ref_or(value, name, expected):
        return f"!ref <{name}>" if value == expected else _num(value)

    def extra(indent: int, values: dict) -> str:
        """Keys upstream hard-codes: written only when they differ from what the parser assumes."""
        return "".join(f"{' ' * indent}{k}: {_num(v)}\n" for k, (v, default) in values.items() if v != default)

    est_chunk = ("!ref <chunk_size> * <token_mel_ratio>"
                 if est.static_chunk_size == d.chunk_size * d.token_mel_ratio else _num(est.static_chunk_size))
    enc0, lm0, cfm0 = EncoderDims(), LMDims(), type(cfm)()
    extra_enc = extra(8, {"num_up_blocks": (e.num_up_blocks, enc0.num_up_blocks),
                          "pre_lookahead_len": (e.pre_lookahead_len, f.pre_lookahead_len),
                          "upsample_stride": (e.upsample_stride, enc0.upsample_stride)})
    lm_extra = extra(4, {"min_token_text_ratio": (d.lm.min_token_text_ratio, lm0.min_token_text_ratio),
                         "max_token_text_ratio": (d.lm.max_token_text_ratio, lm0.max_token_text_ratio)})
    cfm_extra = extra(16, {"n_timesteps": (cfm.n_timesteps, cfm0.n_timesteps),
                           "noise_frames": (cfm.noise_frames, cfm0.noise_frames)})
    return f"""# set random seed, so that you may reproduce your result.
__set_seed1: !apply:random.seed [1986]
__set_seed2: !apply:numpy.random.seed [1986]
__set_seed3: !apply:torch.manual_seed [1986]
__set_seed4: !apply:torch.cuda.manual_seed_all [1986]

# fixed params
sample_rate: {d.sample_rate}
llm_input_size: {d.lm.llm_input_size}
llm_output_size: {d.lm.llm_output_size}
spk_embed_dim: {f.spk_embed_dim}
qwen_pretrain_path: ''
token_frame_rate: {d.token_frame_rate}
token_mel_ratio: {d.token_mel_ratio}

# stream related params
chunk_size: {d.chunk_size} # streaming inference chunk size, in token
num_decoding_left_chunks: -1 # streaming inference flow decoder left chunk size, <0 means use all left chunks

# model params
llm: !new:cosyvoice.llm.llm.Qwen2LM
    llm_input_size: !ref <llm_input_size>
    llm_output_size: !ref <llm_output_size>
    speech_token_size: {d.lm.speech_token_size}
    length_normalized_loss: True
    lsm_weight: 0
    mix_ratio: {_list(d.lm.mix_ratio)}
{lm_extra}    llm: !new:cosyvoice.llm.llm.Qwen2Encoder
        pretrain_path: !ref <qwen_pretrain_path>
    sampling: !name:cosyvoice.utils.common.ras_sampling
        top_p: {_num(d.sampling.top_p)}
        top_k: {d.sampling.top_k}
        win_size: {d.sampling.win_size}
        tau_r: {_num(d.sampling.tau_r)}

flow: !new:cosyvoice.flow.flow.CausalMaskedDiffWithXvec
    input_size: {f.input_size}
    output_size: {f.output_size}
    spk_embed_dim: !ref <spk_embed_dim>
    output_type: 'mel'
    vocab_size: {f.vocab_size}
    input_frame_rate: {ref_or(f.input_frame_rate, "token_frame_rate", d.token_frame_rate)}
    only_mask_loss: True
    token_mel_ratio: {ref_or(f.token_mel_ratio, "token_mel_ratio", d.token_mel_ratio)}
    pre_lookahead_len: {f.pre_lookahead_len}
    encoder: !new:cosyvoice.transformer.upsample_encoder.UpsampleConformerEncoder
        output_size: {e.output_size}
        attention_heads: {e.attention_heads}
        linear_units: {e.linear_units}
        num_blocks: {e.num_blocks}
        dropout_rate: 0.1
        positional_dropout_rate: 0.1
        attention_dropout_rate: 0.1
        normalize_before: True
        input_layer: 'linear'
        pos_enc_layer_type: 'rel_pos_espnet'
        selfattention_layer_type: 'rel_selfattn'
        input_size: {e.input_size}
        use_cnn_module: False
        macaron_style: False
        static_chunk_size: {ref_or(e.static_chunk_size, "chunk_size", d.chunk_size)}
{extra_enc}    decoder: !new:cosyvoice.flow.flow_matching.CausalConditionalCFM
        in_channels: 240
        n_spks: 1
        spk_emb_dim: {f.output_size}
        cfm_params: !new:omegaconf.DictConfig
            content:
                sigma_min: {_num(cfm.sigma_min)}
                solver: 'euler'
                t_scheduler: '{cfm.t_scheduler}'
                training_cfg_rate: 0.2
                inference_cfg_rate: {_num(cfm.inference_cfg_rate)}
                reg_loss_type: 'l1'
{cfm_extra}        estimator: !new:cosyvoice.flow.decoder.CausalConditionalDecoder
            in_channels: {est.in_channels}
            out_channels: {est.out_channels}
            channels: {_list(est.channels)}
            dropout: 0.0
            attention_head_dim: {est.attention_head_dim}
            n_blocks: {est.n_blocks}
            num_mid_blocks: {est.num_mid_blocks}
            num_heads: {est.num_heads}
            act_fn: '{est.act_fn}'
            static_chunk_size: {est_chunk}
            num_decoding_left_chunks: !ref <num_decoding_left_chunks>

hift: !new:cosyvoice.hifigan.generator.HiFTGenerator
    in_channels: {h.in_channels}
    base_channels: {h.base_channels}
    nb_harmonics: {h.nb_harmonics}
    sampling_rate: {ref_or(h.sampling_rate, "sample_rate", d.sample_rate)}
    nsf_alpha: {_num(h.nsf_alpha)}
    nsf_sigma: {_num(h.nsf_sigma)}
    nsf_voiced_threshold: {_num(h.nsf_voiced_threshold)}
    upsample_rates: {_list(h.upsample_rates)}
    upsample_kernel_sizes: {_list(h.upsample_kernel_sizes)}
    istft_params:
        n_fft: {h.istft_n_fft}
        hop_len: {h.istft_hop_len}
    resblock_kernel_sizes: {_list(h.resblock_kernel_sizes)}
    resblock_dilation_sizes: {_list(h.resblock_dilation_sizes)}
    source_resblock_kernel_sizes: {_list(h.source_resblock_kernel_sizes)}
    source_resblock_dilation_sizes: {_list(h.source_resblock_dilation_sizes)}
    lrelu_slope: {_num(h.lrelu_slope)}
    audio_limit: {_num(h.audio_limit)}
    f0_predictor: !new:cosyvoice.hifigan.f0_predictor.ConvRNNF0Predictor
        num_class: {h.f0_num_class}
        in_channels: {h.f0_in_channels}
        cond_channels: {h.f0_cond_channels}

# gan related module
mel_spec_transform1: !name:matcha.utils.audio.mel_spectrogram
    n_fft: {m.n_fft}
    num_mels: {m.num_mels}
    sampling_rate: !ref <sample_rate>
    hop_size: {m.hop_size}
    win_size: {m.win_size}
    fmin: {_num(m.fmin)}
    fmax: null
    center: False
hifigan: !new:cosyvoice.hifigan.hifigan.HiFiGan
    generator: !ref <hift>
    discriminator: !new:cosyvoice.hifigan.discriminator.MultipleDiscriminator
        mpd: !new:matcha.hifigan.models.MultiPeriodDiscriminator
        mrd: !new:cosyvoice.hifigan.discriminator.MultiResSpecDiscriminator
    mel_spec_transform: [
        !ref <mel_spec_transform1>
    ]

# processor functions
parquet_opener: !name:cosyvoice.dataset.processor.parquet_opener
get_tokenizer: !name:cosyvoice.tokenizer.tokenizer.get_qwen_tokenizer
    token_path: !ref <qwen_pretrain_path>
    skip_special_tokens: True
allowed_special: 'all'
tokenize: !name:cosyvoice.dataset.processor.tokenize
    get_tokenizer: !ref <get_tokenizer>
    allowed_special: !ref <allowed_special>
filter: !name:cosyvoice.dataset.processor.filter
    max_length: 6000
    min_length: 100
    token_max_length: 200
    token_min_length: 1
resample: !name:cosyvoice.dataset.processor.resample
    resample_rate: !ref <sample_rate>
truncate: !name:cosyvoice.dataset.processor.truncate
    truncate_length: 24480 # must be a multiplier of hop_size
feat_extractor: !name:matcha.utils.audio.mel_spectrogram
    n_fft: {m.n_fft}
    num_mels: {m.num_mels}
    sampling_rate: {ref_or(m.sampling_rate, "sample_rate", d.sample_rate)}
    hop_size: {m.hop_size}
    win_size: {m.win_size}
    fmin: {_num(m.fmin)}
    fmax: {_num(m.fmax)}
    center: {_num(m.center)}
compute_fbank: !name:cosyvoice.dataset.processor.compute_fbank
    feat_extractor: !ref <feat_extractor>
    num_frames: 960
compute_whisper_fbank: !name:cosyvoice.dataset.processor.compute_whisper_fbank
    num_frames: 960
compute_f0: !name:cosyvoice.dataset.processor.compute_f0
    sample_rate: !ref <sample_rate>
    hop_size: {m.hop_size}
parse_embedding: !name:cosyvoice.dataset.processor.parse_embedding
    normalize: True
shuffle: !name:cosyvoice.dataset.processor.shuffle
    shuffle_size: 1000
sort: !name:cosyvoice.dataset.processor.sort
    sort_size: 500  # sort_size should be less than shuffle_size
batch: !name:cosyvoice.dataset.processor.batch
    batch_type: 'dynamic'
    max_frames_in_batch: 2000
padding: !name:cosyvoice.dataset.processor.padding
    use_spk_embedding: False # change to True during sft

# dataset processor pipeline
data_pipeline: [
    !ref <parquet_opener>,
    !ref <tokenize>,
    !ref <filter>,
    !ref <resample>,
    !ref <compute_fbank>,
    !ref <parse_embedding>,
    !ref <compute_whisper_fbank>,
    !ref <shuffle>,
    !ref <sort>,
    !ref <batch>,
    !ref <padding>,
]
data_pipeline_gan: [
    !ref <parquet_opener>,
    !ref <tokenize>,
    !ref <filter>,
    !ref <resample>,
    !ref <truncate>,
    !ref <compute_fbank>,
    !ref <compute_f0>,
    !ref <parse_embedding>,
    !ref <shuffle>,
    !ref <sort>,
    !ref <batch>,
    !ref <padding>,
]

# llm flow train conf
train_conf:
    optim: adam
    optim_conf:
        lr: 1e-5 # change to 1e-5 during sft
    scheduler: constantlr # change to constantlr during sft
    scheduler_conf:
        warmup_steps: 2500
    max_epoch: 200
    grad_clip: 5
    accum_grad: 2
    log_interval: 100
    save_per_step: -1

# gan train conf
train_conf_gan:
    optim: adam
    optim_conf:
        lr: 0.0002 # use small lr for gan training
    scheduler: constantlr
    optim_d: adam
    optim_conf_d:
        lr: 0.0002 # use small lr for gan training
    scheduler_d: constantlr
    max_epoch: 200
    grad_clip: 5
    accum_grad: 1 # in gan training, accum_grad must be 1
    log_interval: 100
    save_per_step: -1
"""


# ---------------------------------------------------------------------------------------------------
# CosyVoice-BlankEN: Qwen2 config + a byte-level BPE trained offline
# ---------------------------------------------------------------------------------------------------

_CORPUS_EN = """\
The morning train was late again, so I walked along the river and listened to the birds.
Hello! This small voice model was built only for testing, and it should sound like noise.
A quick brown fox jumps over the lazy dog while the quiet cat watches from the window.
Please call Stella and ask her to bring these things with her from the store: six spoons of fresh
snow peas, five thick slabs of blue cheese, and maybe a snack for her brother Bob.
We also need a small plastic snake and a big toy frog for the kids.
When the sunlight strikes raindrops in the air, they act as a prism and form a rainbow.
The rainbow is a division of white light into many beautiful colors.
Streaming speech synthesis returns audio in small chunks, so the listener hears the first words
almost immediately, long before the whole sentence has been generated.
Numbers such as 1, 2, 3, 42, 100, 2024 and 3.14159 appear in weather reports, prices and dates.
It costs $12.50 today; yesterday it was 15% cheaper. Call me at 555-0123 before 9:30 pm!
Doctor Smith said: "Rest, drink water, and don't worry." She's right, isn't she? We'll see.
Why do people whisper in libraries? Because loud voices disturb everyone who is reading quietly.
Engineers measure latency, throughput, real-time factor and memory usage for every release.
The server accepts requests over gRPC, schedules them in batches and streams the results back.
Yesterday, my neighbour planted tomatoes, carrots, onions, potatoes, beans and strawberries.
Music, mathematics, history, geography, chemistry, physics, biology and literature are subjects.
Monday Tuesday Wednesday Thursday Friday Saturday Sunday January February March April May June
July August September October November December spring summer autumn winter north south east west
zero one two three four five six seven eight nine ten eleven twelve twenty thirty hundred thousand
I think, therefore I am. To be, or not to be: that is the question. All's well that ends well.
Could you speak a little more slowly, please? Of course, I would be happy to help you with that.
The children laughed [laughter] and then took a deep breath [breath] before singing again.
"""

_CORPUS_ZH = """\
今天的天气很好，我们一起去公园散步吧。
在他讲述那个故事的时候，他突然停了下来。
用四川话说这句话。希望你以后能够做得比我还好哟。
收到好友从远方寄来的生日礼物，那份意外的惊喜与深深的祝福让我心中充满了甜蜜的快乐。
八百标兵奔北坡，炮兵并排北边跑。吃葡萄不吐葡萄皮，不吃葡萄倒吐葡萄皮。
语音合成系统把文字转换成自然流畅的声音，流式输出可以降低首包延迟。
春天来了，花儿开了，小鸟在树上唱歌，孩子们在草地上奔跑。
请问去火车站怎么走？一直往前走，到第二个路口向右转就到了。
这件外套原价两百九十九元，现在打八折，只要两百三十九元。
中国的首都是北京，上海是一个国际化的大城市，广州和深圳在南方。
他每天早上七点起床，先喝一杯水，然后跑步半个小时。
学习一门新的语言需要耐心，多听多说多读多写，进步就会很快。
"""


def _training_corpus() -> list[str]:
    lines = [ln for ln in (_CORPUS_EN + _CORPUS_ZH).splitlines() if ln.strip()]
    return lines * 3


def train_bpe(vocab_size: int):
    """A Qwen2-style byte-level BPE (no specials) trained on the built-in corpus; deterministic."""
    from tokenizers import pre_tokenizers, trainers
    from tokenizers.models import BPE

    tok = qwen2_pipeline(BPE(unk_token=None, continuing_subword_prefix="", end_of_word_suffix="",
                             fuse_unk=False, byte_fallback=False))
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=1, show_progress=False,
                                  special_tokens=[], initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_training_corpus(), trainer=trainer)
    return tok


def write_blank_en(out: Path, preset: Preset) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tok = train_bpe(preset.bpe_vocab)
    n_bpe = tok.get_vocab_size(with_added_tokens=False)
    vocab = tok.get_vocab(with_added_tokens=False)
    assert sorted(vocab.values()) == list(range(n_bpe)), "BPE ids are not contiguous"
    q = preset.dims.lm.qwen
    if q.vocab_size < n_bpe + len(BASE_SPECIALS) + len(COSYVOICE2_SPECIAL_TOKENS) - 1:
        raise ValueError(f"preset {preset.name}: config vocab_size {q.vocab_size} < tokenizer length")
    (out / "vocab.json").write_text(
        json.dumps(dict(sorted(vocab.items(), key=lambda kv: kv[1])), ensure_ascii=False, separators=(",", ":")),
        encoding="utf-8")
    model = json.loads(tok.to_str())["model"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    (out / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n", encoding="utf-8")
    eos_id = n_bpe
    special = {"lstrip": False, "normalized": False, "rstrip": False, "single_word": False, "special": True}
    tokenizer_config = {
        "add_prefix_space": False,
        "added_tokens_decoder": {str(n_bpe + i): {"content": t, **special} for i, t in enumerate(BASE_SPECIALS)},
        "additional_special_tokens": list(BASE_SPECIALS[1:]),
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        "eos_token": EOS_TOKEN,
        "errors": "replace",
        "model_max_length": q.max_position_embeddings,
        "pad_token": EOS_TOKEN,
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
    config = {
        "architectures": ["Qwen2ForCausalLM"],
        "attention_dropout": 0.0,
        "bos_token_id": eos_id,
        "eos_token_id": eos_id,
        "hidden_act": "silu",
        "hidden_size": q.hidden_size,
        "initializer_range": STD,
        "intermediate_size": q.intermediate_size,
        "max_position_embeddings": q.max_position_embeddings,
        "max_window_layers": q.num_layers,
        "model_type": "qwen2",
        "num_attention_heads": q.num_heads,
        "num_hidden_layers": q.num_layers,
        "num_key_value_heads": q.num_kv_heads,
        "rms_norm_eps": q.rms_norm_eps,
        "rope_theta": q.rope_theta,
        "sliding_window": q.max_position_embeddings,
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": q.vocab_size,
    }
    generation_config = {"bos_token_id": eos_id, "do_sample": False, "eos_token_id": eos_id, "max_new_tokens": 2048}
    for name, obj in (("tokenizer_config.json", tokenizer_config), ("config.json", config),
                      ("generation_config.json", generation_config)):
        (out / name).write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


# ---------------------------------------------------------------------------------------------------
# ONNX stand-ins
# ---------------------------------------------------------------------------------------------------

ONNX_OPSET = 17
ONNX_IR_VERSION = 8  # loadable by onnxruntime >= 1.14


def _np(shape, std: float, gen: torch.Generator) -> np.ndarray:
    return torch.empty(shape).normal_(0.0, std, generator=gen).numpy().astype(np.float32)


def _save_onnx(graph, path: Path) -> None:
    import onnx
    from onnx import helper
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", ONNX_OPSET)],
                              producer_name="async_cosyvoice.make_random_model")
    model.ir_version = ONNX_IR_VERSION
    onnx.checker.check_model(model)
    onnx.save(model, str(path))


def write_campplus_onnx(path: Path, hidden: int, gen: torch.Generator, n_mels: int = 80, emb: int = 192) -> None:
    """`input` (B, T, 80) float -> `output` (B, 192): frame MLP + mean/std pooling + projection."""
    from onnx import TensorProto, helper, numpy_helper as nh
    w1, b1 = _np((n_mels, hidden), 1.0 / math.sqrt(n_mels), gen), _np((hidden,), 0.1, gen)
    w2, b2 = _np((2 * hidden, emb), 1.0 / math.sqrt(2 * hidden), gen), _np((emb,), 0.1, gen)
    inits = [nh.from_array(w1, "w1"), nh.from_array(b1, "b1"), nh.from_array(w2, "w2"),
             nh.from_array(b2, "b2"), nh.from_array(np.array(1e-5, np.float32), "eps")]
    nodes = [
        helper.make_node("MatMul", ["input", "w1"], ["h0"]),
        helper.make_node("Add", ["h0", "b1"], ["h1"]),
        helper.make_node("Tanh", ["h1"], ["h"]),
        helper.make_node("ReduceMean", ["h"], ["mean_k"], axes=[1], keepdims=1),
        helper.make_node("Sub", ["h", "mean_k"], ["centered"]),
        helper.make_node("Mul", ["centered", "centered"], ["sq"]),
        helper.make_node("ReduceMean", ["sq"], ["var"], axes=[1], keepdims=0),
        helper.make_node("Add", ["var", "eps"], ["var_eps"]),
        helper.make_node("Sqrt", ["var_eps"], ["std"]),
        helper.make_node("ReduceMean", ["h"], ["mean"], axes=[1], keepdims=0),
        helper.make_node("Concat", ["mean", "std"], ["stats"], axis=1),
        helper.make_node("Gemm", ["stats", "w2", "b2"], ["output"]),
    ]
    graph = helper.make_graph(
        nodes, "campplus_standin",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["B", "T", n_mels])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, ["B", emb])], inits)
    _save_onnx(graph, path)


def write_speech_tokenizer_onnx(path: Path, hidden: int, gen: torch.Generator, n_mels: int = 128,
                                fsq_dims: int = 8) -> None:
    """`feats` (B, 128, T) float + `feats_length` (B,) int32 -> `indices` (B, T_tok) int32, T_tok as two
    stride-2 k3 convs give; codes = sum_i (round(0.999 * tanh(z_i)) + 1) * 3^i over 8 dims (0..6560)."""
    from onnx import TensorProto, helper, numpy_helper as nh
    w1, b1 = _np((hidden, n_mels, 3), 1.0 / math.sqrt(3 * n_mels), gen), _np((hidden,), 0.1, gen)
    w2, b2 = _np((fsq_dims, hidden, 3), 3.0 / math.sqrt(3 * hidden), gen), _np((fsq_dims,), 0.1, gen)
    powers = (3.0 ** np.arange(fsq_dims, dtype=np.float32)).reshape(1, fsq_dims, 1)
    inits = [nh.from_array(w1, "w1"), nh.from_array(b1, "b1"), nh.from_array(w2, "w2"), nh.from_array(b2, "b2"),
             nh.from_array(powers, "powers"),
             nh.from_array(np.array(0, np.int64), "zero"), nh.from_array(np.array(1, np.int64), "one"),
             nh.from_array(np.array(2, np.int64), "two"), nh.from_array(np.array([0], np.int64), "ax0"),
             nh.from_array(np.array([1], np.int64), "ax1"),
             nh.from_array(np.array(0.999, np.float32), "scale"), nh.from_array(np.array(1.0, np.float32), "fone")]
    nodes = [
        # zero the frames past feats_length
        helper.make_node("Shape", ["feats"], ["shape"]),
        helper.make_node("Gather", ["shape", "two"], ["t_len"], axis=0),
        helper.make_node("Range", ["zero", "t_len", "one"], ["frames"]),
        helper.make_node("Unsqueeze", ["frames", "ax0"], ["frames_row"]),
        helper.make_node("Cast", ["feats_length"], ["len64"], to=TensorProto.INT64),
        helper.make_node("Unsqueeze", ["len64", "ax1"], ["len_col"]),
        helper.make_node("Less", ["frames_row", "len_col"], ["valid"]),
        helper.make_node("Cast", ["valid"], ["valid_f"], to=TensorProto.FLOAT),
        helper.make_node("Unsqueeze", ["valid_f", "ax1"], ["mask"]),
        helper.make_node("Mul", ["feats", "mask"], ["x"]),
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], kernel_shape=[3], strides=[2], pads=[1, 1]),
        helper.make_node("Tanh", ["c1"], ["a1"]),
        helper.make_node("Conv", ["a1", "w2", "b2"], ["z"], kernel_shape=[3], strides=[2], pads=[1, 1]),
        helper.make_node("Tanh", ["z"], ["tz"]),
        helper.make_node("Mul", ["tz", "scale"], ["sz"]),
        helper.make_node("Round", ["sz"], ["rz"]),
        helper.make_node("Add", ["rz", "fone"], ["digits"]),
        helper.make_node("Mul", ["digits", "powers"], ["weighted"]),
        helper.make_node("ReduceSum", ["weighted", "ax1"], ["code_f"], keepdims=0),
        helper.make_node("Cast", ["code_f"], ["indices"], to=TensorProto.INT32),
    ]
    graph = helper.make_graph(
        nodes, "speech_tokenizer_v2_standin",
        [helper.make_tensor_value_info("feats", TensorProto.FLOAT, ["B", n_mels, "T"]),
         helper.make_tensor_value_info("feats_length", TensorProto.INT32, ["B"])],
        [helper.make_tensor_value_info("indices", TensorProto.INT32, ["B", "T_tok"])], inits)
    _save_onnx(graph, path)


# ---------------------------------------------------------------------------------------------------
# The directory
# ---------------------------------------------------------------------------------------------------

def _provenance(preset: Preset, seed: int) -> dict:
    return {"framework": "Pytorch", "task": "text-to-speech",
            "random_model": {"preset": preset.name, "seed": seed, "generator_version": GENERATOR_VERSION}}


def _written_by_us(out: Path) -> dict | None:
    try:
        info = json.loads((out / "configuration.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    rm = info.get("random_model") if isinstance(info, dict) else None
    return rm if isinstance(rm, dict) else None


def is_random_model(out: str | Path, preset: str, seed: int) -> bool:
    """True when `out` is a complete directory written by this version of the tool for (preset, seed)."""
    return _written_by_us(Path(out)) == _provenance(PRESETS[preset], seed)["random_model"]


def _write(tmp: Path, preset: Preset, seed: int) -> None:
    d = preset.dims
    gen = torch.Generator().manual_seed(seed)
    (tmp / "cosyvoice2.yaml").write_text(recipe_yaml(d), encoding="utf-8")
    write_blank_en(tmp / "CosyVoice-BlankEN", preset)
    sd = llm_state_dict(preset, gen)
    torch.save(sd, tmp / "llm.pt")
    del sd
    sd = random_state_dict(flow_specs(d.flow, preset.mel_mean), gen)
    torch.save(sd, tmp / "flow.pt")
    del sd
    torch.save(random_state_dict(hift_specs(d.hift, preset.f0_hz, preset.magnitude), gen), tmp / "hift.pt")
    write_campplus_onnx(tmp / "campplus.onnx", preset.campplus_hidden, gen)
    write_speech_tokenizer_onnx(tmp / "speech_tokenizer_v2.onnx", preset.s3tok_hidden, gen)
    torch.save({}, tmp / "spk2info.pt")
    (tmp / "configuration.json").write_text(json.dumps(_provenance(preset, seed), indent=2) + "\n", encoding="utf-8")


def make_random_model(preset: str, out: str | Path, seed: int = 0, overwrite: bool = False) -> Path:
    """Write a random official-format CosyVoice2 directory to `out` and return its path.

    The directory is built next to `out` and renamed into place, so a concurrent reader never sees a
    partial one. If `out` already holds this (preset, seed) it is reused unless `overwrite`; one written
    for the same (preset, seed) by an older version of this tool is regenerated; any other existing
    `out` raises FileExistsError unless `overwrite`."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {sorted(PRESETS)}")
    out = Path(out).expanduser().resolve()
    if out.exists() and not overwrite:
        if is_random_model(out, preset, seed):
            return out
        ours = _written_by_us(out)
        if not (ours and ours.get("preset") == preset and ours.get("seed") == seed):
            raise FileExistsError(f"{out} exists and is not a {preset}/seed {seed} random model (pass overwrite)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        _write(tmp, PRESETS[preset], seed)
        os.chmod(tmp, 0o755)
        if out.exists():
            if not overwrite and is_random_model(out, preset, seed):  # a concurrent writer finished first
                shutil.rmtree(tmp, ignore_errors=True)
                return out
            shutil.rmtree(out)
        try:
            tmp.rename(out)
        except OSError:
            if is_random_model(out, preset, seed) and not overwrite:  # a concurrent writer won the race
                shutil.rmtree(tmp, ignore_errors=True)
                return out
            raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m async_cosyvoice.tools.make_random_model",
                                 description="Write a randomly initialised CosyVoice2 model directory "
                                             "in the official format.")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    ap.add_argument("--out", required=True, type=Path, help="directory to create")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--overwrite", action="store_true", help="replace an existing directory")
    args = ap.parse_args(argv)
    try:
        path = make_random_model(args.preset, args.out, args.seed, overwrite=args.overwrite)
    except (FileExistsError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
