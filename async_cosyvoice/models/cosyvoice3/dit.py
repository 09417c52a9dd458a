"""DiT: CosyVoice3's flow-matching vector field v(x, t | mu, spks, cond) (cosyvoice.flow.DiT.dit.DiT).

    t    -> sinusoidal(1000·t, 256) -> Linear, SiLU, Linear                         = c  (B, dim)
    h    = proj([x, cond, mu, spks]) ; h += causal grouped conv position embedding (2 × k31, Mish)
    h    = depth × DiT block:  (shift, scale, gate)·2 = Linear(SiLU(c))
               h += gate_a · Attention(LN(h)·(1 + scale_a) + shift_a)
               h += gate_f · FF(LN(h)·(1 + scale_f) + shift_f)            (FF: GELU-tanh, × ff_mult)
    [h   = Linear([h, h before the blocks]) with long_skip_connection; off in the released model]
    v    = proj_out(LN(h)·(1 + scale) + shift), the final (scale, shift) in that order

Attention has biased q/k/v projections and rotary position embedding on the first `dim_head`
channels of q and k only — head 0 — rotating interleaved pairs (x_transformers' partial rotary).
Keys of padded frames are masked; when streaming, frame i also sees only the chunks of
`static_chunk_size` frames up to its own (counted from frame 0); padded query rows are zeroed.

Everything is causal but attention, so a cached streaming call (models/flow/prefix.py) computes new
frames only: the position convs read their left context from the cursor, attention its keys.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..flow.estimator import timestep_embedding
from ..flow.lookahead import Cache, causal_input
from ..flow.masks import attention_mask
from ..dims import DiTDims

TIME_FREQ_DIM = 256  # hard-coded upstream (TimestepEmbedding's freq_embed_dim)
POS_CONV_KERNEL, POS_CONV_GROUPS = 31, 16  # hard-coded upstream (CausalConvPositionEmbedding)


class TimestepEmbedding(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.time_mlp = nn.Sequential(nn.Linear(TIME_FREQ_DIM, dim), nn.SiLU(), nn.Linear(dim, dim))

    def forward(self, t: Tensor) -> Tensor:
        """t (B,) -> (B, dim)."""
        return self.time_mlp(timestep_embedding(t, TIME_FREQ_DIM).to(t.dtype))


class CausalConvPositionEmbedding(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.conv1 = nn.Sequential(nn.Conv1d(dim, dim, POS_CONV_KERNEL, groups=POS_CONV_GROUPS), nn.Mish())
        self.conv2 = nn.Sequential(nn.Conv1d(dim, dim, POS_CONV_KERNEL, groups=POS_CONV_GROUPS), nn.Mish())

    def forward(self, x: Tensor, cache: Cache = None) -> Tensor:
        """x (B, T, dim) -> (B, T, dim); each conv sees the kernel − 1 frames before (zeros at frame 0)."""
        h = x.transpose(1, 2)
        h = self.conv1(causal_input(h, POS_CONV_KERNEL - 1, cache))
        h = self.conv2(causal_input(h, POS_CONV_KERNEL - 1, cache))
        return h.transpose(1, 2)


class InputEmbedding(nn.Module):
    def __init__(self, mel_dim: int, mu_dim: int, spk_dim: int, dim: int):
        super().__init__()
        self.proj = nn.Linear(2 * mel_dim + mu_dim + spk_dim, dim)
        self.conv_pos_embed = CausalConvPositionEmbedding(dim)

    def forward(self, x: Tensor, cond: Tensor, mu: Tensor, spks: Tensor, cache: Cache = None) -> Tensor:
        """x, cond, mu (B, T, 80), spks (B, 80) -> (B, T, dim)."""
        h = self.proj(torch.cat([x, cond, mu, spks.unsqueeze(1).expand(-1, x.size(1), -1)], dim=-1))
        return self.conv_pos_embed(h, cache) + h


class RotaryEmbedding(nn.Module):
    """Angles position · inv_freq, each repeated for the two channels of its pair."""

    def __init__(self, dim_head: int, base: float = 10000.0):
        super().__init__()
        # in flow.pt too; made on the CPU also in a meta-device build (empty_init), where this
        # arithmetic would run torch's Python reference ops
        self.register_buffer("inv_freq", 1.0 / base ** (torch.arange(0, dim_head, 2, device="cpu").float() / dim_head))

    def forward(self, positions: Tensor) -> Tensor:
        """positions (..., T) -> angles (..., T, dim_head) float32: [a0, a0, a1, a1, …]."""
        angles = positions.float().unsqueeze(-1) * self.inv_freq
        return torch.stack([angles, angles], dim=-1).flatten(-2)


def rotate_first_head(x: Tensor, angles: Tensor) -> Tensor:
    """x (B, T, heads·dim_head): rotate channel pairs (2i, 2i+1) of the first dim_head channels by
    angles (B or 1, T, dim_head), in float32 (as x_transformers); the other heads pass through."""
    d = angles.shape[-1]
    head, rest = x[..., :d].float(), x[..., d:]
    even, odd = head[..., 0::2], head[..., 1::2]
    rotated_half = torch.stack([-odd, even], dim=-1).flatten(-2)
    return torch.cat([(head * angles.cos() + rotated_half * angles.sin()).to(x.dtype), rest], dim=-1)


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, dim_head: int):
        super().__init__()
        self.heads = heads
        inner = heads * dim_head
        self.to_q = nn.Linear(dim, inner)
        self.to_k = nn.Linear(dim, inner)
        self.to_v = nn.Linear(dim, inner)
        self.to_out = nn.ModuleList([nn.Linear(inner, dim)])

    def forward(self, x: Tensor, allowed: Tensor, valid: Tensor, angles: Tensor, cache: Cache = None) -> Tensor:
        """x (B, T, dim); allowed (B, T, K) bool (K = T, or a cached call's keys); valid (B, T) query
        frames (the rest are zeroed); angles (B or 1, T, dim_head) of the queries' positions."""
        B, T, _ = x.shape
        q = rotate_first_head(self.to_q(x), angles)
        k = rotate_first_head(self.to_k(x), angles)
        q, k, v = (a.view(B, T, self.heads, -1).transpose(1, 2) for a in (q, k, self.to_v(x)))
        if cache is not None:
            cursor, g = cache
            k, v = cursor.attention(k, v, g)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed.unsqueeze(1))
        out = self.to_out[0](out.transpose(1, 2).reshape(B, T, -1))
        return out * valid.unsqueeze(-1).to(out.dtype)


class AdaLayerNormZero(nn.Module):
    """LayerNorm (no affine, eps 1e-6) modulated by the time embedding; also returns the gates and
    the FF modulation."""

    def __init__(self, dim: int):
        super().__init__()
        self.linear = nn.Linear(dim, 6 * dim)
        self.norm = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)

    def forward(self, x: Tensor, c: Tensor) -> tuple[Tensor, ...]:
        shift_a, scale_a, gate_a, shift_f, scale_f, gate_f = self.linear(F.silu(c)).chunk(6, dim=1)
        return self.norm(x) * (1 + scale_a[:, None]) + shift_a[:, None], gate_a, shift_f, scale_f, gate_f


class AdaLayerNormZeroFinal(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.linear = nn.Linear(dim, 2 * dim)
        self.norm = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)

    def forward(self, x: Tensor, c: Tensor) -> Tensor:
        scale, shift = self.linear(F.silu(c)).chunk(2, dim=1)  # (scale, shift): the blocks' order reversed
        return self.norm(x) * (1 + scale[:, None]) + shift[:, None]


class FeedForward(nn.Module):
    def __init__(self, dim: int, mult: int):
        super().__init__()
        # ff.1 is the (inference-time no-op) dropout of the weight layout
        self.ff = nn.Sequential(nn.Sequential(nn.Linear(dim, mult * dim), nn.GELU(approximate="tanh")),
                                nn.Identity(), nn.Linear(mult * dim, dim))

    def forward(self, x: Tensor) -> Tensor:
        return self.ff(x)


class DiTBlock(nn.Module):
    def __init__(self, dim: int, heads: int, dim_head: int, ff_mult: int):
        super().__init__()
        self.attn_norm = AdaLayerNormZero(dim)
        self.attn = Attention(dim, heads, dim_head)
        self.ff_norm = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.ff = FeedForward(dim, ff_mult)

    def forward(self, x: Tensor, c: Tensor, allowed: Tensor, valid: Tensor, angles: Tensor,
                cache: Cache = None) -> Tensor:
        h, gate_a, shift_f, scale_f, gate_f = self.attn_norm(x, c)
        x = x + gate_a[:, None] * self.attn(h, allowed, valid, angles, cache)
        h = self.ff_norm(x) * (1 + scale_f[:, None]) + shift_f[:, None]
        return x + gate_f[:, None] * self.ff(h)


class DiT(nn.Module):
    # what regional compilation compiles (estimator/regions.py: compile_estimator and the cached slot call)
    repeated_blocks = (DiTBlock,)

    def __init__(self, dims: DiTDims):
        super().__init__()
        if dims.num_decoding_left_chunks >= 0:
            raise ValueError(f"DiT num_decoding_left_chunks={dims.num_decoding_left_chunks}: only -1 (every left "
                             "chunk visible, what upstream ships) is supported")
        if dims.dim % POS_CONV_GROUPS:
            raise ValueError(f"DiT dim={dims.dim} must be a multiple of {POS_CONV_GROUPS} (the position convs' groups)")
        self.dims = dims
        self.time_embed = TimestepEmbedding(dims.dim)
        self.input_embed = InputEmbedding(dims.mel_dim, dims.mu_dim, dims.spk_dim, dims.dim)
        self.rotary_embed = RotaryEmbedding(dims.dim_head)
        self.transformer_blocks = nn.ModuleList(
            DiTBlock(dims.dim, dims.heads, dims.dim_head, dims.ff_mult) for _ in range(dims.depth))
        self.long_skip_connection = nn.Linear(2 * dims.dim, dims.dim, bias=False) if dims.long_skip_connection else None
        self.norm_out = AdaLayerNormZeroFinal(dims.dim)
        self.proj_out = nn.Linear(dims.dim, dims.mel_dim)

    def forward(self, x: Tensor, mask: Tensor, mu: Tensor, t: Tensor, spks: Tensor, cond: Tensor,
                streaming: bool | Tensor = False, cache: Cache = None) -> Tensor:
        """x, mu, cond (B, 80, T); mask (B, 1, T); t (B,); spks (B, 80) -> v (B, 80, T).

        streaming (bool or (B,) bool): attention limited to chunks of static_chunk_size frames.
        cache: a cached streaming call (models/flow/prefix.py): the T frames are each item's new
        frames, the conv context and keys before them come from the cursor; `streaming` is ignored.
        """
        c = self.time_embed(t)
        h = self.input_embed(x.transpose(1, 2), cond.transpose(1, 2), mu.transpose(1, 2), spks, cache)
        if cache is None:
            valid = mask[:, 0] > 0
            allowed = attention_mask(valid, self.dims.static_chunk_size, streaming)
            angles = self.rotary_embed(torch.arange(h.size(1), device=h.device)).unsqueeze(0)
        else:  # the same for every layer and CFM step of the call: made once
            g = cache[1]
            key = ("dit attention", x.size(0))
            if key not in g.index_cache:
                rows = x.size(0) // g.B
                g.index_cache[key] = (g.attention_mask(self.dims.static_chunk_size).repeat(rows, 1, 1),
                                      g.valid().repeat(rows, 1), self.rotary_embed(g.positions()).repeat(rows, 1, 1))
            allowed, valid, angles = g.index_cache[key]
        residual = h
        for block in self.transformer_blocks:
            h = block(h, c, allowed, valid, angles, cache)
        if self.long_skip_connection is not None:
            h = self.long_skip_connection(torch.cat([h, residual], dim=-1))
        return self.proj_out(self.norm_out(h, c)).transpose(1, 2)
