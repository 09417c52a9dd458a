"""The cached flow call over state slots (state_pool.py) as one CUDA graph per (streams, new
tokens) bucket.

A call's inputs are integers: each item's slot, the positions [start, end) it computes and the
prefix [0, keep) it leaves in its slot, plus its new token ids. Prompt, speaker embedding and every
cached key, value and conv context are read from the slots inside the call, and the new state is
written there in place, so one graph serves every stream whatever its speaker, prompt length or
position, and streams at different positions batch together. Rows padding a call to its bucket
name slot 0 (scratch). Calls past the buckets run the same function eagerly at their own size.

Off CUDA (`cuda_graphs=False`) the call runs padded to its bucket without a graph: the tests use it
to check that padding changes nothing.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from ..graph_buckets import DEFAULT_STREAM_BUCKETS, Bucket, GraphBuckets
from ..models.flow.base import MaskedDiffFlow
from ..models.flow.prefix import SlotGeometry
from .state_pool import StatePool

__all__ = ["SlotCalls"]


class SlotCalls(GraphBuckets):
    what, unit = "cached flow", "new tokens"

    def __init__(self, flow: MaskedDiffFlow, pool: StatePool, *, cuda_graphs: bool | None = None,
                 stream_buckets: Sequence[int] = DEFAULT_STREAM_BUCKETS, min_token_step: int = 32,
                 max_bucket_tokens: int = 16384, max_graphs: int = 64):
        super().__init__(pool.device, cuda_graphs=cuda_graphs, batch_buckets=stream_buckets, min_step=min_token_step,
                         max_bucket_size=max_bucket_tokens, max_graphs=max_graphs)
        self.flow, self.pool = flow, pool

    @torch.inference_mode()
    def __call__(self, tokens: Tensor, slots: Sequence[int], start: Sequence[int], end: Sequence[int],
                 keep: Sequence[int]) -> None:
        """tokens (B, >= max(end - start) + look-ahead) int32: item b's tokens [start, end + look-ahead)
        right-padded. Writes the mel of frames [ratio·start, ratio·end) to each slot's `pool.mel`
        (read it before the slot's next call) and leaves each slot holding the state of [0, keep)."""
        dev = self.device
        new = max(e - s for s, e in zip(start, end))
        inputs = dict(tokens=tokens.to(dev, torch.int32),
                      **{name: torch.tensor(v, dtype=torch.long).to(dev, non_blocking=True)
                         for name, v in (("slots", slots), ("start", start), ("end", end), ("keep", keep))})
        bucket = self.bucket(len(slots), new)
        if bucket is None:
            self.fallbacks += 1
            self._fn((len(slots), new))(**inputs)
        else:
            self._run(bucket, inputs)

    # -- GraphBuckets

    def _fn(self, bucket: Bucket):
        N = bucket[1]
        pool, flow = self.pool, self.flow

        ratio = flow.dims.token_mel_ratio

        def call(tokens, slots, start, end, keep):
            g = SlotGeometry(slots, start, end, keep, N, pool.positions)
            mel = flow.forward_slots(tokens[:, :N + flow.dims.pre_lookahead_len], g, pool.prompt_feat[slots],
                                     pool.prompt_len[slots], pool.embedding[slots], pool.entries,
                                     pool.n_encoder_entries)
            at = (ratio * g.positions().repeat_interleave(ratio, dim=1)
                  + torch.arange(ratio, device=mel.device).repeat(N)).clamp(max=pool.mel.shape[1] - 1)
            pool.mel.index_put_((slots.view(-1, 1).expand_as(at), at), mel.transpose(1, 2))
            return mel
        return call

    def _buffer_shape(self, name: str, bucket: Bucket, example: Tensor) -> tuple[int, ...]:
        Bb, Nb = bucket
        if name == "tokens":
            return Bb, Nb + self.flow.dims.pre_lookahead_len
        return (Bb,)

    def _example(self, bucket: Bucket) -> dict[str, Tensor]:
        Bb, Nb = bucket
        zeros = torch.zeros(Bb, dtype=torch.long, device=self.device)
        return dict(tokens=torch.zeros(Bb, Nb + self.flow.dims.pre_lookahead_len, dtype=torch.int32, device=self.device),
                    slots=zeros, start=zeros, end=zeros, keep=zeros)
