"""The pre-lookahead layer both flows put right after the token embedding, and the causal conv
input it shares with the other causal convs of the flow.

CosyVoice2 runs it inside its conformer encoder (512 -> 512 -> 512); CosyVoice3 runs it on the
80-dim token embedding instead of an encoder (80 -> 1024 -> 80).
"""
from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from .prefix import Cursor, Geometry

Cache = tuple[Cursor, Geometry] | None  # a cached call's state walk and its frames (prefix.py)


def causal_input(x: Tensor, context: int, cache: Cache) -> Tensor:
    """x (B, C, T) with `context` frames of left context: zeros, or the cached frames before a cached call."""
    if cache is None:
        return F.pad(x, (context, 0))
    cursor, g = cache
    return cursor.conv(x, context, g)


class PreLookaheadLayer(nn.Module):
    """Each frame sees itself and the next `lookahead` frames (conv1, leaky-ReLU 0.01), then a causal
    k3 conv back to `channels` (conv2); plus the input."""

    def __init__(self, channels: int, lookahead: int, hidden: int | None = None):
        super().__init__()
        hidden = channels if hidden is None else hidden
        self.lookahead = lookahead
        self.conv1 = nn.Conv1d(channels, hidden, lookahead + 1)
        self.conv2 = nn.Conv1d(hidden, channels, 3)

    def forward(self, x: Tensor, cache: Cache = None) -> Tensor:
        """x (B, T + lookahead, C), the last `lookahead` frames being right context (zeros at the end
        of a final call) -> (B, T, C)."""
        h = F.leaky_relu(self.conv1(x.transpose(1, 2)), 0.01)
        h = causal_input(h, self.conv2.kernel_size[0] - 1, cache)
        h = self.conv2(h)
        return h.transpose(1, 2) + x[:, : h.size(2)]
