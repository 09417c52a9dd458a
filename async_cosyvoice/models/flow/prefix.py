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
    attention layer takes the next entry of every item and leaves the entry for the next call."""

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
        xc = torch.cat([x.new_zeros(x.shape[0], x.shape[1], context), x], dim=2)
        for b, ctx in enumerate(old):
            if ctx is not None:
                xc[g.rows(b), :, :context] = ctx
        for b, ctx in enumerate(old):
            n = g.keep[b] - g.start[b]
            self.out[b].append(xc[g.rows(b), :, n:n + context].clone() if n > 0 else ctx)
        return xc

    def attention(self, k: Tensor, v: Tensor, g: Geometry) -> tuple[Tensor, Tensor]:
        """k, v (rows·B, H, N, d) of the new frames -> (rows·B, H, K, d): each item's cached keys
        (values) at [0, start[b]), its new ones at [start[b], end[b]), zeros after. Records
        the keys before keep[b] (the cached segments plus the new frames up to keep[b])."""
        old = self._take()
        R, H, _, d = k.shape
        K = k.new_zeros(R, H, g.K, d)
        V = v.new_zeros(R, H, g.K, d)
        for b, entry in enumerate(old):
            rows, s, e = g.rows(b), g.start[b], g.end[b]
            if entry is not None:
                at = 0
                for ks, vs in zip(*entry):
                    K[rows, :, at:at + ks.shape[2]] = ks
                    V[rows, :, at:at + vs.shape[2]] = vs
                    at += ks.shape[2]
                if at != s:
                    raise RuntimeError(f"cached keys cover {at} frames, the call starts at {s}")
            K[rows, :, s:e] = k[rows, :, :e - s]
            V[rows, :, s:e] = v[rows, :, :e - s]
            kept = g.keep[b]
            if kept > s:
                ks, vs = entry if entry is not None else ((), ())
                entry = (ks + (K[rows, :, s:kept].clone(),), vs + (V[rows, :, s:kept].clone(),))
            self.out[b].append(entry if entry is not None else ((), ()))
        return K, V


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
