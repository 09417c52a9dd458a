"""CausalConditionalDecoder: the flow-matching vector field v(x, t | mu, spks, cond).

A one-level causal U-Net over time: [resnet + transformers] down, N × [resnet + transformers] mid,
[resnet + transformers] up on (x, skip), final block and a 1×1 projection. Convolutions are causal
(left padded) and every conv input is multiplied by the mask, so right padding never leaks into an
item; attention masks padded keys (and, when streaming, future chunks): with an additive bias through
SDPA, or, for a recomputing call with attention="flex", a flex BlockMask made once per call
(attention.py).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..dims import EstimatorDims
from .attention import ATTENTIONS, AttentionMask, attend, flex_block_mask
from .masks import attention_mask
from .prefix import Cursor, Geometry

Cache = tuple[Cursor, Geometry] | None  # a cached call's state walk and its frames (prefix.py)

_GELU_APPROXIMATE = {"gelu": "none", "gelu-approximate": "tanh"}


def timestep_embedding(t: Tensor, dim: int) -> Tensor:
    """Sinusoidal embedding of 1000·t: [sin, cos] over dim/2 frequencies exp(−i·ln(1e4)/(dim/2−1))."""
    half = dim // 2
    freqs = torch.exp(torch.arange(half, device=t.device).float() * -(math.log(10000) / (half - 1)))
    angle = (1000 * t.float().reshape(-1)).unsqueeze(1) * freqs.unsqueeze(0)
    return torch.cat([angle.sin(), angle.cos()], dim=-1)


class TimestepMLP(nn.Module):
    def __init__(self, in_channels: int, dim: int):
        super().__init__()
        self.linear_1 = nn.Linear(in_channels, dim)
        self.linear_2 = nn.Linear(dim, dim)

    def forward(self, t: Tensor) -> Tensor:
        return self.linear_2(F.silu(self.linear_1(t)))


class CausalConv1d(nn.Conv1d):
    def __init__(self, in_channels: int, out_channels: int, kernel_size: int):
        super().__init__(in_channels, out_channels, kernel_size)

    def forward(self, x: Tensor, cache: Cache = None) -> Tensor:
        context = self.kernel_size[0] - 1
        if cache is None:
            return super().forward(F.pad(x, (context, 0)))
        cursor, g = cache
        return super().forward(cursor.conv(x, context, g))


class Transpose(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x.transpose(1, 2)


class CausalBlock1D(nn.Module):
    """Causal conv k3 -> LayerNorm over channels -> Mish, masked in and out."""

    def __init__(self, dim: int, dim_out: int):
        super().__init__()
        self.block = nn.Sequential(
            CausalConv1d(dim, dim_out, 3), Transpose(), nn.LayerNorm(dim_out), Transpose(), nn.Mish()
        )

    def forward(self, x: Tensor, mask: Tensor, cache: Cache = None) -> Tensor:
        conv, *rest = self.block
        h = conv(x * mask, cache)
        for m in rest:
            h = m(h)
        return h * mask


class CausalResnetBlock1D(nn.Module):
    def __init__(self, dim: int, dim_out: int, time_dim: int):
        super().__init__()
        self.mlp = nn.Sequential(nn.Mish(), nn.Linear(time_dim, dim_out))
        self.block1 = CausalBlock1D(dim, dim_out)
        self.block2 = CausalBlock1D(dim_out, dim_out)
        self.res_conv = nn.Conv1d(dim, dim_out, 1)

    def forward(self, x: Tensor, mask: Tensor, t: Tensor, cache: Cache = None) -> Tensor:
        h = self.block1(x, mask, cache) + self.mlp(t).unsqueeze(-1)
        return self.block2(h, mask, cache) + self.res_conv(x * mask)


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, head_dim: int):
        super().__init__()
        self.heads = heads
        self.to_q = nn.Linear(dim, heads * head_dim, bias=False)
        self.to_k = nn.Linear(dim, heads * head_dim, bias=False)
        self.to_v = nn.Linear(dim, heads * head_dim, bias=False)
        self.to_out = nn.ModuleList([nn.Linear(heads * head_dim, dim)])

    def forward(self, x: Tensor, attn_mask: AttentionMask, cache: Cache = None) -> Tensor:
        """x (B, T, dim); attn_mask: a (B, 1, T, K) additive bias (K = T, or the cached call's keys) or
        a flex BlockMask over T x T (attention.py)."""
        B, T, _ = x.shape
        q, k, v = (f(x).view(B, T, self.heads, -1).transpose(1, 2) for f in (self.to_q, self.to_k, self.to_v))
        if cache is not None:
            cursor, g = cache
            k, v = cursor.attention(k, v, g)
        out = attend(q, k, v, attn_mask)
        return self.to_out[0](out.transpose(1, 2).reshape(B, T, -1))


class GELUProjection(nn.Module):
    def __init__(self, dim_in: int, dim_out: int, approximate: str):
        super().__init__()
        self.proj = nn.Linear(dim_in, dim_out)
        self.approximate = approximate

    def forward(self, x: Tensor) -> Tensor:
        return F.gelu(self.proj(x), approximate=self.approximate)


class FeedForward(nn.Module):
    def __init__(self, dim: int, act_fn: str, mult: int = 4):
        super().__init__()
        # net.1 is the (inference-time no-op) dropout of the weight layout
        self.net = nn.Sequential(
            GELUProjection(dim, mult * dim, _GELU_APPROXIMATE[act_fn]), nn.Identity(), nn.Linear(mult * dim, dim)
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)


class TransformerBlock(nn.Module):
    """Pre-norm self-attention + FFN (diffusers BasicTransformerBlock, no cross-attention)."""

    def __init__(self, dim: int, heads: int, head_dim: int, act_fn: str):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn1 = Attention(dim, heads, head_dim)
        self.norm3 = nn.LayerNorm(dim)
        self.ff = FeedForward(dim, act_fn)

    def forward(self, x: Tensor, attn_mask: AttentionMask, cache: Cache = None) -> Tensor:
        x = x + self.attn1(self.norm1(x), attn_mask, cache)
        return x + self.ff(self.norm3(x))


class CausalConditionalDecoder(nn.Module):
    # what regional compilation compiles (estimator/regions.py: the recompute estimator, compile_estimator, and the
    # cached slot call, token2wav/slot_regions.py): one program per block class
    repeated_blocks = (TransformerBlock, CausalResnetBlock1D)
    attentions = ATTENTIONS  # what the recomputing calls' `attention` may be (token2wav.flow_attention)

    def __init__(self, dims: EstimatorDims):
        super().__init__()
        if len(dims.channels) != 1:
            raise ValueError(f"estimator channels={dims.channels}: only the one-level causal decoder is supported")
        if dims.act_fn not in _GELU_APPROXIMATE:
            raise ValueError(f"estimator act_fn={dims.act_fn!r}: supported are {sorted(_GELU_APPROXIMATE)}")
        self.dims = dims
        ch, time_dim = dims.channels[0], 4 * dims.channels[0]

        def transformers() -> nn.ModuleList:
            return nn.ModuleList(
                TransformerBlock(ch, dims.num_heads, dims.attention_head_dim, dims.act_fn) for _ in range(dims.n_blocks)
            )

        self.time_mlp = TimestepMLP(dims.in_channels, time_dim)
        down = [CausalResnetBlock1D(dims.in_channels, ch, time_dim), transformers(), CausalConv1d(ch, ch, 3)]
        self.down_blocks = nn.ModuleList([nn.ModuleList(down)])
        self.mid_blocks = nn.ModuleList(
            nn.ModuleList([CausalResnetBlock1D(ch, ch, time_dim), transformers()]) for _ in range(dims.num_mid_blocks)
        )
        up = [CausalResnetBlock1D(2 * ch, ch, time_dim), transformers(), CausalConv1d(ch, ch, 3)]
        self.up_blocks = nn.ModuleList([nn.ModuleList(up)])
        self.final_block = CausalBlock1D(ch, ch)
        self.final_proj = nn.Conv1d(ch, dims.out_channels, 1)

    def forward(
        self,
        x: Tensor,
        mask: Tensor,
        mu: Tensor,
        t: Tensor,
        spks: Tensor,
        cond: Tensor,
        streaming: bool | Tensor = False,
        cache: Cache = None,
        attention: str = "sdpa",
    ) -> Tensor:
        """x, mu, cond (B, 80, T); mask (B, 1, T); t (B,); spks (B, 80) -> v (B, 80, T), zero where masked.

        streaming (bool or (B,) bool): attention limited to chunks of static_chunk_size frames from frame 0.
        cache: a cached streaming call (prefix.py): the T frames are each item's new frames, the
        attention keys and conv context before them come from the cursor, `streaming` is ignored.
        attention: "sdpa" (an additive bias) or "flex" (a BlockMask; attention.py) for a call without
        `cache`; a cached call always attends through SDPA over its cursor's keys.
        """
        t = self.time_mlp(timestep_embedding(t, self.dims.in_channels).to(x.dtype))
        x = torch.cat([x, mu, spks.unsqueeze(-1).expand(-1, -1, x.size(2)), cond], dim=1)
        if cache is None:
            attn_mask = self.attention_mask(mask, streaming, x.dtype, attention)
        else:  # the same for every CFM step of the call: made once
            g = cache[1]
            key = ("estimator bias", x.size(0), x.dtype)
            if key not in g.index_cache:
                allowed = g.attention_mask(self.dims.static_chunk_size).repeat(x.size(0) // g.B, 1, 1)
                g.index_cache[key] = _additive(allowed, x.dtype)
            attn_mask = g.index_cache[key]

        (resnet, blocks, down), = self.down_blocks
        x = _attend(blocks, resnet(x, mask, t, cache), attn_mask, cache)
        skip = x
        x = down(x * mask, cache)
        for resnet, blocks in self.mid_blocks:
            x = _attend(blocks, resnet(x, mask, t, cache), attn_mask, cache)
        (resnet, blocks, up), = self.up_blocks
        x = _attend(blocks, resnet(torch.cat([x, skip], dim=1), mask, t, cache), attn_mask, cache)
        x = up(x * mask, cache)
        x = self.final_block(x, mask, cache)
        return self.final_proj(x * mask) * mask

    def attention_mask(self, mask: Tensor, streaming: bool | Tensor, dtype: torch.dtype,
                       attention: str = "sdpa") -> AttentionMask:
        """(B, 1, T) frame mask (a length mask) -> the blocks' attention mask: "sdpa", a (B, 1, T, T)
        additive bias, 0 where allowed, −1e10 elsewhere; "flex", the BlockMask of the same rule."""
        valid, chunk = mask[:, 0] > 0, self.dims.static_chunk_size
        if attention == "flex":
            return flex_block_mask(valid, chunk, streaming)
        if attention != "sdpa":
            raise ValueError(f"estimator attention={attention!r}: choose one of {', '.join(ATTENTIONS)}")
        return _additive(attention_mask(valid, chunk, streaming), dtype)


def _additive(allowed: Tensor, dtype: torch.dtype) -> Tensor:
    """(B, T, K) bool -> (B, 1, T, K) additive bias: 0 where allowed, −1e10 elsewhere."""
    # float16 cannot hold −1e10; its most negative finite value masks just as well
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(
        ~allowed, max(-1e10, torch.finfo(dtype).min)
    ).unsqueeze(1)


def _attend(blocks: nn.ModuleList, x: Tensor, attn_mask: AttentionMask, cache: Cache = None) -> Tensor:
    x = x.transpose(1, 2)
    for block in blocks:
        x = block(x, attn_mask, cache)
    return x.transpose(1, 2)
