"""Prompt-audio signal processing: decode, resample, and the three feature extractors.

Everything here reproduces what upstream CosyVoice2 feeds its models (facts sheet §6):

- `load_audio` / `pcm_to_audio`: float32 mono in [-1, 1]; integer PCM is scaled by 1/2^(bits-1)
  (int16 / 32768), multi-channel audio is averaged (upstream `load_wav`).
- `resample`: band-limited sinc interpolation with a Hann window, 6 zero crossings, rolloff
  0.99 and a gcd-reduced polyphase kernel (torchaudio `Resample` defaults, which upstream uses).
- `whisper_log_mel`: 128-bin log-mel at 16 kHz for `speech_tokenizer_v2.onnx`.
- `kaldi_fbank`: 80-bin Kaldi fbank at 16 kHz for `campplus.onnx`.
- `prompt_mel_24k`: the 80-bin prompt mel at 24 kHz (yaml `feat_extractor`) for the flow.

Inputs may be numpy arrays or torch tensors (1-D samples); results are float32 numpy arrays.
Filters and windows are computed once per parameter set. All functions are pure, so they may run
concurrently on executor threads.
"""
from __future__ import annotations

import functools
import io
import math
import os
from typing import BinaryIO, Union

import av
import numpy as np
import soundfile as sf
import torch
import torch.nn.functional as F

from ..errors import InvalidRequest
from ..models.dims import MelDims
from ..request import Audio

AudioSource = Union[str, os.PathLike, bytes, bytearray, memoryview, BinaryIO]

MIN_PROMPT_SAMPLE_RATE = 16000  # upstream refuses to resample from anything lower


class AudioError(InvalidRequest):
    """Audio that cannot be decoded, is empty, or has an unusable sample rate."""


# ---------------------------------------------------------------------------------------------
# Decoding


def load_audio(source: AudioSource) -> Audio:
    """Decode an audio file (path, bytes or binary file object) to mono float32.

    libsndfile reads wav, flac, ogg (Vorbis/Opus), mp3 and its other formats; what it cannot open
    (AAC, WebM, MP4, a FLAC whose header says "length unknown") is decoded by FFmpeg (PyAV), so
    every format the server writes is accepted back as prompt audio.
    """
    name = _describe(source)
    if isinstance(source, (bytes, bytearray, memoryview)):
        if len(source) == 0:
            raise AudioError("audio data is empty (0 bytes)")
        source = io.BytesIO(bytes(source))
    elif isinstance(source, (str, os.PathLike)):
        if not os.path.isfile(source):
            raise AudioError(f"audio file not found: {os.fspath(source)}")
    start = None if isinstance(source, (str, os.PathLike)) else source.tell()
    try:
        data, sample_rate = _read_libsndfile(source)
    except (sf.LibsndfileError, RuntimeError, TypeError, ValueError) as e:
        # LibsndfileError's str() names the Python file object ("<_io.BytesIO object at 0x..>")
        reason = getattr(e, "error_string", None) or str(e)
        if start is not None:
            source.seek(start)
        try:
            data, sample_rate = _read_ffmpeg(source)
        except (av.error.FFmpegError, ValueError, IndexError):
            raise AudioError(f"cannot decode {name} as audio (supported: wav, flac, ogg, mp3, aac, webm and "
                             f"the other libsndfile and FFmpeg formats): {reason}") from None
    if data.shape[0] == 0:
        raise AudioError(f"{name} contains no samples")
    return Audio(_to_mono(data), int(sample_rate))


def _read_libsndfile(source) -> tuple[np.ndarray, int]:
    with sf.SoundFile(source) as f:
        if f.frames >= _SF_COUNT_MAX:  # length unknown: libsndfile 1.2 cannot read such a file
            raise ValueError(f"{f.format} header gives no length")
        return f.read(dtype="float32", always_2d=True), f.samplerate


# Demuxers FFmpeg may use on an upload: audio files only, never a playlist or a concat list that
# names other files or URLs.
_FFMPEG_DEMUXERS = "aac,mov,mp4,m4a,matroska,webm,ogg,mp3,flac,wav"


def _read_ffmpeg(source) -> tuple[np.ndarray, int]:
    """(frames, channels) float32 and the rate of the first audio stream, decoded by PyAV."""
    with av.open(source, options={"format_whitelist": _FFMPEG_DEMUXERS}) as container:
        stream = container.streams.audio[0]
        planes = [frame.to_ndarray().astype(np.float32, copy=False).reshape(frame.layout.nb_channels, -1)
                  for frame in _planar_float(container.decode(stream))]
        rate = stream.codec_context.sample_rate
    if not planes:
        return np.zeros((0, 1), np.float32), rate
    return np.concatenate(planes, axis=1).T, rate


def _planar_float(frames):
    """The decoded frames converted to planar float32 (fltp), one array row per channel."""
    resampler = None
    for frame in frames:
        if resampler is None:
            resampler = av.AudioResampler(format="fltp", layout=frame.layout.name, rate=frame.sample_rate)
        yield from resampler.resample(frame)
    if resampler is not None:
        yield from resampler.resample(None)


_SF_COUNT_MAX = 2 ** 63 - 1


PCM_ENCODINGS = {
    # name: (numpy dtype, scale applied after the cast to float32)
    "s16le": ("<i2", 1.0 / 32768.0),
    "s32le": ("<i4", 1.0 / 2147483648.0),
    "f32le": ("<f4", None),
}


def pcm_to_audio(data: bytes, sample_rate: int, encoding: str = "s16le", channels: int = 1) -> Audio:
    """Raw headerless PCM (interleaved when `channels` > 1) to mono float32.

    `encoding` is one of `PCM_ENCODINGS`: s16le, s32le (integer, scaled to [-1, 1)) or f32le.
    """
    if encoding not in PCM_ENCODINGS:
        raise AudioError(f"unknown PCM encoding {encoding!r}; expected one of {', '.join(sorted(PCM_ENCODINGS))}")
    if sample_rate <= 0:
        raise AudioError(f"sample rate must be positive, got {sample_rate}")
    if channels < 1:
        raise AudioError(f"channels must be >= 1, got {channels}")
    dtype, scale = PCM_ENCODINGS[encoding]
    frame_bytes = np.dtype(dtype).itemsize * channels
    if len(data) == 0:
        raise AudioError("PCM data is empty (0 bytes)")
    if len(data) % frame_bytes:
        raise AudioError(f"PCM data length {len(data)} is not a multiple of the frame size "
                         f"{frame_bytes} ({encoding}, {channels} channel(s))")
    samples = np.frombuffer(data, dtype=dtype).astype(np.float32)
    if scale is not None:
        samples *= np.float32(scale)
    return Audio(_to_mono(samples.reshape(-1, channels)), int(sample_rate))


def _to_mono(frames: np.ndarray) -> np.ndarray:
    """(N, C) float32 -> (N,) float32, averaging channels like upstream (`mean(dim=0)`)."""
    if not np.isfinite(frames).all():
        raise AudioError("audio contains NaN or infinite samples")
    if frames.shape[1] == 1:
        return np.ascontiguousarray(frames[:, 0])
    return torch.from_numpy(np.ascontiguousarray(frames.T)).mean(dim=0).numpy()


def _describe(source) -> str:
    if isinstance(source, (str, os.PathLike)):
        return f"file {os.fspath(source)!r}"
    if isinstance(source, (bytes, bytearray, memoryview)):
        return f"{len(source)} bytes of data"
    return "the file object"


# ---------------------------------------------------------------------------------------------
# Resampling


def resample(x, sr_in: int, sr_out: int) -> np.ndarray:
    """Resample 1-D audio from `sr_in` to `sr_out` Hz (windowed-sinc, torchaudio defaults).

    Output length is ceil(len(x) * sr_out / sr_in). Equal rates return the input unchanged.
    """
    if int(sr_in) != sr_in or int(sr_out) != sr_out or sr_in <= 0 or sr_out <= 0:
        raise AudioError(f"sample rates must be positive integers, got {sr_in} -> {sr_out}")
    x = _as_tensor(x)
    if sr_in == sr_out:
        return x.numpy()
    g = math.gcd(int(sr_in), int(sr_out))
    up, down = int(sr_out) // g, int(sr_in) // g  # output phases / input stride per period
    kernel, width = _sinc_kernel(down, up)
    n = x.shape[0]
    padded = F.pad(x[None, None], (width, width + down))
    y = F.conv1d(padded, kernel, stride=down)  # (1, up, periods): phase-major
    y = y[0].t().reshape(-1)
    return y[: math.ceil(up * n / down)].numpy()


@functools.lru_cache(maxsize=32)
def _sinc_kernel(down: int, up: int, zero_crossings: int = 6, rolloff: float = 0.99):
    """Polyphase kernel (up, 1, 2*width+down) for a gcd-reduced rate pair, and its half width.

    Phase j produces output sample j of every period of `down` input samples; its taps are a
    Hann-windowed sinc with cutoff rolloff*min(up, down)/2 cycles per (reduced) sample. Built in
    float64 and rounded to float32 as torchaudio does, so the taps match it bit for bit.
    """
    cutoff = min(down, up) * rolloff
    width = math.ceil(zero_crossings * down / cutoff)
    taps = torch.arange(-width, width + down, dtype=torch.float64)[None, None] / down
    phases = torch.arange(0, -up, -1)[:, None, None] / up  # float32, as in torchaudio
    t = (phases + taps) * cutoff
    t = t.clamp(-zero_crossings, zero_crossings)
    window = torch.cos(t * math.pi / zero_crossings / 2) ** 2
    t = t * math.pi
    sinc = torch.where(t == 0, torch.tensor(1.0, dtype=t.dtype), t.sin() / t)
    kernel = (sinc * (window * (cutoff / down))).to(torch.float32)
    return kernel, width


def audio_at_rate(audio: Audio, sample_rate: int, min_sample_rate: int = MIN_PROMPT_SAMPLE_RATE) -> np.ndarray:
    """`audio`'s samples at `sample_rate` (upstream `load_wav`): resampled when the rate
    differs, which needs a source rate of at least `min_sample_rate` (16 kHz)."""
    if audio.sample_rate == sample_rate:
        return np.asarray(audio.samples, dtype=np.float32)
    if audio.sample_rate < min_sample_rate:
        raise AudioError(f"prompt audio sample rate {audio.sample_rate} Hz is too low: at least "
                         f"{min_sample_rate} Hz is needed (the model was trained on >= 16 kHz audio)")
    return resample(audio.samples, audio.sample_rate, sample_rate)


# ---------------------------------------------------------------------------------------------
# Mel filter banks


def _hz_to_mel_slaney(f: np.ndarray) -> np.ndarray:
    f = np.asarray(f, dtype=np.float64)
    f_sp = 200.0 / 3
    min_log_hz, min_log_mel, logstep = 1000.0, 1000.0 / f_sp, math.log(6.4) / 27.0
    mel = f / f_sp
    log_region = f >= min_log_hz
    return np.where(log_region, min_log_mel + np.log(np.maximum(f, 1e-10) / min_log_hz) / logstep, mel)


def _mel_to_hz_slaney(m: np.ndarray) -> np.ndarray:
    m = np.asarray(m, dtype=np.float64)
    f_sp = 200.0 / 3
    min_log_hz, min_log_mel, logstep = 1000.0, 1000.0 / f_sp, math.log(6.4) / 27.0
    return np.where(m >= min_log_mel, min_log_hz * np.exp(logstep * (m - min_log_mel)), f_sp * m)


@functools.lru_cache(maxsize=16)
def slaney_mel_filters(sample_rate: int, n_fft: int, n_mels: int,
                       fmin: float = 0.0, fmax: float | None = None) -> np.ndarray:
    """(n_mels, n_fft//2+1) float32 triangular filters on the Slaney mel scale with Slaney
    area normalisation (the librosa `filters.mel` defaults). Read-only, shared."""
    if fmax is None:
        fmax = sample_rate / 2.0
    fft_freqs = np.fft.rfftfreq(n_fft, d=1.0 / sample_rate)
    edges = _mel_to_hz_slaney(np.linspace(_hz_to_mel_slaney(fmin), _hz_to_mel_slaney(fmax), n_mels + 2))
    widths = np.diff(edges)
    dist = edges[:, None] - fft_freqs[None, :]
    rising = -dist[:-2] / widths[:-1, None]
    falling = dist[2:] / widths[1:, None]
    weights = np.maximum(0.0, np.minimum(rising, falling)).astype(np.float32)
    # area normalisation, applied (in float64) to the float32 triangles like librosa
    weights = (weights * (2.0 / (edges[2:] - edges[:-2]))[:, None]).astype(np.float32)
    weights.flags.writeable = False
    return weights


@functools.lru_cache(maxsize=8)
def _slaney_mel_tensor(sample_rate: int, n_fft: int, n_mels: int, fmin: float, fmax: float | None) -> torch.Tensor:
    return torch.from_numpy(slaney_mel_filters(sample_rate, n_fft, n_mels, fmin, fmax).copy())


@functools.lru_cache(maxsize=8)
def _hann(n: int, periodic: bool = True) -> torch.Tensor:
    return torch.hann_window(n, periodic=periodic)


# ---------------------------------------------------------------------------------------------
# Whisper log-mel (speech tokenizer input)

WHISPER_N_FFT = 400
WHISPER_HOP = 160


def whisper_log_mel(x16k, n_mels: int = 128) -> np.ndarray:
    """(n_mels, len(x)//160) whisper log-mel of 16 kHz audio.

    STFT n_fft 400 / hop 160 / periodic Hann, centred with reflect padding, last frame dropped;
    power spectrum; Slaney mel; log10(max(., 1e-10)); floor at (max - 8); (x + 4) / 4.
    """
    x = _as_tensor(x16k)
    if x.shape[0] <= WHISPER_N_FFT // 2:
        raise AudioError(f"audio too short for the speech tokenizer: {x.shape[0]} samples at 16 kHz "
                         f"(need more than {WHISPER_N_FFT // 2})")
    spec = torch.stft(x, WHISPER_N_FFT, WHISPER_HOP, window=_hann(WHISPER_N_FFT), return_complex=True)
    power = spec[..., :-1].abs() ** 2
    mel = _slaney_mel_tensor(16000, WHISPER_N_FFT, n_mels, 0.0, None) @ power
    log_spec = torch.clamp(mel, min=1e-10).log10()
    log_spec = torch.maximum(log_spec, log_spec.max() - 8.0)
    return ((log_spec + 4.0) / 4.0).numpy()


# ---------------------------------------------------------------------------------------------
# Kaldi fbank (speaker-embedding input)

KALDI_FRAME_LENGTH = 400  # 25 ms at 16 kHz
KALDI_FRAME_SHIFT = 160  # 10 ms
KALDI_PADDED = 512  # frame length rounded up to a power of two
KALDI_PREEMPH = 0.97
KALDI_LOW_FREQ = 20.0


def _kaldi_mel(f: torch.Tensor | float):
    if isinstance(f, torch.Tensor):
        return 1127.0 * (1.0 + f / 700.0).log()
    return 1127.0 * math.log(1.0 + f / 700.0)


@functools.lru_cache(maxsize=8)
def kaldi_mel_banks(num_bins: int, padded_len: int = KALDI_PADDED, sample_rate: int = 16000,
                    low_freq: float = KALDI_LOW_FREQ) -> torch.Tensor:
    """(num_bins, padded_len//2 + 1) Kaldi triangular mel filters (low_freq..Nyquist), with a zero
    column for the Nyquist bin; triangles are linear on the Kaldi (HTK ln) mel scale."""
    half = padded_len // 2
    mel_lo, mel_hi = _kaldi_mel(low_freq), _kaldi_mel(sample_rate / 2.0)
    step = (mel_hi - mel_lo) / (num_bins + 1)
    b = torch.arange(num_bins).unsqueeze(1)
    left, center, right = mel_lo + b * step, mel_lo + (b + 1.0) * step, mel_lo + (b + 2.0) * step
    mel = _kaldi_mel((sample_rate / padded_len) * torch.arange(half)).unsqueeze(0)
    up = (mel - left) / (center - left)
    down = (right - mel) / (right - center)
    banks = torch.clamp(torch.minimum(up, down), min=0.0)
    return F.pad(banks, (0, 1))


@functools.lru_cache(maxsize=4)
def _povey_window(n: int) -> torch.Tensor:
    return torch.hann_window(n, periodic=False).pow(0.85)


def kaldi_fbank(x16k, num_mel_bins: int = 80) -> np.ndarray:
    """(frames, num_mel_bins) Kaldi log-mel fbank of 16 kHz float audio in [-1, 1].

    Kaldi defaults with dither 0: 25 ms frames every 10 ms without edge padding
    (frames = 1 + (N - 400) // 160), DC removal per frame, pre-emphasis 0.97, Povey window,
    512-point FFT power spectrum, mel filters from 20 Hz to Nyquist, ln with a float32-eps floor.
    """
    x = _as_tensor(x16k)
    if x.shape[0] < KALDI_FRAME_LENGTH:
        raise AudioError(f"audio too short for the speaker embedding: {x.shape[0]} samples at 16 kHz "
                         f"(need at least {KALDI_FRAME_LENGTH})")
    frames = x.unfold(0, KALDI_FRAME_LENGTH, KALDI_FRAME_SHIFT)
    frames = frames - frames.mean(dim=1, keepdim=True)
    previous = torch.cat([frames[:, :1], frames[:, :-1]], dim=1)  # replicate the first sample
    frames = frames - KALDI_PREEMPH * previous
    frames = frames * _povey_window(KALDI_FRAME_LENGTH).unsqueeze(0)
    frames = F.pad(frames, (0, KALDI_PADDED - KALDI_FRAME_LENGTH))
    power = torch.fft.rfft(frames).abs().pow(2.0)
    mel = torch.mm(power, kaldi_mel_banks(num_mel_bins).T)
    eps = torch.tensor(torch.finfo(torch.float32).eps)
    return torch.max(mel, eps).log().numpy()


# ---------------------------------------------------------------------------------------------
# Prompt mel (flow conditioning, matcha `mel_spectrogram`)


def prompt_mel_24k(x24k, dims: MelDims = MelDims()) -> np.ndarray:
    """(frames, num_mels) natural-log magnitude mel of 24 kHz audio (yaml `feat_extractor`).

    Reflect padding of (n_fft - hop) / 2 on each side, STFT without centring, magnitude
    sqrt(power + 1e-9), Slaney mel up to `fmax`, ln(max(., 1e-5)). Frames = N // hop.
    """
    x = _as_tensor(x24k)
    pad = (dims.n_fft - dims.hop_size) // 2
    if x.shape[0] <= pad:
        raise AudioError(f"audio too short for the prompt mel: {x.shape[0]} samples at "
                         f"{dims.sampling_rate} Hz (need more than {pad})")
    x = F.pad(x[None, None], (pad, pad), mode="reflect")[0]
    spec = torch.view_as_real(torch.stft(x, dims.n_fft, hop_length=dims.hop_size, win_length=dims.win_size,
                                         window=_hann(dims.win_size), center=dims.center, pad_mode="reflect",
                                         normalized=False, onesided=True, return_complex=True))
    mag = torch.sqrt(spec.pow(2).sum(-1) + 1e-9)
    fmax = None if dims.fmax is None else float(dims.fmax)
    mel = torch.matmul(_slaney_mel_tensor(dims.sampling_rate, dims.n_fft, dims.num_mels, float(dims.fmin), fmax), mag)
    return torch.log(torch.clamp(mel, min=1e-5))[0].t().contiguous().numpy()


def _as_tensor(x) -> torch.Tensor:
    t = x.detach().cpu() if isinstance(x, torch.Tensor) else torch.from_numpy(np.asarray(x))
    if t.dim() == 2 and t.shape[0] == 1:
        t = t[0]
    if t.dim() != 1:
        raise AudioError(f"expected 1-D mono samples, got shape {tuple(t.shape)}")
    return t.to(torch.float32).contiguous()
