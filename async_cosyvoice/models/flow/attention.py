"""The estimator's self-attention over its mask, two ways to one result (token2wav.flow_attention).

- `sdpa`: an additive float bias (B, 1, T, K) through scaled_dot_product_attention. Every head reads
  the whole bias and no masked block is skipped. The cached calls (prefix.py: keys from the cursor)
  always take this way.
- `flex`: a flex_attention BlockMask over blocks of FLEX_BLOCK frames. The keys a query may attend
  to are a prefix [0, limit) of the sequence, so the mask says which key blocks lie wholly inside
  every query's prefix (run without a mask), which block holds a limit (the exact rule, `mask_mod`,
  applied inside it) and which lie past it (skipped).

Both allow, for item b and query frame q, the keys kv < length[b] and, when b streams, also
kv < chunk_end(q) (masks.py). As in masks.attention_mask, padded query frames keep the valid keys
of their item, so only an item with no valid frame has no key at all (flex gives it zeros; its
output is masked away).

`flex_block_mask` is made from tensors only: no host synchronisation and no shape that depends on
values, so a captured CUDA graph of the whole flow call (token2wav/flow_graphs.py) replays it for
new lengths and streaming flags.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from .masks import chunk_end

__all__ = ["ATTENTIONS", "FLEX_BLOCK", "AttentionMask", "attend", "flex_block_mask"]

ATTENTIONS = ("sdpa", "flex")

# flex's default block, and the kernel tile inductor picks on an H100 / H200 for head_dim 64 in half
# precision (128 x 128): a BlockMask block smaller than the tile is refused ("Q and KV block size must be
# divisible by BLOCK_M and BLOCK_N"), so 64, nearer the 50-frame chunks, would need kernel options that
# override the tuned tile. With 50-frame chunks a query block's limits fall in at most 2 key blocks: those
# are the partial ones.
FLEX_BLOCK = 128

AttentionMask = Tensor | BlockMask  # an additive bias (B, 1, T, K) for SDPA, or a flex BlockMask


def attend(q: Tensor, k: Tensor, v: Tensor, mask: AttentionMask) -> Tensor:
    """q (B, H, T, d), k and v (B, H, K, d) -> (B, H, T, d), each query over its allowed keys."""
    if isinstance(mask, BlockMask):
        if q.device.type == "cpu":  # inductor's C++ flex template (torch 2.13) fails on a view of a 2-D buffer
            q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        return flex_attention(q, k, v, block_mask=mask)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _rows(streaming: bool | Tensor, batch: int, device: torch.device) -> Tensor:
    if isinstance(streaming, Tensor):
        return streaming.reshape(-1).to(device, torch.bool).expand(batch)
    return torch.full((batch,), bool(streaming), dtype=torch.bool, device=device)


def flex_block_mask(valid: Tensor, chunk: int, streaming: bool | Tensor, block: int = FLEX_BLOCK) -> BlockMask:
    """(B, T) valid frames (a length mask: the first length[b] frames) -> the BlockMask of
    masks.attention_mask(valid, chunk, streaming), over blocks of `block` frames.

    The limit of query q, limit(q) = min(length, chunk_end(q)) where the item streams, else length,
    never falls as q grows. So in query block i every query attends at least to [0, limit(first))
    and at most to [0, limit(last)): key blocks below limit(first) // block are full (no mask_mod),
    those up to ceil(limit(last) / block) partial (mask_mod), the rest skipped.
    """
    B, T = valid.shape
    device = valid.device
    n = -(-T // block)
    length = valid.sum(-1, dtype=torch.int32)
    rows = _rows(streaming, B, device)

    def limit(q: Tensor) -> Tensor:  # (n,) query frames -> (B, n): keys [0, limit) allowed
        end = torch.minimum(length.unsqueeze(-1), chunk_end(q, chunk))
        return torch.where(rows.unsqueeze(-1), end, length.unsqueeze(-1))

    blocks = torch.arange(n, dtype=torch.int32, device=device)
    first = blocks * block
    last = (first + block - 1).clamp(max=T - 1)
    full = torch.div(limit(first), block, rounding_mode="floor").to(torch.int32)  # (B, n)
    upto = torch.div(limit(last) + block - 1, block, rounding_mode="floor").to(torch.int32)
    full_indices = blocks.expand(B, 1, n, n).contiguous()
    # the partial blocks follow the full ones; indices past a row's count are never read (kept in range)
    partial_indices = (full.unsqueeze(-1) + blocks).clamp(max=n - 1).unsqueeze(1).contiguous()

    def mask_mod(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        end = torch.minimum(length[b], chunk_end(q, chunk))
        return kv < torch.where(rows[b], end, length[b])

    return BlockMask.from_kv_blocks(
        (upto - full).unsqueeze(1), partial_indices, full.unsqueeze(1), full_indices,
        BLOCK_SIZE=block, mask_mod=mask_mod, seq_lengths=(T, T),
        compute_q_blocks=False,  # q-major indices serve only the backward pass
    )
