"""Audio out: float32 chunks at the model rate -> `AudioChunk` messages (encoding, resampling, chunking)."""
from __future__ import annotations

import dataclasses
import struct

import numpy as np
import soxr

from ._stubs import load as _load_stubs

pb2, _ = _load_stubs()

MAX_CHUNK_BYTES = 1 << 20      # larger payloads are split over several AudioChunks


def wav_header(num_samples: int | None, sample_rate: int) -> bytes:
    """44-byte RIFF/WAVE header for mono PCM16. `None` samples: streaming, sizes 0xFFFFFFFF."""
    if num_samples is None:
        riff_size = data_size = 0xFFFFFFFF
    else:
        data_size = 2 * num_samples
        riff_size = 36 + data_size
    return struct.pack("<4sI4s4sIHHIIHH4sI", b"RIFF", riff_size, b"WAVE", b"fmt ", 16, 1, 1,
                       sample_rate, 2 * sample_rate, 2, 16, b"data", data_size)


def float_to_pcm16(x: np.ndarray) -> bytes:
    return (np.clip(x, -1.0, 1.0) * 32767.0).round().astype("<i2").tobytes()


class AudioEncoder:
    """Float32 chunks at the model rate -> AudioChunk messages in the requested encoding and rate.

    Resampling is one soxr stream per response, so chunk boundaries are seamless and the total
    length is round(n * out_rate / in_rate). `sample_offset` and `num_samples` count samples at
    the output rate. WAV non-stream collects everything so the header carries exact sizes.
    """

    def __init__(self, encoding: int, in_rate: int, out_rate: int, stream: bool,
                 max_chunk_bytes: int = MAX_CHUNK_BYTES):
        self.encoding = encoding or pb2.AUDIO_ENCODING_PCM16
        self.in_rate, self.out_rate = in_rate, out_rate
        self._resampler = None if in_rate == out_rate else soxr.ResampleStream(
            in_rate, out_rate, 1, dtype="float32", quality="HQ")
        self._wav = self.encoding == pb2.AUDIO_ENCODING_WAV
        self._collect = self._wav and not stream
        self._pending: list[np.ndarray] = []
        self._header_sent = False
        bytes_per_sample = 4 if self.encoding == pb2.AUDIO_ENCODING_FLOAT32 else 2
        self._max_samples = max(1, max_chunk_bytes // bytes_per_sample)
        self.index = 0
        self.samples = 0      # samples emitted, at out_rate
        self.finished = False

    @property
    def seconds(self) -> float:
        return self.samples / self.out_rate

    def _encode(self, x: np.ndarray) -> bytes:
        if self.encoding == pb2.AUDIO_ENCODING_FLOAT32:
            return x.astype("<f4", copy=False).tobytes()
        return float_to_pcm16(x)

    def push(self, samples: np.ndarray, final: bool) -> list[pb2.AudioChunk]:
        if self.finished:
            raise RuntimeError("push after the final chunk")
        x = np.asarray(samples, dtype=np.float32).reshape(-1)
        if self._resampler is not None:
            x = self._resampler.resample_chunk(x, last=final)
        header = b""
        if self._collect:
            self._pending.append(x)
            if not final:
                return []
            x = np.concatenate(self._pending)
            self._pending = []
            header = wav_header(len(x), self.out_rate)
        elif self._wav and not self._header_sent and (len(x) or final):
            header = wav_header(None, self.out_rate)
        if not len(x) and not final:
            return []
        self._header_sent = self._header_sent or bool(header)
        pieces = [x[i:i + self._max_samples] for i in range(0, len(x), self._max_samples)] or [x]
        out = []
        for k, piece in enumerate(pieces):
            last = k == len(pieces) - 1
            out.append(pb2.AudioChunk(
                audio=(header if k == 0 else b"") + self._encode(piece),
                encoding=self.encoding, sample_rate=self.out_rate, index=self.index,
                is_final=final and last, sample_offset=self.samples, num_samples=len(piece)))
            self.index += 1
            self.samples += len(piece)
        self.finished = final
        return out


@dataclasses.dataclass
class _Output:
    """What the client asked the audio to be: encoding, sample rate, streamed or whole."""
    encoding: int
    sample_rate: int
    stream: bool
