"""StatePool: the exact flow cache's state in fixed slots at static addresses (vLLM's KV-cache
idea), so a cached flow call is a function of integers and one CUDA graph per (streams, new
tokens) bucket serves every stream, whatever its speaker, prompt length or position.

Memory is one tensor in the flow's dtype; each state entry (a causal conv's left context, an
attention layer's keys or values, for the encoder and every CFM step: the order
`Flow.state_layout` records) is a contiguous (rows, slots, …) block of it, so a batch's state is
read with one block copy per entry (`SlotCursor`). A slot holds a sequence of up to
`slot_tokens` prompt + target tokens, plus the prompt's mel, length and speaker embedding that a
call reads as its inputs, and the mel the flow has output so far. Slot 0 is scratch: padding items of a graph write there.

Slots are handed out as integers: a stream leases one for its streaming chunks (`lease`,
released by its final chunk, or when the stream is dropped: cancel, abort, deadline); a
registered speaker's prompt prefix lives in a speaker slot (LRU over `speaker_slots`) and starts a
stream by one copy of the slot. No lease free: the stream recomputes (exact, slower).
"""
from __future__ import annotations

import logging
import math
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..models.flow.base import MaskedDiffFlow
from ..models.flow.prefix import EntryShape

log = logging.getLogger(__name__)

__all__ = ["StatePool", "SlotLease", "PoolStats"]


@dataclass
class PoolStats:
    leases: int = 0      # stream slots handed out
    full: int = 0        # leases refused: every stream slot taken
    outgrown: int = 0    # streams that ran past their slot and went on recomputing
    speaker_hits: int = 0
    speaker_misses: int = 0


@dataclass(eq=False)
class SlotLease:
    """A stream's slot: `tokens` prompt + target tokens of state are there (the stream's next
    cached call starts at it). Released once, explicitly or when the lease is garbage."""
    slot: int
    tokens: int = 0
    _release: weakref.finalize = field(default=None, repr=False)

    def release(self) -> None:
        if self._release is not None:
            self._release()


class StatePool:
    def __init__(self, flow: MaskedDiffFlow, *, slots: int, slot_tokens: int, speaker_slots: int = 0):
        if slots < 1 or slot_tokens < 1 or speaker_slots < 0:
            raise ValueError(f"a state pool needs slots >= 1, slot_tokens >= 1, speaker_slots >= 0; got "
                             f"{slots}, {slot_tokens}, {speaker_slots}")
        dims = flow.dims
        self.flow = flow
        self.slot_tokens = slot_tokens
        self.positions = slot_tokens + 1  # one spare position: padding frames' writes land past every sequence
        chunk = dims.chunk_tokens
        layout, self.n_encoder_entries = flow.state_layout(chunk)
        steps = flow.decoder.params.n_timesteps
        self.layout: list[EntryShape] = layout[:self.n_encoder_entries] + layout[self.n_encoder_entries:] * steps
        weight = flow.input_embedding.weight
        self.dtype, self.device = weight.dtype, weight.device
        n_slots = 1 + slots + speaker_slots
        shapes = [self._entry_shape(e) for e in self.layout]
        self.slot_numel = sum(math.prod(s) for s in shapes)
        self.buffer = torch.zeros(n_slots * self.slot_numel, dtype=self.dtype, device=self.device)
        self.entries: list[Tensor] = []
        offset = 0
        for rows, *rest in shapes:
            n = n_slots * rows * math.prod(rest)
            self.entries.append(self.buffer[offset:offset + n].view(rows, n_slots, *rest))
            offset += n
        frames = dims.token_mel_ratio * slot_tokens
        self.prompt_feat = torch.zeros(n_slots, frames, dims.output_size, dtype=self.dtype, device=self.device)
        self.prompt_len = torch.zeros(n_slots, dtype=torch.long, device=self.device)
        self.embedding = torch.zeros(n_slots, dims.spk_embed_dim, dtype=torch.float32, device=self.device)
        # the flow's output so far (a complete chunk's mel is what it was when new)
        self.mel = torch.zeros(n_slots, dims.token_mel_ratio * self.positions, dims.output_size, device=self.device)
        self._lock = threading.Lock()
        self._free = list(range(slots, 0, -1))  # stream slots 1..slots, the lowest handed out first
        self._speaker_free = list(range(n_slots - 1, slots, -1))
        self._speakers: OrderedDict[str, tuple[int, Tensor]] = OrderedDict()  # key -> (slot, prefix tokens)
        self.n_slots, self.n_stream_slots, self.n_speaker_slots = n_slots, slots, speaker_slots
        self.stats = PoolStats()
        log.info("flow state pool: %d stream slots + %d speaker slots of %d tokens, %.2f GiB (%s)",
                 slots, speaker_slots, slot_tokens, self.nbytes / 2**30, self.dtype)

    def _entry_shape(self, e: EntryShape) -> tuple[int, ...]:
        if e.kind == "conv":
            return e.shape                      # (rows, C, context)
        rows, heads, d = e.shape
        return (rows, e.scale * self.positions, heads, d)

    @property
    def nbytes(self) -> int:
        return (self.buffer.numel() * self.buffer.element_size() + self.prompt_feat.numel() * self.prompt_feat.element_size()
                + self.embedding.numel() * 4 + self.prompt_len.numel() * 8 + self.mel.numel() * 4)

    @staticmethod
    def slot_nbytes(flow: MaskedDiffFlow, slot_tokens: int) -> int:
        """Bytes of one slot of `slot_tokens` tokens, from the model (for sizing a pool by bytes)."""
        layout, n_enc = flow.state_layout(flow.dims.chunk_tokens)
        steps = flow.decoder.params.n_timesteps
        size = flow.input_embedding.weight.element_size()
        numel = 0
        for e in layout[:n_enc] + layout[n_enc:] * steps:
            numel += math.prod(e.shape) if e.kind == "conv" else math.prod(e.shape) * e.scale * (slot_tokens + 1)
        dims = flow.dims
        return (numel * size + dims.token_mel_ratio * slot_tokens * dims.output_size * size  # state, prompt mel
                + dims.spk_embed_dim * 4 + 8 + dims.token_mel_ratio * (slot_tokens + 1) * dims.output_size * 4)

    # -- stream slots

    @property
    def free_slots(self) -> int:
        with self._lock:
            return len(self._free)

    def lease(self) -> SlotLease | None:
        """A free stream slot, or None (every slot is leased: the caller recomputes)."""
        with self._lock:
            if not self._free:
                self.stats.full += 1
                return None
            slot = self._free.pop()
            self.stats.leases += 1
        lease = SlotLease(slot)
        lease._release = weakref.finalize(lease, self._give_back, slot)
        return lease

    def _give_back(self, slot: int) -> None:
        with self._lock:
            self._free.append(slot)

    # -- what a slot's calls read

    def load_prompt(self, slot: int, prompt_feat: Tensor, embedding: Tensor) -> None:
        """prompt_feat (1, F, 80) and embedding (1, 192) as slot's inputs."""
        n = prompt_feat.shape[1]
        if n > self.prompt_feat.shape[1]:
            raise ValueError(f"a {n}-frame prompt does not fit a {self.slot_tokens}-token slot")
        self.prompt_feat[slot, :n] = prompt_feat[0].to(self.device, self.dtype)
        self.prompt_len[slot] = n
        self.embedding[slot] = embedding.reshape(-1).to(self.device, torch.float32)

    def copy_slot(self, src: int, dst: int, tokens: int) -> None:
        """dst holds src's state of its first `tokens` tokens (a speaker's prefix starting a stream)."""
        def part(e: Tensor, shape: EntryShape, slot: int) -> Tensor:
            return e[:, slot] if shape.kind == "conv" else e[:, slot, :shape.scale * tokens]
        torch._foreach_copy_([part(e, shape, dst) for e, shape in zip(self.entries, self.layout)],
                             [part(e, shape, src) for e, shape in zip(self.entries, self.layout)])
        for t in (self.prompt_feat, self.prompt_len, self.embedding, self.mel):
            t[dst].copy_(t[src])

    # -- speaker slots (LRU)

    def speaker(self, key: str, tokens: Tensor) -> int | None:
        """The speaker slot holding this prompt's prefix (the same tokens), or None."""
        with self._lock:
            item = self._speakers.get(key)
            if item is not None and torch.equal(item[1], tokens):
                self._speakers.move_to_end(key)
                self.stats.speaker_hits += 1
                return item[0]
            self.stats.speaker_misses += 1
            return None

    def speaker_slot(self, key: str, tokens: Tensor) -> int | None:
        """A slot for a speaker's prefix (evicting the least recently used), or None if the pool has none."""
        with self._lock:
            if key in self._speakers:
                slot = self._speakers.pop(key)[0]
            elif self._speaker_free:
                slot = self._speaker_free.pop()
            elif self._speakers:
                _, (slot, _) = self._speakers.popitem(last=False)
            else:
                return None
            self._speakers[key] = (slot, tokens.clone())
            return slot

    def drop(self, key: str) -> None:
        with self._lock:
            item = self._speakers.pop(key, None)
            if item is not None:
                self._speaker_free.append(item[0])

    def __contains__(self, key: str) -> bool:
        with self._lock:
            return key in self._speakers

    def __len__(self) -> int:
        with self._lock:
            return len(self._speakers)
