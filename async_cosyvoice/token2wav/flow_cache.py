"""The exact flow state cache: which frames a streaming chunk computes, and registered speakers'
prompt prefixes kept on the device.

A streaming chunk renders prompt + target tokens [0, end) with chunked attention (`end` excludes
the pre_lookahead_len look-ahead tokens). Its flow state up to any multiple of the encoder chunk
(25 tokens) at or before `end` is the same on every later streaming call of that stream
(models/flow/prefix.py), so each call:

- starts from the stream's cached state (`stream.flow_state`, tokens [0, start)), or from its
  speaker's prompt prefix, or from nothing;
- computes tokens [start, end) only;
- keeps the state up to keep = the last chunk boundary at or before `end` (capped by
  `max_tokens`).

A speaker prefix is the state of the prompt's complete chunks that lie wholly before its last
pre_lookahead_len tokens (keep = floor((P − 3) / 25) · 25): the pre-lookahead conv of a token
reaches 3 tokens ahead, so a chunk any closer to the prompt's end depends on the target's first
tokens. It depends only on the prompt (tokens, mel, x-vector), so it is computed once per
registered speaker (`prompt_key`) and shared read-only by every stream of that speaker.

The final call of a stream keeps upstream's full attention, so it uses no cache (and drops it).
"""
from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

from ..models.cosyvoice3.dit import POS_CONV_KERNEL
from ..models.dims import DiTFlowDims, FlowDims
from ..models.flow.prefix import FlowState

log = logging.getLogger(__name__)

__all__ = ["FlowState", "SpeakerPrefixCache", "CacheStats", "chunk_floor", "speaker_prefix_tokens", "state_nbytes"]


def chunk_floor(tokens: int, chunk: int) -> int:
    return tokens // chunk * chunk


def speaker_prefix_tokens(n_prompt_tokens: int, chunk: int, lookahead: int) -> int:
    """Prompt tokens whose state does not depend on the target: complete chunks before the last
    `lookahead` prompt tokens."""
    return chunk_floor(max(0, n_prompt_tokens - lookahead), chunk)


def state_nbytes(dims: FlowDims | DiTFlowDims, tokens: int, dtype: torch.dtype) -> int:
    """Bytes of a FlowState covering `tokens` prompt + target tokens, from the model dims (every
    tensor in the flow's dtype but the float32 mel). Per token: the encoder's keys and values (6
    layers on tokens, 4 on frames) and, at each CFM step, the keys and values of every estimator
    transformer block for both CFG halves; plus per state the causal convs' left context.
    CosyVoice3 (DiTFlowDims): no encoder; per CFM step the keys and values of every DiT layer."""
    if tokens == 0:
        return 0
    if isinstance(dims, DiTFlowDims):
        return _dit_state_nbytes(dims, tokens, dtype)
    enc, est, cfm = dims.encoder, dims.estimator, dims.cfm
    ratio, size = dims.token_mel_ratio, torch.empty(0, dtype=dtype).element_size()
    ch, inner = est.channels[0], est.num_heads * est.attention_head_dim
    blocks = est.n_blocks * (est.num_mid_blocks + 2)
    per_token = (2 * enc.output_size * (enc.num_blocks + ratio * enc.num_up_blocks)
                 + cfm.n_timesteps * 2 * 2 * inner * blocks * ratio)
    conv_inputs = est.in_channels + 2 * ch + 2 * ch * est.num_mid_blocks + 2 * ch + ch + ch + ch  # kernel 3: 2 frames
    fixed = (enc.output_size * (2 + 2 * enc.upsample_stride)  # pre-lookahead conv2 (k3), up conv (k5)
             + cfm.n_timesteps * 2 * 2 * conv_inputs)
    return size * (per_token * tokens + fixed) + 4 * dims.output_size * ratio * tokens


def _dit_state_nbytes(dims: DiTFlowDims, tokens: int, dtype: torch.dtype) -> int:
    est, ratio = dims.estimator, dims.token_mel_ratio
    size = torch.empty(0, dtype=dtype).element_size()
    per_token = dims.cfm.n_timesteps * 2 * 2 * est.heads * est.dim_head * est.depth * ratio  # k, v x CFG halves
    fixed = (2 * dims.lookahead_channels  # the look-ahead layer's conv2 (k3)
             + dims.cfm.n_timesteps * 2 * 2 * (POS_CONV_KERNEL - 1) * est.dim)  # the two position convs, CFG halves
    return size * (per_token * tokens + fixed) + 4 * dims.output_size * ratio * tokens


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    too_large: int = 0   # prefixes larger than the whole budget: recomputed by each stream
    bytes: int = 0
    entries: int = 0


class SpeakerPrefixCache:
    """LRU of speaker prompt prefixes (FlowState on the flow's device) within a byte budget.

    Past the budget the least recently used speakers are dropped; their next stream recomputes
    the prefix (exact either way). `budget_bytes` 0 disables the cache. Each entry keeps the
    prompt tokens it was computed from: a lookup with other tokens under the same key (a speaker
    re-registered with new audio) is a miss, never a stale prefix. Thread-safe (the runner calls
    it from its device thread; stats may be read from anywhere).
    """

    def __init__(self, budget_bytes: int):
        if budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
        self.budget_bytes = budget_bytes
        self.stats = CacheStats()
        self._items: OrderedDict[str, tuple[FlowState, int, torch.Tensor]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: str, tokens: torch.Tensor) -> FlowState | None:
        """The prefix of `key` if it was computed from these prompt tokens (the ones it covers plus
        the look-ahead after them)."""
        with self._lock:
            item = self._items.get(key)
            if item is None or not torch.equal(item[2], tokens):
                self.stats.misses += 1
                return None
            self._items.move_to_end(key)
            self.stats.hits += 1
            return item[0]

    def put(self, key: str, state: FlowState, tokens: torch.Tensor) -> bool:
        """Keep `state`, computed from prompt `tokens`, for `key` (evicting older speakers as needed);
        False if it cannot fit at all."""
        size = state.nbytes()
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self.stats.bytes -= old[1]
            if size > self.budget_bytes:
                self.stats.too_large += 1
                self._sync()
                return False
            while self._items and self.stats.bytes + size > self.budget_bytes:
                _, (_, evicted, _) = self._items.popitem(last=False)
                self.stats.bytes -= evicted
                self.stats.evictions += 1
            self._items[key] = (state, size, tokens.clone())
            self.stats.bytes += size
            self._sync()
            return True

    def drop(self, key: str) -> None:
        """Forget a speaker (re-registered or deleted)."""
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self.stats.bytes -= old[1]
            self._sync()

    def _sync(self) -> None:
        self.stats.entries = len(self._items)

    def __contains__(self, key: str) -> bool:
        with self._lock:
            return key in self._items

    def __len__(self) -> int:
        return len(self._items)
