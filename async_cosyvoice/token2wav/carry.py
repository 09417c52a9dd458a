"""A stream's vocoder state between chunks, one kind per vocoder. Both have the same two halves:
`hift_input(new_mel, finalize, speed)` before the vocoder (pure: the vocoder's input and, for
CosyVoice2, its cache_source) and `finish(mel, speech, source, finalize)` after it (updates the
carry, returns the samples to emit).

- `CrossfadeCarry` (CosyVoice2's HiFT, upstream CosyVoice2Model.token2wav): 8 mel frames, 3840
  source and 3840 speech samples go from chunk to chunk; each new chunk's first 3840 samples are
  cross-faded with the held-back tail (Hamming(7680) halves, computed in float64) and every
  non-final chunk withholds its last 3840 samples. A first chunk shorter than the cache (first hop
  < 4 tokens, which upstream cannot run) is held back whole and the next cross-fade is as long as
  what was held.
- `CausalCarry` (CosyVoice3's causal HiFT, upstream CosyVoice3Model.token2wav): every mel frame so
  far; each chunk re-vocodes all of it (models/cosyvoice3/hift.py: a non-final call holds back 7
  frames of look-ahead and 480 samples) and emits the samples past the previous end; no source
  cache, no cross-fade.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from .schedule import ChunkSchedule

__all__ = ["VocoderCarry", "CrossfadeCarry", "CausalCarry", "crossfade"]


@functools.lru_cache(maxsize=8)
def _hamming64(n: int) -> Tensor:
    return torch.from_numpy(np.hamming(n))  # float64, symmetric, like upstream's speech_window


def crossfade(new: Tensor, old_tail: Tensor) -> Tensor:
    """Fade the head of `new` (…, L') in over `old_tail` (…, L): new[:L]*w[:L] + old*w[L:],
    w = Hamming(2L) in float64, result in new's dtype. Returns a new tensor."""
    n = old_tail.shape[-1]
    w = _hamming64(2 * n).to(new.device)
    head = new[..., :n].double() * w[:n] + old_tail.double() * w[n:]
    return torch.cat([head.to(new.dtype), new[..., n:]], dim=-1)


def _speed(mel: Tensor, speed: float) -> Tensor:
    return F.interpolate(mel, size=int(mel.shape[2] / speed), mode="linear")


class VocoderCarry(Protocol):
    def hift_input(self, new_mel: Tensor, finalize: bool, speed: float = 1.0) -> tuple[Tensor, Tensor | None]:
        """The flow's new frames (1, 80, n) -> (the vocoder's mel, cache_source or None). Pure."""
        ...

    def finish(self, mel: Tensor, speech: Tensor, source: Tensor | None, finalize: bool) -> Tensor:
        """The vocoder's output for `mel` -> the samples to emit (1, n); updates the carry."""
        ...


@dataclass
class _Tail:
    mel: Tensor     # (1, 80, mel_cache_len)
    source: Tensor  # (1, 1, source_cache_len)
    speech: Tensor  # (1, source_cache_len), after its own cross-fade


class CrossfadeCarry:
    def __init__(self, schedule: ChunkSchedule):
        self.schedule = schedule
        self._tail: _Tail | None = None

    def hift_input(self, new_mel: Tensor, finalize: bool, speed: float = 1.0) -> tuple[Tensor, Tensor | None]:
        if self._tail is not None:
            return torch.cat([self._tail.mel.to(new_mel.device, new_mel.dtype), new_mel], dim=2), self._tail.source
        if finalize and speed != 1.0:
            return _speed(new_mel, speed), None
        return new_mel, None

    def finish(self, mel: Tensor, speech: Tensor, source: Tensor | None, finalize: bool) -> Tensor:
        if self._tail is not None:
            speech = crossfade(speech, self._tail.speech.to(speech.device))
        if finalize:
            self._tail = None
            return speech
        keep = self.schedule.source_cache_len
        # clones: the outputs may be views into a batch the carry must not keep alive
        self._tail = _Tail(mel=mel[:, :, -self.schedule.mel_cache_len:].clone(), source=source[:, :, -keep:].clone(),
                           speech=speech[:, -keep:].clone())
        return speech[:, :-keep]


class CausalCarry:
    def __init__(self):
        self.mel: Tensor | None = None  # (1, 80, frames so far)
        self.samples_out = 0

    def hift_input(self, new_mel: Tensor, finalize: bool, speed: float = 1.0) -> tuple[Tensor, Tensor | None]:
        mel = new_mel if self.mel is None else torch.cat([self.mel.to(new_mel.device, new_mel.dtype), new_mel], dim=2)
        if speed != 1.0:
            if self.mel is not None or not finalize:
                raise ValueError("speed != 1 needs a single, final call (non-streaming), as upstream")
            mel = _speed(mel, speed)
        return mel, None

    def finish(self, mel: Tensor, speech: Tensor, source: Tensor | None, finalize: bool) -> Tensor:
        out = speech[:, self.samples_out:]
        self.mel = mel
        self.samples_out += out.shape[1]
        return out
