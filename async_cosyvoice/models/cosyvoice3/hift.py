"""CausalHiFT (CausalHiFTGenerator): CosyVoice3's vocoder, mel (50 Hz) -> 24 kHz waveform.

HiFT (models/hift.py) made causal, so that a stream can re-vocode its whole mel at every chunk and
emit only the new samples (no source cache, no cross-fade):

    mel -> F0 (CausalConvRNNF0Predictor, float64: first conv k4 looking 3 frames right, then causal
           k3 convs) -> nearest x480 -> causal NSF source (fixed draws, nsf_noise.py; phase repeated,
           not interpolated, to the sample rate) -> STFT
    mel -> conv_pre (k5, looking 4 frames right) -> stages as HiFT's, but each upsample is nearest
           repetition + a causal conv, each source down-sampling and resblock conv is causal
        -> conv_post (causal k7) -> iSTFT -> clamp

`finalize=True` (a whole utterance, or a stream's last call): the look-ahead convs read zeros past
the end; T mel frames give 480·T samples. `finalize=False` (a stream's earlier calls): the last 3
frames are only the F0 predictor's right context and the 4 before them only conv_pre's, and the
last 480 samples (whose iSTFT frames are incomplete) are cut: T frames give 480·(T − 8) samples,
each equal to the same sample of any longer call on the same mel prefix.

`inference` is one call (upstream's); `render` batches many streams' calls of different lengths,
final or not, as one right-padded call (`render_padded`, no host syncs: token2wav/hift_graphs.py
runs it as a CUDA graph per (streams, frames) bucket).

Parameter names are the `hift.pt` keys with weight norm folded (model_dir.normalize_hift_state_dict).
"""
from __future__ import annotations

import math
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..dims import HiFTDims
from ..hift import HiFTStages, ResBlock, SourceModuleHnNSF, istft, recompute_tails, reflect_after_ends
from .nsf_noise import FixedNSFNoise

F0_PREDICTOR_PREFIX = "f0_predictor."  # hift.pt keys whose weight norm is folded in float64


class LeftCausalConv1d(nn.Conv1d):
    """Sees its (kernel − 1)·dilation input frames before each output (zeros at the start)."""

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(F.pad(x, ((self.kernel_size[0] - 1) * self.dilation[0], 0)))


class CausalUpsample(nn.Conv1d):
    """Nearest repetition by `stride`, then a left-causal conv."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int):
        super().__init__(in_channels, out_channels, kernel_size)
        self.up = stride

    def forward(self, x: Tensor) -> Tensor:
        B, C, T = x.shape  # repeat_interleave by expand: no host sync inside a CUDA graph capture
        x = x.unsqueeze(3).expand(B, C, T, self.up).reshape(B, C, T * self.up)
        return super().forward(F.pad(x, (self.kernel_size[0] - 1, 0)))


class CausalDownsample(nn.Conv1d):
    """A strided conv over stride − 1 zeros then the input."""

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(F.pad(x, (self.stride[0] - 1, 0)))


class CausalConvRNNF0Predictor(nn.Module):
    """|f0| in Hz at the mel rate, in float64: upstream runs the predictor in float64 on every call
    (its output is precision sensitive), so its parameters stay float64 whatever dtype the vocoder
    is moved to, and its weight norm must be folded in float64 too (F0_PREDICTOR_PREFIX)."""

    def __init__(self, num_class: int, in_channels: int, cond_channels: int, lookahead: int = 3):
        super().__init__()
        self.lookahead = lookahead
        layers: list[nn.Module] = [nn.Conv1d(in_channels, cond_channels, lookahead + 1), nn.ELU()]
        for _ in range(4):
            layers += [nn.Conv1d(cond_channels, cond_channels, 3), nn.ELU()]
        self.condnet = nn.Sequential(*layers)
        self.classifier = nn.Linear(cond_channels, num_class)
        self.double()

    def _apply(self, fn, recurse=True):
        return super()._apply(lambda t: fn(t).double() if t.is_floating_point() else fn(t), recurse)

    def forward(self, mel: Tensor, finalize: bool = True) -> Tensor:
        """mel (B, 80, T) -> f0 (B, T) float64 (finalize: zeros as the right context of the last
        frames) or (B, T − lookahead) (the last `lookahead` frames are right context only)."""
        convs = [m for m in self.condnet if isinstance(m, nn.Conv1d)]
        h = mel.double()
        if finalize:
            h = F.pad(h, (0, self.lookahead))
        for i, conv in enumerate(convs):
            if i:  # causal: the kernel − 1 frames before
                h = F.pad(h, (conv.kernel_size[0] - 1, 0))
            h = F.elu(conv(h))
        return self.classifier(h.transpose(1, 2)).squeeze(-1).abs()


class CausalHiFT(HiFTStages):
    def __init__(self, dims: HiFTDims, nsf_noise: FixedNSFNoise | None = None):
        """nsf_noise: the fixed NSF draws (FixedNSFNoise.replay(flow dims, dims) for upstream's);
        None: noise-free (FixedNSFNoise.zeros())."""
        super().__init__()
        if not dims.causal or dims.conv_pre_look_right < 1:
            raise ValueError("CausalHiFT needs HiFTDims(causal=True, conv_pre_look_right >= 1)")
        self.dims = dims
        self.upsample_scale = dims.samples_per_frame
        self.n_fft = dims.istft_n_fft
        self.hop = dims.istft_hop_len
        self.num_kernels = len(dims.resblock_kernel_sizes)
        self.nsf_noise = FixedNSFNoise.zeros(dims.nb_harmonics + 1) if nsf_noise is None else nsf_noise
        base, rates = dims.base_channels, dims.upsample_rates

        self.f0_predictor = CausalConvRNNF0Predictor(dims.f0_num_class, dims.f0_in_channels, dims.f0_cond_channels)
        self.m_source = SourceModuleHnNSF(dims.sampling_rate, self.upsample_scale, dims.nb_harmonics, dims.nsf_alpha,
                                          dims.nsf_sigma, dims.nsf_voiced_threshold, causal=True)
        self.conv_pre = nn.Conv1d(dims.in_channels, base, dims.conv_pre_look_right + 1)
        self.ups = nn.ModuleList(CausalUpsample(base // 2 ** i, base // 2 ** (i + 1), k, u)
                                 for i, (u, k) in enumerate(zip(rates, dims.upsample_kernel_sizes)))
        stft_ch = self.n_fft + 2
        self.source_downs = nn.ModuleList()
        self.source_resblocks = nn.ModuleList()
        for i in range(len(rates)):
            ch, u = base // 2 ** (i + 1), math.prod(rates[i + 1:])
            self.source_downs.append(LeftCausalConv1d(stft_ch, ch, 1) if u == 1 else
                                     CausalDownsample(stft_ch, ch, 2 * u, u))
            self.source_resblocks.append(ResBlock(ch, dims.source_resblock_kernel_sizes[i],
                                                  dims.source_resblock_dilation_sizes[i], causal=True))
        self.resblocks = nn.ModuleList(
            ResBlock(base // 2 ** (i + 1), k, d, causal=True)
            for i in range(len(rates)) for k, d in zip(dims.resblock_kernel_sizes, dims.resblock_dilation_sizes))
        self.conv_post = LeftCausalConv1d(base // 2 ** len(rates), stft_ch, 7)
        self.register_buffer("stft_window", self._hann(self.n_fft), persistent=False)

    @property
    def right_context_frames(self) -> int:
        """Mel frames a non-final call holds back as look-ahead (3 for F0 + conv_pre's)."""
        return self.f0_predictor.lookahead + self.dims.conv_pre_look_right

    def emitted_samples(self, frames: int, finalize: bool) -> int:
        """Samples `inference` returns for `frames` mel frames."""
        n = frames if finalize else frames - self.right_context_frames - 1
        return max(0, n) * self.upsample_scale

    def fixed_draws(self, samples: int, device: torch.device) -> dict[str, Tensor]:
        """The fixed NSF draws for `samples` samples, as `source` takes them: fixed_phases (1, dim)
        and fixed_noise (1, samples, dim) (the noise buffer's prefix); none for the noise-free vocoder."""
        noise = self.nsf_noise
        if noise.is_zero:
            return {}
        return dict(fixed_phases=noise.phases(device), fixed_noise=noise.sine_noise(samples, device))

    def source(self, f0: Tensor, fixed_phases: Tensor | None = None, fixed_noise: Tensor | None = None) -> Tensor:
        """f0 (B, T) at the mel rate + the fixed draws for at least 480T samples (`fixed_draws`;
        none: no noise) -> NSF source (B, 1, 480T)."""
        f0_up = F.interpolate(f0[:, None], scale_factor=float(self.upsample_scale), mode="nearest").transpose(1, 2)
        B, L, _ = f0_up.shape
        rand_ini = None if fixed_phases is None else fixed_phases.expand(B, -1)
        sine_noise = None if fixed_noise is None else fixed_noise[:, :L].expand(B, -1, -1)
        return self.m_source.with_draws(f0_up, rand_ini, sine_noise).transpose(1, 2)

    def decode(self, mel: Tensor, source: Tensor, finalize: bool) -> Tensor:
        """mel (B, 80, T') (finalize=False: the last conv_pre_look_right frames are right context) +
        source (B, 1, 480T') -> speech (B, 480T') or (B, 480(T' − look_right − 1)), clamped."""
        s_stft = self.source_stft(source)
        look = self.dims.conv_pre_look_right
        if finalize:
            x = self.conv_pre(F.pad(mel, (0, look)))
        else:
            x = self.conv_pre(mel)
            s_stft = s_stft[:, :, :-(self.upsample_scale // self.hop) * look]
        speech = self.to_speech(self.upsample_stages(x, s_stft))
        if not finalize:
            speech = speech[:, :-self.upsample_scale]
        return torch.clamp(speech, -self.dims.audio_limit, self.dims.audio_limit)

    @torch.no_grad()
    def inference(self, mel: Tensor, finalize: bool = True, trace: dict | None = None) -> tuple[Tensor, Tensor]:
        """mel (B, 80, T) -> (speech (B, emitted_samples(T, finalize)), source (B, 1, 480·T_f0)),
        T_f0 = T (finalize) or T − 3. trace: if a dict, receives "f0" (B, T_f0) float64."""
        if mel.shape[2] <= (0 if finalize else self.right_context_frames):
            raise ValueError(f"a {'final' if finalize else 'non-final'} call needs more than "
                             f"{0 if finalize else self.right_context_frames} mel frames, got {mel.shape[2]}")
        f0 = self.f0_predictor(mel, finalize)
        if trace is not None:
            trace["f0"] = f0
        source = self.source(f0.to(mel.dtype), **self.fixed_draws(self.upsample_scale * f0.shape[1], mel.device))
        speech = self.decode(mel if finalize else mel[:, :, :f0.shape[1]], source, finalize)
        return speech, source

    def padded_inputs(self, mel: Tensor, lengths: Sequence[int]) -> dict[str, Tensor]:
        """`render_padded`'s inputs for right-padded items: mel (B, 80, T), lengths[b] valid frames,
        and the fixed NSF draws for 480T samples (every item starts at sample 0 of the buffer)."""
        B, _, T = mel.shape
        if len(lengths) != B:
            raise ValueError(f"got {len(lengths)} lengths for a batch of {B}")
        if min(lengths) < 1 or max(lengths) > T:
            raise ValueError(f"item lengths must be within [1, {T}] frames, got {list(lengths)}")
        return dict(mel=mel, lengths=torch.tensor(list(lengths), device=mel.device),
                    **self.fixed_draws(self.upsample_scale * T, mel.device))

    def render_padded(self, mel: Tensor, lengths: Tensor, fixed_phases: Tensor | None = None,
                      fixed_noise: Tensor | None = None) -> Tensor:
        """Right-padded items in one final call, from `padded_inputs`; no host syncs, so a CUDA
        graph can capture it (token2wav/hift_graphs.py). Returns speech (B, 480T), clamped: item b's
        first 480·lengths[b] samples those of its own final `inference` call up to float summation
        order, and the first emitted_samples(lengths[b], False) those of its own non-final call.

        Exact because every op is causal but the look-ahead convs, and those read zeros past each
        item (its mel is masked to its length: its own final call's look-ahead; a non-final call
        emits nothing they reach). Two ends are fixed up: the source STFT sees the item's own
        reflection after its end (center=True), and the last iSTFT samples, whose overlap would take
        in padded frames, are recomputed from the item's last frames alone (a non-final call emits
        nothing within reach of either)."""
        T = mel.shape[2]
        mel = mel * (torch.arange(T, device=mel.device) < lengths.unsqueeze(1)).unsqueeze(1).to(mel.dtype)
        source = self.source(self.f0_predictor(mel, finalize=True).to(mel.dtype), fixed_phases, fixed_noise)
        source = reflect_after_ends(source, lengths * self.upsample_scale, self.n_fft // 2)
        x = self.conv_pre(F.pad(mel, (0, self.dims.conv_pre_look_right)))
        spec = self.spectrum(self.upsample_stages(x, self.source_stft(source)))
        frames = lengths * (self.upsample_scale // self.hop) + 1  # STFT frames of each item's own call
        speech = recompute_tails(istft(spec, self.hop, self.stft_window), spec, frames, self.hop, self.stft_window)
        return torch.clamp(speech, -self.dims.audio_limit, self.dims.audio_limit)

    @torch.no_grad()
    def render(self, mels: list[Tensor], finalize: list[bool],
               padded_call: Callable[[Tensor, list[int]], Tensor] | None = None) -> list[Tensor]:
        """Many streams' calls in one right-padded call: mels[b] (1, 80, T_b), final or not ->
        speech (1, emitted_samples(T_b, finalize[b])), each its own `inference` call's up to float
        summation order; items too short to emit anything get (1, 0).

        padded_call(mel, lengths) -> speech (B, >= 480·max(lengths)): `render_padded` of
        `padded_inputs` (the default), or the same call in a CUDA graph (HiFTGraphs.render_causal)."""
        if len(mels) != len(finalize):
            raise ValueError(f"got {len(mels)} mels and {len(finalize)} finalize flags")
        out: list[Tensor | None] = [None] * len(mels)
        live = [b for b, (m, fin) in enumerate(zip(mels, finalize)) if self.emitted_samples(m.shape[2], fin) > 0]
        for b in set(range(len(mels))) - set(live):
            out[b] = mels[b].new_zeros(1, 0)
        if not live:
            return out
        lengths = [mels[b].shape[2] for b in live]
        mel = mels[live[0]].new_zeros(len(live), mels[live[0]].shape[1], max(lengths))
        for row, b in enumerate(live):
            mel[row, :, :lengths[row]] = mels[b][0]
        if padded_call is None:
            speech = self.render_padded(**self.padded_inputs(mel, lengths))
        else:
            speech = padded_call(mel, lengths)
        for row, b in enumerate(live):
            out[b] = speech[row:row + 1, :self.emitted_samples(lengths[row], finalize[b])]
        return out
