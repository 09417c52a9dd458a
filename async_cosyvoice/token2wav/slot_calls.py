"""The cached flow call over state slots (state_pool.py) as one CUDA graph per (streams, new
tokens, key tokens) bucket.

A call's inputs are integers: each item's slot, the positions [start, end) it computes and the
prefix [0, keep) it leaves in its slot, plus its new token ids. Prompt, speaker embedding and every
cached key, value and conv context are read from the slots inside the call, and the new state is
written there in place, so one graph serves every stream whatever its speaker, prompt length or
position, and streams at different positions batch together. Rows padding a call to its bucket
name slot 0 (scratch). Calls past the buckets run the same function eagerly at their own size.

Attention reads each slot's first K token positions only, K the call's key bucket: max(end)
rounded up to a multiple of `key_token_step` (at most the slot's capacity; None: always the
capacity), so a call's reads and attention scale with what its streams have filled, not with
the slots' size. For 400-token slots and the default step of 64 that is 7 key buckets
(64, 128, …, 384, 401); with the warm-up's 4 new-token buckets and 7 stream buckets at most
7 × 26 = 182 graphs (max_graphs bounds them; past it calls run uncaptured).

`compile=True` (token2wav.estimator: compiled) runs the flow's repeated blocks through
torch.compile, one dynamic-shape program per block class shared by every instance, CFM step and
bucket, the glue eager (slot_regions.py); the graph captures the compiled code. Its writes into
the pool stay in place (inductor keeps index_put_ / index_copy_ on the slot entries it is given;
tests/test_slot_regions.py checks the pool's storage after a compiled call).

Off CUDA (`cuda_graphs=False`) the call runs padded to its bucket without a graph: the tests use it
to check that padding changes nothing.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import torch
from torch import Tensor

from ..graph_buckets import (
    DEFAULT_STREAM_BUCKETS,
    GraphBuckets,
    batch_bucket,
    length_bucket,
)
from ..models.flow.base import MaskedDiffFlow
from ..models.flow.prefix import SlotGeometry
from .slot_regions import SlotRegions
from .state_pool import StatePool

__all__ = ["DEFAULT_KEY_TOKEN_STEP", "SlotCalls"]

DEFAULT_KEY_TOKEN_STEP = 64
SlotBucket = tuple[int, int, int]  # (streams, new tokens, key tokens)


class SlotCalls(GraphBuckets):
    what, unit = "cached flow", "(streams x new tokens x key tokens)"

    def __init__(self, flow: MaskedDiffFlow, pool: StatePool, *, cuda_graphs: bool | None = None,
                 stream_buckets: Sequence[int] = DEFAULT_STREAM_BUCKETS, min_token_step: int = 32,
                 key_token_step: int | None = DEFAULT_KEY_TOKEN_STEP, compile: bool = False,
                 compile_options: dict | None = None, max_bucket_tokens: int = 16384, max_graphs: int = 192):
        if key_token_step is not None and key_token_step < 1:
            raise ValueError(f"key_token_step must be >= 1 or None (the slot's capacity), got {key_token_step}")
        super().__init__(pool.device, cuda_graphs=cuda_graphs, batch_buckets=stream_buckets, min_step=min_token_step,
                         max_bucket_size=max_bucket_tokens, max_graphs=max_graphs)
        self.flow, self.pool = flow, pool
        self.key_token_step = key_token_step
        self.key_buckets: Counter[int] = Counter()  # calls per key bucket (tokens)
        self.regions = SlotRegions(flow, options=compile_options) if compile else None
        self.step_flow = flow if self.regions is None else self.regions.flow  # what runs a call

    @property
    def compiled(self) -> bool:
        """Whether the calls run compiled (False: asked not to, or the compile failed: eager)."""
        return self.regions is not None and self.regions.compiled

    def key_bucket(self, end: int) -> int:
        """The key tokens a call whose items end by `end` attends over."""
        capacity = self.pool.positions
        if self.key_token_step is None:
            return capacity
        return min(-(-end // self.key_token_step) * self.key_token_step, capacity)

    def bucket(self, batch: int, length: int, end: int | None = None) -> SlotBucket | None:
        """The (streams, new tokens, key tokens) bucket of a call of `batch` streams computing at
        most `length` new tokens, ending by `end` (None: a slot's capacity), or None: no graph."""
        bucket = self._slot_bucket_of(batch, length, end)
        return bucket if bucket is not None and self._has_room(bucket) else None

    def _slot_bucket_of(self, batch: int, length: int, end: int | None) -> SlotBucket | None:
        """`bucket` by the rule alone (max_graphs and memory not counted)."""
        B = batch_bucket(batch, self.batch_buckets)
        N = length_bucket(max(length, self.min_length), self.min_step)
        if B is None or (self.max_bucket_size is not None and B * N > self.max_bucket_size):
            return None
        return B, N, self.key_bucket(self.pool.positions if end is None else end)

    def compile_shapes(self, lengths: Sequence[int]) -> int:
        """GraphBuckets.compile_shapes of these buckets: every stream bucket x `lengths` (new
        tokens) x the shortest and the longest key bucket that holds them, run once on the scratch
        slot. Returns how many buckets ran."""
        if not self.compiled:
            return 0
        keys = self._key_buckets()
        buckets = {b for B in self.batch_buckets for n in lengths for k in (keys[0], keys[-1])
                   if (b := self._slot_bucket_of(B, n, k)) is not None and b[1] <= b[2]}
        with torch.inference_mode():
            for bucket in sorted(buckets):
                self._fn(bucket)(**self._example(bucket))
        return len(buckets)

    def _key_buckets(self) -> list[int]:
        step = self.key_token_step or self.pool.positions
        return sorted({self.key_bucket(k) for k in range(step, self.pool.positions + step, step)})

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
        bucket = self.bucket(len(slots), new, max(end))
        if bucket is None:
            self.fallbacks += 1
            key = self.key_bucket(max(end))
            self.key_buckets[key] += 1
            self._fn((len(slots), new, key))(**inputs)
        else:
            self.key_buckets[bucket[2]] += 1
            self._run(bucket, inputs)

    def warmup(self, streams: Sequence[int], lengths: Sequence[int]) -> int:
        """Capture the buckets of these stream counts x new-token counts x every key bucket that
        holds them. Returns how many graphs were new."""
        keys = self._key_buckets()
        new = 0
        if not self.cuda_graphs:
            return new
        for b in streams:
            for n in lengths:
                for k in keys:
                    bucket = self.bucket(b, n, k)
                    if bucket is None or bucket in self.graphs or bucket[1] > bucket[2]:
                        continue
                    with torch.inference_mode():
                        self._capture(bucket, self._example(bucket))
                    new += 1
        return new

    # -- GraphBuckets

    def _fn(self, bucket: SlotBucket):
        _, N, K = bucket
        pool, flow = self.pool, self.step_flow
        ratio = flow.dims.token_mel_ratio

        def call(tokens, slots, start, end, keep):
            g = SlotGeometry(slots, start, end, keep, N, K)
            mel = flow.forward_slots(tokens[:, :N + flow.dims.pre_lookahead_len], g, pool.prompt_feat[slots],
                                     pool.prompt_len[slots], pool.embedding[slots], pool.entries,
                                     pool.n_encoder_entries)
            at = (ratio * g.positions().repeat_interleave(ratio, dim=1)
                  + torch.arange(ratio, device=mel.device).repeat(N)).clamp(max=pool.mel.shape[1] - 1)
            pool.mel.index_put_((slots.view(-1, 1).expand_as(at), at), mel.transpose(1, 2))
            return mel
        return call

    def _buffer_shape(self, name: str, bucket: SlotBucket, example: Tensor) -> tuple[int, ...]:
        Bb, Nb, _ = bucket
        if name == "tokens":
            return Bb, Nb + self.flow.dims.pre_lookahead_len
        return (Bb,)

    def _example(self, bucket: SlotBucket) -> dict[str, Tensor]:
        """A call of the bucket on the scratch slot. Each input its own tensor, as in a real call: torch.compile
        guards on inputs being the same object, so programs made from one shared zeros tensor fit no real call."""
        Bb, Nb, _ = bucket
        tokens = torch.zeros(Bb, Nb + self.flow.dims.pre_lookahead_len, dtype=torch.int32, device=self.device)
        return dict(tokens=tokens, **{name: torch.zeros(Bb, dtype=torch.long, device=self.device)
                                      for name in ("slots", "start", "end", "keep")})
