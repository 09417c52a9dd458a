"""Padding and chunk masks shared by the flow encoder and estimator.

Convention: a bool mask is True where attention (or the frame) is allowed / valid.
"""
from __future__ import annotations

import torch
from torch import Tensor


def length_mask(lengths: Tensor, max_len: int) -> Tensor:
    """(B,) lengths -> (B, max_len) bool, True on the first lengths[b] frames."""
    return torch.arange(max_len, device=lengths.device) < lengths.unsqueeze(1)


def chunk_end(pos: Tensor, chunk: int) -> Tensor:
    """The end (exclusive) of the chunk holding frame `pos`: what a streaming frame attends up to.

    Chunks are counted from frame 0 of the whole (prompt + target) sequence.
    """
    return (torch.div(pos, chunk, rounding_mode="floor") + 1) * chunk


def chunk_mask(size: int, chunk: int, device: torch.device | str | None = None) -> Tensor:
    """(size, size) bool: frame i sees every frame of its own chunk and all chunks before it."""
    pos = torch.arange(size, device=device)
    return pos.unsqueeze(0) < chunk_end(pos, chunk).unsqueeze(1)


def attention_mask(valid: Tensor, chunk: int, streaming: bool | Tensor) -> Tensor:
    """(B, T) valid frames -> (B, T, T) bool, key padding plus the chunk mask where streaming.

    `streaming` is a bool for the whole batch or a (B,) bool tensor, so final (full attention) and
    intermediate (chunked) calls of different streams can share one batch. Padded query rows keep
    the valid keys of their item, so no row is ever fully masked.
    """
    B, T = valid.shape
    keys = valid.unsqueeze(1).expand(B, T, T)
    if isinstance(streaming, bool):
        return keys & chunk_mask(T, chunk, valid.device) if streaming else keys
    chunked = chunk_mask(T, chunk, valid.device).unsqueeze(0) | ~streaming.reshape(-1, 1, 1).to(valid.device)
    return keys & chunked
