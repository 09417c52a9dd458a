"""A CosyVoice3 stream's vocoder state between chunks (upstream CosyVoice3Model.token2wav's
`hift_cache_dict`): every mel frame so far and how many samples are out.

CosyVoice3's vocoder is causal (models/cosyvoice3/hift.py), so each chunk re-vocodes the whole
accumulated mel (non-final: its last 7 frames are look-ahead only and the last 480 samples are
held back) and emits the samples past the previous end; no source cache, no cross-fade (CosyVoice2's
carry is in stream.py). Same two halves as Token2WavStream's: `hift_input` before the vocoder
(pure), `finish` after it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


class CausalVocoderCarry:
    def __init__(self):
        self.mel: Tensor | None = None  # (1, 80, frames so far)
        self.samples_out = 0

    def hift_input(self, new_mel: Tensor, finalize: bool, speed: float = 1.0) -> Tensor:
        """The flow's new frames (1, 80, n) -> the vocoder's input: every frame so far. `speed` != 1
        (a non-streaming call only, as upstream) resamples the mel linearly. Changes nothing."""
        mel = new_mel if self.mel is None else torch.cat([self.mel.to(new_mel.device, new_mel.dtype), new_mel], dim=2)
        if speed != 1.0:
            if self.mel is not None or not finalize:
                raise ValueError("speed != 1 needs a single, final call (non-streaming), as upstream")
            mel = F.interpolate(mel, size=int(mel.shape[2] / speed), mode="linear")
        return mel

    def finish(self, mel: Tensor, speech: Tensor) -> Tensor:
        """Apply a call's vocoder output: mel (1, 80, T) as returned by `hift_input`, speech (1, S) the
        vocoder's samples for it. Returns the samples past the previous call's end (1-D)."""
        out = speech[0, self.samples_out:]
        self.mel = mel
        self.samples_out += out.numel()
        return out
