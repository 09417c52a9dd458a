"""Running the flow on new frames only, against a cached prefix (the exact flow state cache).

Under the streaming chunk masks a frame attends to every frame before the end of its own chunk
and nothing after; convolutions are causal; the flow noise is fixed by absolute frame position.
So once a chunk is complete (all of its frames are inputs of a streaming call), every hidden state
of it — encoder keys/values, the causal convs' left context, and at every CFM step the
estimator's keys/values and conv context — is the same on every later streaming call. A cached
call computes only frames [start, end) of each item: queries are the new frames, keys are the
cached prefix followed by the new frames, and each causal conv reads its last `kernel − 1` input
frames before `start` from the cache.

The state of one item is a flat list of entries in the order the modules run (`Cursor`):
- a causal conv's left context: Tensor (rows, channels, kernel − 1) (None: zeros, the start);
- an attention layer's keys and values: (k_segments, v_segments), tuples of (rows, heads, n, d)
  tensors concatenated along frames (segments, so a speaker's prefix is shared, never copied).
`rows` is 1 in the encoder and 2 in the estimator (conditional, unconditional half).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import Tensor

Entry = Any  # Tensor | tuple[tuple[Tensor, ...], tuple[Tensor, ...]] | None


@dataclass
class Geometry:
    """Frames [start[b], end[b]) of item b are computed now (right-padded to N = max(end − start));
    frames before start[b] are cached; after the call frames before keep[b] are (start <= keep <= end)."""
    start: list[int]
    end: list[int]
    keep: list[int]
    device: torch.device

    def __post_init__(self):
        for s, e, k in zip(self.start, self.end, self.keep):
            if not 0 <= s <= k <= e:
                raise ValueError(f"need 0 <= start {s} <= keep {k} <= end {e}")
        self.B = len(self.start)
        self.new = [e - s for s, e in zip(self.start, self.end)]
        self.N = max(self.new)
        self.K = max(self.end)
        self._start = torch.tensor(self.start, device=self.device)
        self.new_lengths = torch.tensor(self.new, device=self.device)
        self._end = torch.tensor(self.end, device=self.device)
        self.index_cache: dict = {}  # gather indices and masks, made once per call for every layer and CFM step

    @property
    def span(self) -> int:
        """Positions a relative-position table must cover: every query - key distance."""
        return max(max(self.start) + self.N, self.K)

    def scaled(self, factor: int) -> "Geometry":
        return Geometry([factor * s for s in self.start], [factor * e for e in self.end],
                        [factor * k for k in self.keep], self.device)

    def valid(self) -> Tensor:
        """(B, N) bool: the item's new frames."""
        return torch.arange(self.N, device=self.device) < self.new_lengths.unsqueeze(1)

    def positions(self) -> Tensor:
        """(B, N) absolute position of each new frame."""
        return self._start.unsqueeze(1) + torch.arange(self.N, device=self.device)

    def attention_mask(self, chunk: int) -> Tensor:
        """(B, N, K) bool: new frame i (absolute) sees key j < end[b] in its own chunk or before.
        Padded query rows see the item's keys, so no row is fully masked."""
        i = self.positions().unsqueeze(2)
        j = torch.arange(self.K, device=self.device)
        chunk_end = (torch.div(i, chunk, rounding_mode="floor") + 1) * chunk
        return (j < self._end.view(-1, 1, 1)) & ((j < chunk_end) | ~self.valid().unsqueeze(2))

    def rows(self, b: int) -> slice:
        """Item b's rows of a (rows·B, …) batch: b, B + b, …"""
        return slice(b, None, self.B)


class Cursor:
    """One cached call's walk through its items' states, in module order: each causal conv and each
    attention layer takes the next entry of every item and leaves the entry for the next call.

    Every layer does a fixed number of tensor ops whatever the number of items (one gather builds
    the padded keys of all items; one gather takes the frames to keep), so a batch of many streams
    costs few kernel launches. The kept frames of all items of one layer are one tensor per call;
    each item's segment is a view of it.
    """

    def __init__(self, states: Sequence[Sequence[Entry] | None]):
        self.states = states
        self.pos = 0
        self.out: list[list[Entry]] = [[] for _ in states]

    def _take(self) -> list[Entry]:
        i, self.pos = self.pos, self.pos + 1
        return [None if s is None else s[i] for s in self.states]

    def conv(self, x: Tensor, context: int, g: Geometry) -> Tensor:
        """x (rows·B, C, N) new frames -> (rows·B, C, context + N): each item's cached left context
        (zeros at the sequence start) then x. Records each item's context before keep[b]."""
        old = self._take()
        R, C, N = x.shape[0] // g.B, x.shape[1], x.shape[2]
        zeros = x.new_zeros(R, C, context)
        ctx = torch.stack([zeros if c is None else c for c in old], dim=1).reshape(R * g.B, C, context)
        xc = torch.cat([ctx, x], dim=2)
        key = ("conv", context)
        index = g.index_cache.get(key)
        if index is None:
            first = torch.tensor([k - s for s, k in zip(g.start, g.keep)], device=x.device)
            index = g.index_cache[key] = (first.view(-1, 1) + torch.arange(context, device=x.device)).view(1, -1, 1, context)
        taken = xc.view(R, g.B, C, context + N).gather(3, index.expand(R, g.B, C, context))
        for b, c in enumerate(old):
            self.out[b].append(taken[:, b] if g.keep[b] > g.start[b] else c)
        return xc

    def attention(self, k: Tensor, v: Tensor, g: Geometry) -> tuple[Tensor, Tensor]:
        """k, v (rows·B, H, N, d) of the new frames -> (rows·B, H, K, d): each item's cached keys
        (values) at [0, start[b]), its new ones at [start[b], end[b]), zeros after. Records
        the keys before keep[b] (the cached segments plus the new frames up to keep[b])."""
        old = self._take()
        segments = [((), ()) if e is None else e for e in old]
        lengths = tuple(tuple(t.shape[2] for t in ks) for ks, _ in segments)
        for b, n in enumerate(lengths):
            if sum(n) != g.start[b]:
                raise RuntimeError(f"cached keys cover {sum(n)} frames, the call starts at {g.start[b]}")
        gather, kept = self._attention_index(g, lengths, k.device)
        out = []
        for new, part in ((k, 0), (v, 1)):
            R, H, N, d = new.shape[0] // g.B, new.shape[1], new.shape[2], new.shape[3]
            new = new.view(R, g.B, H, N, d).transpose(1, 2).reshape(R, H, g.B * N, d)
            flat = torch.cat([t for seg in segments for t in seg[part]] + [new, new.new_zeros(R, H, 1, d)], dim=2)
            full = flat.index_select(2, gather).view(R, H, g.B, g.K, d).transpose(1, 2).reshape(R * g.B, H, g.K, d)
            keep = flat.index_select(2, kept[0]).split(kept[1], dim=2) if kept[1] else ()
            out.append((full, keep))
        (K, k_keep), (V, v_keep) = out
        i = 0
        for b, (ks, vs) in enumerate(segments):
            if g.keep[b] > g.start[b]:
                ks, vs = ks + (k_keep[i],), vs + (v_keep[i],)
                i += 1
            self.out[b].append((ks, vs))
        return K, V

    def _attention_index(self, g: Geometry, lengths: tuple, device) -> tuple[Tensor, tuple[Tensor, list[int]]]:
        """Indices into the flat [cached segments of every item, new frames of every item, one zero
        frame]: the (B·K) frames of the padded keys, and the frames kept (with each item's count)."""
        key = ("attention", lengths)
        if key in g.index_cache:
            return g.index_cache[key]
        cached_total = sum(g.start)
        new_base, zero = cached_total, cached_total + g.B * g.N
        rows, kept, counts, offset = [], [], [], 0
        for b in range(g.B):
            s, e = g.start[b], g.end[b]
            rows.append(torch.cat([torch.arange(offset, offset + s), new_base + b * g.N + torch.arange(e - s),
                                   torch.full((g.K - e,), zero)]))
            offset += s
            if g.keep[b] > s:
                kept.append(new_base + b * g.N + torch.arange(g.keep[b] - s))
                counts.append(g.keep[b] - s)
        gather = torch.cat(rows).to(device)
        kept_index = torch.cat(kept).to(device) if kept else torch.zeros(0, dtype=torch.long, device=device)
        g.index_cache[key] = (gather, (kept_index, counts))
        return g.index_cache[key]


class SlotGeometry:
    """A cached call over state slots (token2wav/state_pool.py), with nothing read back to the host:
    item b computes positions [start[b], end[b]) of the sequence held in slot slots[b] and keeps
    [0, keep[b]) there. N (new positions, right-padded) and K (the key positions every item attends
    over: a bucket >= every item's end, at most a slot's capacity) are fixed, so a call of given
    (B, N, K) is one CUDA graph whatever its items' positions. Padding items name slot 0, a scratch
    slot no stream owns; their writes land there."""

    def __init__(self, slots: Tensor, start: Tensor, end: Tensor, keep: Tensor, N: int, K: int):
        self.slots, self.start, self.end, self.keep = slots, start, end, keep
        self.B, self.N, self.K = slots.numel(), N, K
        self.new_lengths = end - start
        self.index_cache: dict = {}

    @property
    def device(self) -> torch.device:
        return self.slots.device

    @property
    def span(self) -> int:
        return self.K + self.N

    def scaled(self, factor: int) -> "SlotGeometry":
        return SlotGeometry(self.slots, factor * self.start, factor * self.end, factor * self.keep,
                            factor * self.N, factor * self.K)

    def valid(self) -> Tensor:
        return torch.arange(self.N, device=self.device) < self.new_lengths.unsqueeze(1)

    def positions(self) -> Tensor:
        return self.start.unsqueeze(1) + torch.arange(self.N, device=self.device)

    def attention_mask(self, chunk: int) -> Tensor:
        """(B, N, K) bool, as Geometry's; key 0 is always allowed, so a padding item's rows
        (end 0) are not fully masked (a real item's first key is allowed anyway)."""
        i = self.positions().unsqueeze(2)
        j = torch.arange(self.K, device=self.device)
        chunk_end = (torch.div(i, chunk, rounding_mode="floor") + 1) * chunk
        allowed = (j < self.end.view(-1, 1, 1)) & ((j < chunk_end) | ~self.valid().unsqueeze(2))
        return allowed | (j == 0)

    def rows(self, R: int, S: int) -> tuple[Tensor, Tensor, Tensor]:
        """For the R·B rows of a (rows·B, …) batch: each row's (row, slot) and its index into a
        slot tensor (R, S, …) viewed as (R·S, …)."""
        key = ("rows", R, S)
        if key not in self.index_cache:
            row = torch.arange(R, device=self.device).repeat_interleave(self.B)
            slot = self.slots.repeat(R)
            self.index_cache[key] = (row, slot, row * S + slot)
        return self.index_cache[key]


class SlotCursor:
    """A cached call's walk through state slots, in module order (the same order as `Cursor`).

    Each entry is one contiguous tensor: a causal conv's left context (rows, S, C, context); an
    attention layer's keys and values, two entries (rows, S, K, heads, d). Rows first, so each
    (row, slot)'s state is one contiguous block and reading a batch's is a block copy. A conv reads
    its items' context before start (zeros where start is 0) and writes the context before keep;
    an attention layer writes the new keys and values at their positions, then attends over the
    slot's first K positions (g.K: the call's key bucket; the mask hides those at or past end), so
    a call reads what its items have filled, not the slots' capacity. Only tensor ops: capturable.
    """

    def __init__(self, entries: Sequence[Tensor]):
        self.entries = entries
        self.pos = 0

    def _take(self) -> Tensor:
        i, self.pos = self.pos, self.pos + 1
        return self.entries[i]

    def conv(self, x: Tensor, context: int, g: SlotGeometry) -> Tensor:
        state = self._take()
        R, S = state.shape[0], state.shape[1]
        _, _, flat = g.rows(R, S)
        state = state.view(R * S, *state.shape[2:])
        fresh = (g.start == 0).repeat(R).view(-1, 1, 1)
        ctx = torch.where(fresh, torch.zeros((), dtype=x.dtype, device=x.device), state.index_select(0, flat))
        xc = torch.cat([ctx, x], dim=2)
        first = (g.keep - g.start).repeat(R).view(-1, 1, 1) + torch.arange(context, device=x.device)
        state.index_copy_(0, flat, xc.gather(2, first.expand(-1, xc.shape[1], -1)))
        return xc

    def attention(self, k: Tensor, v: Tensor, g: SlotGeometry) -> tuple[Tensor, Tensor]:
        out = []
        for new in (k, v):
            state = self._take()
            R, S, capacity, N = state.shape[0], state.shape[1], state.shape[2], new.shape[2]
            row, slot, flat = g.rows(R, S)
            at = g.positions().clamp(max=capacity - 1).repeat(R, 1)  # padding past the end: the spare last position
            state.index_put_((row.view(-1, 1).expand(-1, N), slot.view(-1, 1).expand(-1, N), at), new.transpose(1, 2))
            out.append(state.view(R * S, *state.shape[2:])[:, :g.K].index_select(0, flat).transpose(1, 2))
        return out[0], out[1]


@dataclass(frozen=True)
class EntryShape:
    """One state entry of a cached call: a conv's context or an attention layer's keys or values."""
    kind: str                 # "conv" or "attention"
    shape: tuple[int, ...]    # per slot: (rows, C, context) or (rows, heads, d)
    scale: int                # attention: positions per token (1 in the encoder's token layers)


class LayoutCursor:
    """Records the entries a cached call walks (for sizing a state pool), computing nothing cached:
    run on a call with no cached prefix."""

    def __init__(self, n_tokens: int):
        self.n_tokens = n_tokens
        self.entries: list[EntryShape] = []

    @property
    def pos(self) -> int:
        """Entries walked so far (as Cursor.pos and SlotCursor.pos)."""
        return len(self.entries)

    def conv(self, x: Tensor, context: int, g) -> Tensor:
        R = x.shape[0] // g.B
        self.entries.append(EntryShape("conv", (R, x.shape[1], context), 1))
        return torch.cat([x.new_zeros(x.shape[0], x.shape[1], context), x], dim=2)

    def attention(self, k: Tensor, v: Tensor, g) -> tuple[Tensor, Tensor]:
        R, H, N, d = k.shape[0] // g.B, k.shape[1], k.shape[2], k.shape[3]
        for _ in (k, v):
            self.entries.append(EntryShape("attention", (R, H, d), N // self.n_tokens))
        return k, v


@dataclass(frozen=True, eq=False)
class FlowState:
    """What a streaming flow call leaves for the next one: the state of the first `tokens` tokens
    (prompt + target, a multiple of the encoder chunk). Immutable: a later call makes a new one
    that shares these tensors, so a speaker's prefix can start many streams."""
    tokens: int
    encoder: tuple[Entry, ...]
    steps: tuple[tuple[Entry, ...], ...]  # the estimator's entries at each CFM step
    mel: tuple[Tensor, ...]  # the flow output (1, 80, n) of frames [0, ratio·tokens), in segments

    def tensors(self) -> list[Tensor]:
        out = list(self.mel)
        for entry in (*self.encoder, *(e for step in self.steps for e in step)):
            if isinstance(entry, Tensor):
                out.append(entry)
            elif entry is not None:
                out.extend(t for part in entry for t in part)
        return out

    def nbytes(self, excluding: "FlowState | None" = None) -> int:
        """Bytes of this state's tensors, less those it shares with `excluding`."""
        shared = {id(t) for t in excluding.tensors()} if excluding is not None else set()
        return sum(t.numel() * t.element_size() for t in self.tensors() if id(t) not in shared)
