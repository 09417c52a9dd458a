"""HiFT vocoder: mel (50 Hz) -> 24 kHz waveform, weight-compatible with the official `hift.pt`.

Parameter names are the `hift.pt` keys with the optional `generator.` prefix stripped and the
weight norm folded into a plain `weight` (W = g * v / ||v||, norm over every dim but 0), so a
folded state dict loads with `strict=True`. Pipeline (facts sheet §4.2, §10 item 14):

    mel -> F0 (ConvRNNF0Predictor, Hz) -> nearest x480 -> NSF source (SineGen2 harmonics, tanh)
        -> [cache_source overwrites the head] -> STFT (n_fft 16, hop 4) = 18 channels
    mel -> conv_pre -> 3 x (leaky_relu 0.1, transposed conv, [reflection pad after the last],
                            + source branch, mean of 3 Snake resblocks)
        -> leaky_relu 0.01 -> conv_post -> exp(mag) <= 100, sin(phase) -> iSTFT -> clamp

The NSF source is numerically fragile (the phase reaches 1e3-1e4 rad in float32), so SineGen2
keeps upstream's operation order exactly. Its random draws (initial harmonic phases and additive
noise) are controlled by `NSFNoise`.

`inference` batches items of the same number of mel frames; a batched item then equals its own
call up to float summation order (~1e-6). Items of different lengths go through
`inference_padded` (offline batches; streaming chunks of many streams, with their caches; and
`render_padded`, its device half, is what token2wav/hift_graphs.py captures as CUDA graphs): right-padded,
with every convolution's input masked to the item's length (so each conv sees the zeros its own
padding would give), the NSF phase holding each item's last phase over the padding (an item's own
call clamps its interpolation there), each item's cache_source over its head, the source's STFT
fed the item's own reflection at its end, and the last iSTFT samples (whose window envelope would
count padded frames) recomputed from the item's last frames. Each item then equals its own
`inference` call up to float summation order. The iSTFT is written out (`istft`) because
torch.istft reads its window envelope back to the host, which a CUDA graph cannot capture.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .dims import HiFTDims


# --------------------------------------------------------------------------- noise control


@dataclass(frozen=True, eq=False)
class NSFNoise:
    """Where SineGen2's random draws come from.

    Upstream draws, per call and in this order: `rand(B, 9)` initial phases (harmonic 0 then
    set to 0), `randn(B, L, 9)` additive sine noise, and `randn(B, L, 1)` (computed by the source
    module but unused). `kind`:

    - "random": from `generator` (None: torch's default generator for the draw device). The
      unused third draw is made too, so a generator seeded like upstream's global RNG yields
      upstream's numbers call after call.
    - "zero": every draw is zero (deterministic; what the zero-noise goldens use).
    - "given": `rand_ini` (B, 9) raw uniform draws (element 0 of each row is ignored) and
      `sine_noise` (B, L, 9) standard normal draws are injected.
    """
    kind: str = "random"
    generator: torch.Generator | None = None
    rand_ini: Tensor | None = None
    sine_noise: Tensor | None = None

    def __post_init__(self):
        if self.kind not in ("random", "zero", "given"):
            raise ValueError(f"NSFNoise.kind must be 'random', 'zero' or 'given', got {self.kind!r}")
        if self.kind == "given" and (self.rand_ini is None or self.sine_noise is None):
            raise ValueError("NSFNoise(kind='given') needs both rand_ini and sine_noise")

    @classmethod
    def zero(cls) -> "NSFNoise":
        return cls(kind="zero")

    @classmethod
    def given(cls, rand_ini: Tensor, sine_noise: Tensor) -> "NSFNoise":
        return cls(kind="given", rand_ini=rand_ini, sine_noise=sine_noise)

    @classmethod
    def random(cls, generator: torch.Generator | None = None) -> "NSFNoise":
        return cls(kind="random", generator=generator)

    def draw(self, batch: int, length: int, dim: int, device: torch.device) -> tuple[Tensor | None, Tensor | None]:
        """(rand_ini (batch, dim) with column 0 zeroed, sine_noise (batch, length, dim)), float32
        on `device`; (None, None) for kind "zero"."""
        if self.kind == "zero":
            return None, None
        if self.kind == "given":
            rand_ini, noise = self.rand_ini, self.sine_noise
            if tuple(rand_ini.shape) != (batch, dim) or tuple(noise.shape) != (batch, length, dim):
                raise ValueError(
                    f"injected NSF draws have shapes {tuple(rand_ini.shape)} / {tuple(noise.shape)}, "
                    f"expected ({batch}, {dim}) / ({batch}, {length}, {dim})")
            rand_ini = rand_ini.to(device=device, dtype=torch.float32, copy=True)
            noise = noise.to(device=device, dtype=torch.float32)
        else:
            g = self.generator
            draw_device = g.device if g is not None else device
            rand_ini = torch.rand(batch, dim, generator=g, device=draw_device)
            # Upstream's randn_like runs on a (B, L, dim) view of a (B, dim, L) buffer; on CPU a
            # non-contiguous fill takes a different kernel, so reproduce that layout exactly.
            noise = torch.empty(batch, dim, length, device=draw_device).transpose(1, 2).normal_(generator=g)
            torch.randn(batch, length, 1, generator=g, device=draw_device)  # upstream's unused draw
            rand_ini, noise = rand_ini.to(device), noise.to(device)
        rand_ini[:, 0] = 0.0
        return rand_ini, noise


NoiseSpec = NSFNoise | Sequence[NSFNoise] | None


def _draw_noise(noise: NoiseSpec, batch: int, length: int, dim: int, device: torch.device):
    """One NSFNoise for the whole batch, or one per row (each row drawn as a batch of one)."""
    if noise is None:
        noise = NSFNoise()
    if isinstance(noise, NSFNoise):
        return noise.draw(batch, length, dim, device)
    if len(noise) != batch:
        raise ValueError(f"got {len(noise)} NSFNoise entries for a batch of {batch}")
    rows = [n.draw(1, length, dim, device) for n in noise]
    if all(r[0] is None for r in rows):
        return None, None
    ini = torch.cat([r[0] if r[0] is not None else torch.zeros(1, dim, device=device) for r in rows])
    nz = torch.cat([r[1] if r[1] is not None else torch.zeros(1, length, dim, device=device) for r in rows])
    return ini, nz


def istft(spec: Tensor, hop: int, window: Tensor) -> Tensor:
    """torch.istft(spec, n_fft, hop, n_fft, window, center=True) for a onesided (B, n_fft/2+1, N)
    spectrum, written out (inverse FFT, window, overlap-add, divide by the window envelope)
    without torch.istft's check that the envelope is non-zero: that check reads the envelope back
    to the host, which a CUDA graph cannot capture. A periodic Hann window with hop <= n_fft/2
    (HiFT's) has no zero in the envelope."""
    n_fft = window.numel()
    n_frames = spec.shape[2]
    frames = torch.fft.irfft(spec, n=n_fft, dim=1) * window.view(1, -1, 1)
    total = n_fft + hop * (n_frames - 1)
    y = F.fold(frames, (1, total), (1, n_fft), stride=(1, hop))[:, 0, 0]
    envelope = F.fold(window.square().view(1, -1, 1).expand(1, -1, n_frames), (1, total), (1, n_fft),
                      stride=(1, hop))[0, 0, 0]
    pad = n_fft // 2
    return y[:, pad:total - pad] / envelope[pad:total - pad]


def reflect_after_ends(source: Tensor, ends: Tensor, n: int) -> Tensor:
    """Right-padded sources (B, 1, L), item b's valid up to ends[b] samples: the n samples after
    each end become that item's own STFT reflection (center=True: sample end + k is sample
    end − 2 − k), what the STFT of the item's own call reads there."""
    ends = ends.view(-1, 1, 1)
    at = torch.arange(source.shape[2], device=source.device).view(1, 1, -1)
    reflected = (at >= ends) & (at < ends + n)
    index = torch.where(reflected, 2 * ends - 2 - at, at).clamp(0, source.shape[2] - 1)
    return source.gather(2, index.expand(source.shape[0], 1, -1))


def recompute_tails(speech: Tensor, spec: Tensor, frames: Tensor, hop: int, window: Tensor) -> Tensor:
    """`istft` of right-padded spectra (B, bins, N), item b's first frames[b] frames its own: the
    last n_fft samples before each item's end (hop·(frames[b] − 1)), whose window envelope counted
    the padded frames, recomputed from the item's last frames alone, where the envelope is its own
    call's. Returns a new tensor; no host syncs."""
    n_fft, bins = window.numel(), spec.shape[1]
    k = n_fft // hop + 4
    idx = (frames - k).clamp(min=0).unsqueeze(1) + torch.arange(k, device=spec.device)
    tail = istft(torch.gather(spec, 2, idx.unsqueeze(1).expand(-1, bins, -1)), hop, window)
    keep = n_fft  # the tail call's last samples are far from its own left edge
    ends = (frames - 1) * hop
    pos = (ends.unsqueeze(1) - keep + torch.arange(keep, device=spec.device)).clamp(min=0)
    return speech.scatter(1, pos, tail[:, -keep:])


# --------------------------------------------------------------------------- F0 and source


class ConvRNNF0Predictor(nn.Module):
    """5 x (Conv1d k3 + ELU) then Linear -> |f0| in Hz at the mel rate: (B, 80, T) -> (B, T)."""

    def __init__(self, num_class: int = 1, in_channels: int = 80, cond_channels: int = 512):
        super().__init__()
        layers: list[nn.Module] = []
        for i in range(5):
            layers += [nn.Conv1d(in_channels if i == 0 else cond_channels, cond_channels, 3, padding=1), nn.ELU()]
        self.condnet = nn.Sequential(*layers)
        self.classifier = nn.Linear(cond_channels, num_class)

    def forward(self, mel: Tensor, mask: Tensor | None = None) -> Tensor:
        """mask (B, 1, T): right-padded items; every conv input is zeroed past the item's frames."""
        h = mel
        for layer in self.condnet:
            h = layer(h * mask if mask is not None and isinstance(layer, nn.Conv1d) else h)
        return torch.abs(self.classifier(h.transpose(1, 2)).squeeze(-1))


class SineGen2(nn.Module):
    """Harmonic sine source at the sample rate from an upsampled f0 (B, L, 1). causal (CosyVoice3):
    the frame-rate phase is brought back to the sample rate by repetition instead of linear
    interpolation, so no sample depends on a later frame."""

    def __init__(self, sampling_rate: int, upsample_scale: int, harmonic_num: int,
                 sine_amp: float, noise_std: float, voiced_threshold: float, causal: bool = False):
        super().__init__()
        self.causal = causal
        self.sampling_rate = sampling_rate
        self.upsample_scale = upsample_scale
        self.dim = harmonic_num + 1
        self.sine_amp = sine_amp
        self.noise_std = noise_std
        self.voiced_threshold = voiced_threshold

    def _phase_sines(self, f0_harm: Tensor, rand_ini: Tensor | None, frames: Tensor | None) -> Tensor:
        # Per-sample phase increment in cycles, then upstream's order: linear down to the frame
        # rate, cumulative sum, x2 x pi, x480, linear back up to the sample rate, sin.
        rad = (f0_harm / self.sampling_rate) % 1
        if rand_ini is not None:
            rad[:, 0, :] = rad[:, 0, :] + rand_ini
        rad = F.interpolate(rad.transpose(1, 2), scale_factor=1 / self.upsample_scale, mode="linear").transpose(1, 2)
        phase = torch.cumsum(rad, dim=1) * 2 * math.pi
        if frames is not None:
            # Right-padded items: an item's own call interpolates its last half frame against its
            # last phase (the interpolation clamps at its end); the padding must hold that phase.
            last = phase.gather(1, (frames - 1).clamp(min=0).view(-1, 1, 1).expand(-1, 1, phase.shape[2]))
            inside = torch.arange(phase.shape[1], device=phase.device).view(1, -1, 1) < frames.view(-1, 1, 1)
            phase = torch.where(inside, phase, last)
        phase = F.interpolate(phase.transpose(1, 2) * self.upsample_scale, scale_factor=self.upsample_scale,
                              mode="nearest" if self.causal else "linear").transpose(1, 2)
        return torch.sin(phase)

    def forward(self, f0: Tensor, noise: NoiseSpec = None) -> tuple[Tensor, Tensor]:
        """f0 (B, L, 1) Hz -> (sine waves (B, L, harmonics+1), uv (B, L, 1))."""
        batch, length, _ = f0.shape
        rand_ini, sine_noise = _draw_noise(noise, batch, length, self.dim, f0.device)
        return self.with_draws(f0, rand_ini, sine_noise)

    def with_draws(self, f0: Tensor, rand_ini: Tensor | None, sine_noise: Tensor | None,
                   frames: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """`forward` with its random draws given (`NSFNoise.draw`'s). frames (B,): right-padded
        items' lengths in mel frames (f0 is at 480 samples a frame); None: every item is whole."""
        harmonics = torch.arange(1, self.dim + 1, dtype=torch.float32, device=f0.device).view(1, 1, -1)
        sines = self._phase_sines(f0 * harmonics, rand_ini, frames) * self.sine_amp
        uv = (f0 > self.voiced_threshold).to(torch.float32)
        if sine_noise is None:
            return sines * uv, uv
        noise_amp = uv * self.noise_std + (1 - uv) * self.sine_amp / 3
        return sines * uv + noise_amp * sine_noise, uv


class SourceModuleHnNSF(nn.Module):
    """Harmonic-plus-noise source: tanh(Linear(9 -> 1)(SineGen2(f0)))."""

    def __init__(self, sampling_rate: int, upsample_scale: int, harmonic_num: int,
                 sine_amp: float, noise_std: float, voiced_threshold: float, causal: bool = False):
        super().__init__()
        self.l_sin_gen = SineGen2(sampling_rate, upsample_scale, harmonic_num, sine_amp, noise_std, voiced_threshold,
                                  causal)
        self.l_linear = nn.Linear(harmonic_num + 1, 1)

    def forward(self, f0: Tensor, noise: NoiseSpec = None) -> Tensor:
        """f0 (B, L, 1) -> source (B, L, 1)."""
        sines, _ = self.l_sin_gen(f0, noise)
        return torch.tanh(self.l_linear(sines))

    def with_draws(self, f0: Tensor, rand_ini: Tensor | None, sine_noise: Tensor | None,
                   frames: Tensor | None = None) -> Tensor:
        """`forward` with the sine generator's draws given (SineGen2.with_draws)."""
        sines, _ = self.l_sin_gen.with_draws(f0, rand_ini, sine_noise, frames)
        return torch.tanh(self.l_linear(sines))


# --------------------------------------------------------------------------- generator blocks


class Snake(nn.Module):
    """x + sin^2(alpha x) / alpha, alpha per channel (linear scale)."""

    def __init__(self, channels: int):
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(channels))

    def forward(self, x: Tensor) -> Tensor:
        alpha = self.alpha.view(1, -1, 1)
        return x + (1.0 / (alpha + 1e-9)) * torch.pow(torch.sin(x * alpha), 2)


class ResBlock(nn.Module):
    """For each dilation d: x += conv2(Snake(conv1_d(Snake(x)))), 'same' padding; causal (CosyVoice3):
    each conv sees only its (kernel − 1)·dilation frames before (zeros at the start)."""

    def __init__(self, channels: int, kernel_size: int, dilations: Sequence[int], causal: bool = False):
        super().__init__()
        self.causal = causal

        def conv(d: int) -> nn.Conv1d:
            return nn.Conv1d(channels, channels, kernel_size, dilation=d,
                             padding=0 if causal else (kernel_size * d - d) // 2)

        self.convs1 = nn.ModuleList(conv(d) for d in dilations)
        self.convs2 = nn.ModuleList(conv(1) for _ in dilations)
        self.activations1 = nn.ModuleList(Snake(channels) for _ in dilations)
        self.activations2 = nn.ModuleList(Snake(channels) for _ in dilations)

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        """mask (B, 1, L): right-padded items; each conv input is zeroed past the item's samples."""
        if self.causal:
            for c1, c2, a1, a2 in zip(self.convs1, self.convs2, self.activations1, self.activations2):
                x = _causal_conv(c2, a2(_causal_conv(c1, a1(x)))) + x
            return x
        for c1, c2, a1, a2 in zip(self.convs1, self.convs2, self.activations1, self.activations2):
            if mask is None:
                x = c2(a2(c1(a1(x)))) + x
            else:
                x = c2(a2(c1(a1(x) * mask)) * mask) + x
        return x


def _causal_conv(conv: nn.Conv1d, x: Tensor) -> Tensor:
    return conv(F.pad(x, ((conv.kernel_size[0] - 1) * conv.dilation[0], 0)))


# --------------------------------------------------------------------------- HiFT


class HiFTStages(nn.Module):
    """What HiFT and CosyVoice3's causal HiFT (cosyvoice3/hift.py) share past conv_pre: the
    source STFT, the upsampling stages fused with the source, and conv_post -> iSTFT. Subclasses
    build `ups`, `source_downs`, `source_resblocks`, `resblocks` and `conv_post` (each called with
    one input, doing its own padding) and set `dims`, `n_fft`, `hop`, `num_kernels`, `stft_window`."""

    @staticmethod
    def _hann(n: int) -> Tensor:
        # periodic Hann computed in float64, stored as float32 (like a scipy window); on the CPU
        # explicitly: in no weight file, so it must be real also in a meta-device build (empty_init)
        return torch.hann_window(n, periodic=True, dtype=torch.float64, device="cpu").to(torch.float32)

    def source_stft(self, source: Tensor) -> Tensor:
        """source (B, 1, L) -> (B, n_fft + 2, L / hop + 1): real then imaginary parts (center=True)."""
        spec = torch.view_as_real(torch.stft(source.squeeze(1), self.n_fft, self.hop, self.n_fft,
                                             window=self.stft_window, return_complex=True))
        return torch.cat([spec[..., 0], spec[..., 1]], dim=1)

    def upsample_stages(self, x: Tensor, s_stft: Tensor) -> Tensor:
        """conv_pre's output -> the last stage's (B, C, hop frames), each stage: leaky ReLU, upsample,
        [reflection pad after the last], + the source at that rate, mean of the resblocks."""
        last = len(self.ups) - 1
        for i, up in enumerate(self.ups):
            x = up(F.leaky_relu(x, self.dims.lrelu_slope))
            if i == last:
                x = F.pad(x, (1, 0), mode="reflect")
            x = x + self.source_resblocks[i](self.source_downs[i](s_stft))
            xs = self.resblocks[i * self.num_kernels](x)
            for j in range(1, self.num_kernels):
                xs += self.resblocks[i * self.num_kernels + j](x)
            x = xs / self.num_kernels
        return x

    def spectrum(self, x: Tensor) -> Tensor:
        """Last stage -> conv_post -> magnitude exp(·) <= 100 and phase sin(·): (B, n_fft/2 + 1, N) complex."""
        x = self.conv_post(F.leaky_relu(x))
        bins = self.n_fft // 2 + 1
        mag = torch.clip(torch.exp(x[:, :bins, :]), max=1e2)
        phase = torch.sin(x[:, bins:, :])
        return torch.complex(mag * torch.cos(phase), mag * torch.sin(phase))

    def to_speech(self, x: Tensor) -> Tensor:
        """Last stage -> `spectrum` -> iSTFT (B, hop·(N − 1))."""
        return istft(self.spectrum(x), self.hop, self.stft_window)


class HiFT(HiFTStages):
    def __init__(self, dims: HiFTDims):
        super().__init__()
        self.dims = dims
        self.upsample_scale = dims.samples_per_frame
        self.n_fft = dims.istft_n_fft
        self.hop = dims.istft_hop_len
        self.num_kernels = len(dims.resblock_kernel_sizes)
        base = dims.base_channels
        n_stages = len(dims.upsample_rates)

        self.f0_predictor = ConvRNNF0Predictor(dims.f0_num_class, dims.f0_in_channels, dims.f0_cond_channels)
        self.m_source = SourceModuleHnNSF(dims.sampling_rate, self.upsample_scale, dims.nb_harmonics,
                                          dims.nsf_alpha, dims.nsf_sigma, dims.nsf_voiced_threshold)
        self.conv_pre = nn.Conv1d(dims.in_channels, base, 7, padding=3)
        self.ups = nn.ModuleList(
            nn.ConvTranspose1d(base // 2 ** i, base // 2 ** (i + 1), k, u, padding=(k - u) // 2)
            for i, (u, k) in enumerate(zip(dims.upsample_rates, dims.upsample_kernel_sizes)))

        # The source STFT (hop 4) is brought to each stage's rate: stage i needs a downsampling
        # by the product of the upsample rates still to come (15, 3, 1 for [8, 5, 3]).
        stft_ch = self.n_fft + 2
        self.source_downs = nn.ModuleList()
        self.source_resblocks = nn.ModuleList()
        for i in range(n_stages):
            ch = base // 2 ** (i + 1)
            u = math.prod(dims.upsample_rates[i + 1:])
            if u == 1:
                self.source_downs.append(nn.Conv1d(stft_ch, ch, 1, 1))
            else:
                self.source_downs.append(nn.Conv1d(stft_ch, ch, u * 2, u, padding=u // 2))
            self.source_resblocks.append(ResBlock(ch, dims.source_resblock_kernel_sizes[i],
                                                  dims.source_resblock_dilation_sizes[i]))

        self.resblocks = nn.ModuleList(
            ResBlock(base // 2 ** (i + 1), k, d)
            for i in range(n_stages)
            for k, d in zip(dims.resblock_kernel_sizes, dims.resblock_dilation_sizes))
        self.conv_post = nn.Conv1d(base // 2 ** n_stages, stft_ch, 7, padding=3)
        self.register_buffer("stft_window", self._hann(self.n_fft), persistent=False)

    # -- pieces

    def source(self, f0: Tensor, noise: NoiseSpec = None) -> Tensor:
        """f0 (B, T) at the mel rate -> NSF source (B, 1, T * samples_per_frame)."""
        f0_up = F.interpolate(f0[:, None], scale_factor=float(self.upsample_scale), mode="nearest")
        return self.m_source(f0_up.transpose(1, 2), noise).transpose(1, 2)

    def decode(self, mel: Tensor, source: Tensor) -> Tensor:
        """mel (B, 80, T) + source (B, 1, 480T) -> speech (B, 480T), clamped to +-audio_limit."""
        speech = self.to_speech(self.upsample_stages(self.conv_pre(mel), self.source_stft(source)))
        return torch.clamp(speech, -self.dims.audio_limit, self.dims.audio_limit)

    def decode_padded(self, mel: Tensor, source: Tensor, lengths: Tensor) -> Tensor:
        """`decode` of right-padded items: mel (B, 80, T) with lengths[b] valid frames, source
        (B, 1, 480T) valid up to 480·lengths[b] and followed by its STFT reflection (`render_padded`).
        Returns speech (B, 480T), item b exact up to 480·lengths[b] samples, zero after."""
        B, _, T = mel.shape

        def mask(n: Tensor, size: int) -> Tensor:
            return (torch.arange(size, device=mel.device) < n.unsqueeze(1)).unsqueeze(1).to(mel.dtype)

        spec = torch.stft(source.squeeze(1), self.n_fft, self.hop, self.n_fft, window=self.stft_window,
                          return_complex=True)
        spec = torch.view_as_real(spec)
        frames = lengths * (self.upsample_scale // self.hop) + 1  # STFT frames of each item's own call
        s_stft = torch.cat([spec[..., 0], spec[..., 1]], dim=1) * mask(frames, spec.shape[2])

        n = lengths
        x = self.conv_pre(mel * mask(n, T))
        last = len(self.ups) - 1
        for i, up in enumerate(self.ups):
            x = up(F.leaky_relu(x, self.dims.lrelu_slope) * mask(n, x.shape[2]))
            n = n * self.dims.upsample_rates[i]
            if i == last:
                x = F.pad(x, (1, 0), mode="reflect")
                n = n + 1
            m = mask(n, x.shape[2])
            x = x + self.source_resblocks[i](self.source_downs[i](s_stft) * m, m)
            xs = self.resblocks[i * self.num_kernels](x, m)
            for j in range(1, self.num_kernels):
                xs += self.resblocks[i * self.num_kernels + j](x, m)
            x = xs / self.num_kernels
        m = mask(n, x.shape[2])
        x = self.conv_post(F.leaky_relu(x) * m)

        bins = self.n_fft // 2 + 1
        mag = torch.clip(torch.exp(x[:, :bins, :]), max=1e2)
        phase = torch.sin(x[:, bins:, :])
        spec = torch.complex(mag * torch.cos(phase), mag * torch.sin(phase)) * m
        speech = recompute_tails(istft(spec, self.hop, self.stft_window), spec, frames, self.hop, self.stft_window)
        speech = speech * mask((frames - 1) * self.hop, speech.shape[1])[:, 0]
        return torch.clamp(speech, -self.dims.audio_limit, self.dims.audio_limit)

    def padded_inputs(self, mel: Tensor, lengths: Sequence[int], noise: Sequence[NSFNoise | None],
                      cache_source: Sequence[Tensor | None] | None = None) -> dict[str, Tensor]:
        """`render_padded`'s inputs for right-padded items: mel (B, 80, T), lengths[b] valid
        frames, one NSFNoise (None: torch's default RNG) and one cache_source (1, 1, S_b) or None
        per item. Each item's NSF draws are its own call's (drawn at its own length), right-padded."""
        B, _, T = mel.shape
        if len(lengths) != B or len(noise) != B:
            raise ValueError(f"got {len(lengths)} lengths and {len(noise)} noises for a batch of {B}")
        if min(lengths) < 2 or max(lengths) > T:
            raise ValueError(f"item lengths must be within [2, {T}] frames, got {list(lengths)}")
        caches = list(cache_source) if cache_source is not None else [None] * B
        if len(caches) != B:
            raise ValueError(f"got {len(caches)} cache_source rows for a batch of {B}")
        dev, scale, dim = mel.device, self.upsample_scale, self.m_source.l_sin_gen.dim
        cache_lens = [0 if c is None else c.shape[-1] for c in caches]
        if any(c > scale * n for c, n in zip(cache_lens, lengths)):
            raise ValueError(f"a cache_source is longer than its item ({cache_lens} samples, {list(lengths)} frames)")
        rand_ini, sine_noise = mel.new_zeros(B, dim), mel.new_zeros(B, scale * T, dim)
        for b, (n, z) in enumerate(zip(lengths, noise)):
            ini, nz = (NSFNoise() if z is None else z).draw(1, scale * n, dim, dev)
            if ini is not None:
                rand_ini[b], sine_noise[b, :scale * n] = ini[0], nz[0]
        cache = mel.new_zeros(B, 1, max(cache_lens))
        for b, c in enumerate(caches):
            if cache_lens[b]:
                cache[b, 0, :cache_lens[b]] = c.reshape(-1)
        return dict(mel=mel, lengths=torch.tensor(list(lengths), device=dev), rand_ini=rand_ini,
                    sine_noise=sine_noise, cache=cache, cache_lens=torch.tensor(cache_lens, device=dev))

    def render_padded(self, mel: Tensor, lengths: Tensor, rand_ini: Tensor, sine_noise: Tensor, cache: Tensor,
                      cache_lens: Tensor) -> tuple[Tensor, Tensor]:
        """Right-padded items in one call, from `padded_inputs`; no host syncs, so a CUDA graph can
        capture it (token2wav/hift_graphs.py). Returns speech (B, 480T), item b's first 480·lengths[b]
        samples its own `inference` call's up to float summation order (zero after), and the
        source (B, 1, 480T), item b's first 480·lengths[b] samples its own call's.

        Every conv input is masked to the item's length; the NSF phase holds the item's last phase
        over the padding; cache_source overwrites each item's head; the item's own STFT reflection
        follows its end (decode_padded)."""
        B, _, T = mel.shape
        frame = torch.arange(T, device=mel.device)
        mask = (frame < lengths.unsqueeze(1)).unsqueeze(1).to(mel.dtype)
        f0 = self.f0_predictor(mel * mask, mask)
        f0_up = F.interpolate(f0[:, None], scale_factor=float(self.upsample_scale), mode="nearest")
        source = self.m_source.with_draws(f0_up.transpose(1, 2), rand_ini, sine_noise, lengths).transpose(1, 2)
        S = cache.shape[2]
        if S:
            head = (torch.arange(S, device=mel.device) < cache_lens.unsqueeze(1)).unsqueeze(1)
            source = torch.cat([torch.where(head, cache, source[:, :, :S]), source[:, :, S:]], dim=2)
        source = reflect_after_ends(source, lengths * self.upsample_scale, self.n_fft // 2)
        return self.decode_padded(mel, source, lengths), source

    @torch.no_grad()
    def inference_padded(self, mel: Tensor, lengths: Sequence[int], noise: Sequence[NSFNoise | None],
                         cache_source: Sequence[Tensor | None] | None = None) -> tuple[Tensor, list[Tensor]]:
        """Items of different lengths in one call (`padded_inputs`, `render_padded`). Returns
        speech (B, 480T), item b's first 480·lengths[b] samples equal to `inference(mel[b:b+1, :,
        :lengths[b]], cache_source[b], noise[b])` up to float summation order (zero after), and
        each item's source (1, 1, 480·lengths[b])."""
        speech, source = self.render_padded(**self.padded_inputs(mel, lengths, noise, cache_source))
        scale = self.upsample_scale
        return speech, [source[b:b + 1, :, :scale * L] for b, L in enumerate(lengths)]

    # -- entry point

    @torch.no_grad()
    def inference(self, mel: Tensor, cache_source: Tensor | Sequence[Tensor | None] | None = None,
                  noise: NoiseSpec = None, trace: dict | None = None) -> tuple[Tensor, Tensor]:
        """mel (B, 80, T) -> (speech (B, 480T), source (B, 1, 480T)).

        cache_source: (B, 1, S) source samples that overwrite the head of the new source (keeps
        the NSF phase continuous across streaming chunks), or one (1, 1, S_b) tensor / None per row.
        noise: an NSFNoise for the batch, or one per row; None draws from torch's default RNG.
        trace: if a dict, receives "f0" (B, T).
        """
        f0 = self.f0_predictor(mel)
        source = self.source(f0, noise)
        if isinstance(cache_source, Tensor):
            if cache_source.shape[-1] > 0:
                source[:, :, :cache_source.shape[-1]] = cache_source
        elif cache_source is not None:
            if len(cache_source) != mel.shape[0]:
                raise ValueError(f"got {len(cache_source)} cache_source rows for a batch of {mel.shape[0]}")
            for b, cache in enumerate(cache_source):
                if cache is not None and cache.shape[-1] > 0:
                    source[b, :, :cache.shape[-1]] = cache[0]
        if trace is not None:
            trace["f0"] = f0
        return self.decode(mel, source), source
