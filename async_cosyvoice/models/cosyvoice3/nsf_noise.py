"""CosyVoice3's NSF noise: fixed when upstream builds the vocoder, never drawn at inference.

Upstream's causal SineGen2 draws, in its constructor, `rand_ini = torch.rand(1, 9)` (harmonic 0's
phase then set to 0) and `sine_waves = torch.rand(1, 300 · 24000, 9)` (uniform [0, 1), not
Gaussian), from torch's global CPU generator while `cosyvoice3.yaml` builds the model. Neither is in
hift.pt. Every call then uses rand_ini as the initial phases and the first L rows of sine_waves as
the additive noise (scaled by the voicing), so a stream's chunks and a whole utterance agree.

The generator state at that point is a function of the model dims alone (golden/README.md §d):
`CausalConditionalCFM` re-seeds the generator with 0 and draws its own noise randn(1, 80,
noise_frames), then the flow's input_embedding and spk_embed_affine_layer and the vocoder's F0
predictor (5 convs and a linear) are initialised. `FixedNSFNoise.replay` repeats exactly those
draws under `torch.random.fork_rng` (the caller's generator is untouched). CPU uniform draws are
sequential, so the noise of any prefix length is the prefix of the full buffer: it is drawn lazily
(doubling) instead of holding upstream's 259 MB.
"""
from __future__ import annotations

import threading

import torch
from torch import Tensor, nn

from ..dims import DiTFlowDims, HiFTDims

MAX_SAMPLES = 300 * 24000  # upstream's buffer: 300 s at 24 kHz
_FIRST_DRAW = 24000 * 10


class FixedNSFNoise:
    """The vocoder's fixed NSF draws: `rand_ini` (1, dim) and the first L rows of the uniform
    sine-noise buffer (1, L, dim). `zeros()` is the noise-free source (what the zero-noise goldens use)."""

    def __init__(self, rand_ini: Tensor | None, state: Tensor | None, dim: int, max_samples: int = MAX_SAMPLES):
        """rand_ini (1, dim) (column 0 zero) and the CPU generator state right after it was drawn;
        both None: zeros."""
        self.rand_ini = rand_ini
        self._state = state
        self.dim = dim
        self.max_samples = max_samples
        self._noise = torch.empty(1, 0, dim, device="cpu")
        self._on_device: dict[torch.device, Tensor] = {}
        self._phases_on: dict[torch.device, Tensor] = {}
        self._lock = threading.Lock()

    @classmethod
    def zeros(cls, dim: int = 9) -> "FixedNSFNoise":
        return cls(None, None, dim)

    @property
    def is_zero(self) -> bool:
        return self.rand_ini is None

    @classmethod
    def from_generator_state(cls, state: Tensor, dim: int = 9, max_samples: int = MAX_SAMPLES) -> "FixedNSFNoise":
        """From the CPU generator state right before upstream's SineGen2 constructor."""
        g = torch.Generator().set_state(state)
        rand_ini = torch.rand(1, dim, generator=g, device="cpu")
        rand_ini[:, 0] = 0
        return cls(rand_ini, g.get_state(), dim, max_samples)

    @classmethod
    def replay(cls, flow: DiTFlowDims, hift: HiFTDims) -> "FixedNSFNoise":
        """Upstream's draws for a model of these dims (what `cosyvoice3.yaml` builds), on the CPU
        generator also inside `empty_init()` (a meta-device module draws nothing)."""
        with torch.random.fork_rng(devices=[]), torch.device("cpu"):
            torch.manual_seed(0)  # CausalConditionalCFM.__init__
            torch.randn(1, 80, flow.cfm.noise_frames)  # its rand_noise (80 channels, hard-coded upstream)
            nn.Embedding(flow.vocab_size, flow.input_size)
            nn.Linear(flow.spk_embed_dim, flow.output_size)
            nn.Conv1d(hift.f0_in_channels, hift.f0_cond_channels, 4)  # CausalConvRNNF0Predictor
            for _ in range(4):
                nn.Conv1d(hift.f0_cond_channels, hift.f0_cond_channels, 3)
            nn.Linear(hift.f0_cond_channels, hift.f0_num_class)
            state = torch.get_rng_state()
        return cls.from_generator_state(state, hift.nb_harmonics + 1)

    def phases(self, device: torch.device | str) -> Tensor | None:
        """rand_ini (1, dim) on `device`, copied there once (None for zeros). Do not modify it."""
        if self.is_zero:
            return None
        device = torch.device(device)
        with self._lock:
            if device not in self._phases_on:
                self._phases_on[device] = self.rand_ini.to(device)
            return self._phases_on[device]

    def sine_noise(self, length: int, device: torch.device | str) -> Tensor | None:
        """(1, length, dim) float32 on `device`: the buffer's first `length` rows (None for zeros).
        A view of a cached tensor: do not modify it."""
        if self.is_zero:
            return None
        if length > self.max_samples:
            raise ValueError(f"{length} samples exceed the vocoder's fixed NSF noise ({self.max_samples} samples, "
                             f"{self.max_samples / 24000:.0f} s at 24 kHz): split the text into shorter segments")
        device = torch.device(device)
        with self._lock:
            if self._noise.shape[1] < length:
                n = min(self.max_samples, max(length, 2 * self._noise.shape[1], _FIRST_DRAW))
                self._noise = torch.rand(1, n, self.dim, generator=torch.Generator().set_state(self._state))
                self._on_device.clear()
            cached = self._on_device.get(device)
            if cached is None or cached.shape[1] < length:
                cached = self._on_device[device] = self._noise.to(device)
        return cached[:, :length]
