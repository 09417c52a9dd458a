"""UpsampleConformerEncoder: speech-token embeddings (25 Hz) -> 50 Hz hidden states.

embed -> pre-lookahead conv -> conformer layers -> ×2 causal upsample -> up_embed -> up-layers.
Attention uses espnet-style relative positions (pos_bias_u/v); the position encoding only enters
the attention scores and is never added to x.

Batched: item b renders `lengths[b]` tokens; the `context_lengths[b]` tokens right after them are
look-ahead context for the pre-lookahead conv only. Everything past an item's tokens is masked out
or only reachable through right-looking paths that end before it, so padding never changes an item.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..dims import EncoderDims
from .lookahead import PreLookaheadLayer, causal_input
from .masks import attention_mask, length_mask
from .prefix import Cursor, Geometry

# position scores of one block of queries (B x heads x queries x (2S - 1)): 64 MiB of float32
ATTENTION_BLOCK_ELEMENTS = 1 << 24

Cache = tuple[Cursor, Geometry] | None  # a cached call's state walk and its frames (prefix.py)


def rel_position_encoding(size: int, d_model: int, device, dtype) -> Tensor:
    """(1, 2·size−1, d_model): sin/cos (interleaved) of relative positions size−1, …, −(size−1)."""
    rel = torch.arange(size - 1, -size, -1, device=device).unsqueeze(1)
    inv_freq = torch.exp(torch.arange(0, d_model, 2, device=device) * -(math.log(10000.0) / d_model))
    angle = rel * inv_freq
    return torch.stack([angle.sin(), angle.cos()], dim=-1).flatten(1).unsqueeze(0).to(dtype)


class LinearEmbed(nn.Module):
    """Linear + LayerNorm, scaled by √d (espnet rel-pos input layer without the dropout)."""

    def __init__(self, idim: int, odim: int):
        super().__init__()
        self.out = nn.Sequential(nn.Linear(idim, odim), nn.LayerNorm(odim, eps=1e-5))
        self.xscale = math.sqrt(odim)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(x) * self.xscale


class RelPositionAttention(nn.Module):
    def __init__(self, d_model: int, heads: int):
        super().__init__()
        self.heads, self.d_k = heads, d_model // heads
        self.linear_q = nn.Linear(d_model, d_model)
        self.linear_k = nn.Linear(d_model, d_model)
        self.linear_v = nn.Linear(d_model, d_model)
        self.linear_out = nn.Linear(d_model, d_model)
        self.linear_pos = nn.Linear(d_model, d_model, bias=False)
        self.pos_bias_u = nn.Parameter(torch.zeros(heads, self.d_k))
        self.pos_bias_v = nn.Parameter(torch.zeros(heads, self.d_k))

    def forward(self, x: Tensor, pos: Tensor, mask: Tensor, cache: Cache = None) -> Tensor:
        """x (B, T, D), pos (1, 2S−1, D) from rel_position_encoding(S), mask (B, T, K) bool.

        Without a cache the queries and keys are frames 0..T−1 (K = T = S). With one, the queries
        are the new frames (absolute positions g.positions()) and the keys the cached prefix
        followed by them (K = g.K); S must cover every query − key distance."""
        B, T, D = x.shape
        q = self.linear_q(x).view(B, T, self.heads, self.d_k)
        k = self.linear_k(x).view(B, T, self.heads, self.d_k).transpose(1, 2)
        v = self.linear_v(x).view(B, T, self.heads, self.d_k).transpose(1, 2)
        if cache is None:
            i = torch.arange(T, device=x.device).unsqueeze(0)
        else:
            cursor, g = cache
            k, v = cursor.attention(k, v, g)
            i = g.positions()
        p = self.linear_pos(pos).view(1, -1, self.heads, self.d_k).transpose(1, 2)
        # a long utterance's full-attention call in blocks of queries: the (B, heads, T, 2S − 1)
        # position scores and the (B, heads, T, K) bias of all queries at once took 6 GB for 3000
        # tokens on the tiny model; calls within ATTENTION_BLOCK_ELEMENTS run whole, as before
        rows = max(1, ATTENTION_BLOCK_ELEMENTS // (B * self.heads * pos.size(1)))
        if T <= rows:
            out = self._attend(q, k, v, p, pos.size(1), i, mask)
        else:
            out = torch.cat([self._attend(q[:, a:a + rows], k, v, p, pos.size(1), i[..., a:a + rows],
                                          mask[:, a:a + rows]) for a in range(0, T, rows)], dim=2)
        return self.linear_out(out.transpose(1, 2).reshape(B, T, D))

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, p: Tensor, n_pos: int, i: Tensor, mask: Tensor) -> Tensor:
        """Queries q (B, Tq, heads, d_k) at positions i against keys k, v (B, heads, K, d_k) -> (B, heads, Tq, d_k)."""
        B, T = q.shape[:2]
        # scores = ((q + u)·k + (q + v)·p[i − j]) / √d_k; column c of p holds relative position S−1−c
        S = (n_pos + 1) // 2
        pos_scores = (q + self.pos_bias_v).transpose(1, 2) @ p.transpose(-2, -1)
        j = torch.arange(k.size(2), device=q.device)
        col = (S - 1 - i.unsqueeze(2) + j).unsqueeze(1).expand(B, self.heads, T, k.size(2))
        bias = pos_scores.gather(-1, col) / math.sqrt(self.d_k)
        bias = bias.masked_fill(~mask.unsqueeze(1), float("-inf"))
        return F.scaled_dot_product_attention((q + self.pos_bias_u).transpose(1, 2), k, v, attn_mask=bias)


class FeedForward(nn.Module):
    def __init__(self, d_model: int, hidden: int):
        super().__init__()
        self.w_1 = nn.Linear(d_model, hidden)
        self.w_2 = nn.Linear(hidden, d_model)

    def forward(self, x: Tensor) -> Tensor:
        return self.w_2(F.silu(self.w_1(x)))


class ConformerLayer(nn.Module):
    """Pre-norm self-attention + FFN (no macaron, no conv module)."""

    def __init__(self, d_model: int, heads: int, linear_units: int):
        super().__init__()
        self.self_attn = RelPositionAttention(d_model, heads)
        self.feed_forward = FeedForward(d_model, linear_units)
        self.norm_mha = nn.LayerNorm(d_model, eps=1e-12)
        self.norm_ff = nn.LayerNorm(d_model, eps=1e-12)

    def forward(self, x: Tensor, pos: Tensor, mask: Tensor, cache: Cache = None) -> Tensor:
        x = x + self.self_attn(self.norm_mha(x), pos, mask, cache)
        return x + self.feed_forward(self.norm_ff(x))


class Upsample1D(nn.Module):
    """Nearest ×stride, then a causal conv (left pad 2·stride, kernel 2·stride+1)."""

    def __init__(self, channels: int, stride: int):
        super().__init__()
        self.stride = stride
        self.conv = nn.Conv1d(channels, channels, 2 * stride + 1)

    def forward(self, x: Tensor, cache: Cache = None) -> Tensor:
        """(B, C, T) -> (B, C, stride·T)."""
        x = x.repeat_interleave(self.stride, dim=2)
        return self.conv(causal_input(x, 2 * self.stride, cache))


class UpsampleConformerEncoder(nn.Module):
    # what regional compilation compiles (token2wav/slot_regions.py, the cached slot call): one program per block class
    repeated_blocks = (ConformerLayer,)

    def __init__(self, dims: EncoderDims):
        super().__init__()
        self.dims = dims
        d = dims.output_size

        def layers(n: int) -> nn.ModuleList:
            return nn.ModuleList(ConformerLayer(d, dims.attention_heads, dims.linear_units) for _ in range(n))

        self.embed = LinearEmbed(dims.input_size, d)
        self.pre_lookahead_layer = PreLookaheadLayer(d, dims.pre_lookahead_len)
        self.encoders = layers(dims.num_blocks)
        self.up_layer = Upsample1D(d, dims.upsample_stride)
        self.up_embed = LinearEmbed(dims.input_size, d)
        self.up_encoders = layers(dims.num_up_blocks)
        self.after_norm = nn.LayerNorm(d, eps=1e-5)

    def forward(
        self,
        xs: Tensor,
        lengths: Tensor,
        context_lengths: Tensor | None = None,
        streaming: bool | Tensor = False,
        n_tokens: int | None = None,
    ) -> tuple[Tensor, Tensor]:
        """xs (B, S, input_size) token embeddings; lengths (B,) tokens to render; context_lengths (B,)
        look-ahead tokens right after them (0 = final call: zeros instead). streaming: bool or (B,)
        bool, chunk masks of static_chunk_size tokens / ×stride frames from position 0. n_tokens:
        T, at least max(lengths) (the frames past every item are padding); None: max(lengths), read
        from the device.

        Returns (B, stride·T, output_size), zero past each item, and stride·lengths.
        """
        dims = self.dims
        T = int(lengths.max()) if n_tokens is None else n_tokens
        seen = lengths if context_lengths is None else lengths + context_lengths

        # Frames past an item's tokens (+ context) must be exact zeros: that is the final call's
        # right padding of the lookahead conv.
        x = self.embed(xs) * length_mask(seen, xs.size(1)).unsqueeze(-1).to(xs.dtype)
        x = F.pad(x, (0, 0, 0, max(0, T + dims.pre_lookahead_len - x.size(1))))
        x = self.pre_lookahead_layer(x[:, : T + dims.pre_lookahead_len])
        x = self._layers(self.encoders, x, lengths, dims.static_chunk_size, streaming)

        x = self.up_layer(x.transpose(1, 2)).transpose(1, 2)
        lengths = lengths * dims.upsample_stride
        x = self.up_embed(x)
        x = self._layers(self.up_encoders, x, lengths, dims.static_chunk_size * dims.upsample_stride, streaming)
        x = self.after_norm(x)
        return x * length_mask(lengths, x.size(1)).unsqueeze(-1).to(x.dtype), lengths

    def _layers(self, layers: nn.ModuleList, x: Tensor, lengths: Tensor, chunk: int, streaming) -> Tensor:
        pos = rel_position_encoding(x.size(1), x.size(2), x.device, x.dtype)
        mask = attention_mask(length_mask(lengths, x.size(1)), chunk, streaming)
        for layer in layers:
            x = layer(x, pos, mask)
        return x

    def forward_cached(self, xs: Tensor, g: Geometry, cursor: Cursor, context_lengths: Tensor | None = None) -> Tensor:
        """A streaming call on new tokens only. xs (B, <= N + lookahead, input_size): the embeddings of
        item b's tokens [g.start[b], g.end[b] + context_lengths[b]), right-padded (context_lengths
        default: lookahead; 0 = a last call, zeros as right context); the keys and conv context of
        tokens before g.start[b] come from the cursor. Returns (B, stride·N, output_size), the
        frames [stride·start, stride·end), zero past each item; equal to `forward(..., streaming=True)`
        on the whole sequence at those frames."""
        dims = self.dims
        if context_lengths is None:
            context_lengths = torch.full_like(g.new_lengths, dims.pre_lookahead_len)
        seen = torch.arange(xs.size(1), device=xs.device) < (g.new_lengths + context_lengths).unsqueeze(1)
        x = self.embed(xs) * seen.unsqueeze(-1).to(xs.dtype)
        x = F.pad(x, (0, 0, 0, max(0, g.N + dims.pre_lookahead_len - x.size(1))))  # zeros: no look-ahead tokens
        x = self.pre_lookahead_layer(x[:, : g.N + dims.pre_lookahead_len], (cursor, g))
        x = self._cached_layers(self.encoders, x, g, cursor, dims.static_chunk_size)
        g2 = g.scaled(dims.upsample_stride)
        x = self.up_layer(x.transpose(1, 2), (cursor, g2)).transpose(1, 2)
        x = self.up_embed(x)
        x = self._cached_layers(self.up_encoders, x, g2, cursor, dims.static_chunk_size * dims.upsample_stride)
        x = self.after_norm(x)
        return x * g2.valid().unsqueeze(-1).to(x.dtype)

    def _cached_layers(self, layers: nn.ModuleList, x: Tensor, g: Geometry, cursor: Cursor, chunk: int) -> Tensor:
        pos = rel_position_encoding(g.span, x.size(2), x.device, x.dtype)
        mask = g.attention_mask(chunk)
        for layer in layers:
            x = layer(x, pos, mask, (cursor, g))
        return x

