"""Audio out over gRPC: `AudioEncoding` <-> the library's formats, encoded bytes -> `AudioChunk`s.

The encoding itself (resampling, codecs, containers) is `async_cosyvoice.audio_encoding`; this
module only numbers and sizes the messages. `AudioEncoder.push` does CPU work: the servicer calls
it in a worker thread.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from async_cosyvoice.audio_encoding import (MAX_SAMPLE_RATE, MIN_SAMPLE_RATE, AudioStreamEncoder,
                                            audio_format, check_sample_rate, float_to_pcm16, wav_header)

from ._stubs import load as _load_stubs

pb2, _ = _load_stubs()

__all__ = ["AudioEncoder", "DEFAULT_ENCODING", "ENCODING_FORMATS", "MAX_CHUNK_BYTES", "float_to_pcm16", "wav_header"]

MAX_CHUNK_BYTES = 1 << 20      # larger payloads are split over several AudioChunks

# AudioEncoding value -> library format name (UNSPECIFIED is PCM16).
ENCODING_FORMATS: dict[int, str] = {
    pb2.AUDIO_ENCODING_UNSPECIFIED: "pcm",
    pb2.AUDIO_ENCODING_PCM16: "pcm",
    pb2.AUDIO_ENCODING_FLOAT32: "f32",
    pb2.AUDIO_ENCODING_WAV: "wav",
    pb2.AUDIO_ENCODING_OPUS: "opus",
    pb2.AUDIO_ENCODING_MP3: "mp3",
    pb2.AUDIO_ENCODING_AAC: "aac",
    pb2.AUDIO_ENCODING_FLAC: "flac",
    pb2.AUDIO_ENCODING_WEBM_OPUS: "webm",
}
DEFAULT_ENCODING = pb2.AUDIO_ENCODING_PCM16
_BYTES_PER_SAMPLE = {"pcm": 2, "wav": 2, "f32": 4}   # raw formats; compressed ones have none


def encoding_info() -> list[pb2.AudioEncodingInfo]:
    """What GetServerInfo says about each encoding (from the library's format table)."""
    out = []
    for encoding, name in ENCODING_FORMATS.items():
        if encoding == pb2.AUDIO_ENCODING_UNSPECIFIED:
            continue
        fmt = audio_format(name)
        rates = fmt.sample_rates or ()
        out.append(pb2.AudioEncodingInfo(
            encoding=encoding, content_type=fmt.content_type, sample_rates=rates,
            min_sample_rate=min(rates) if rates else MIN_SAMPLE_RATE,
            max_sample_rate=max(rates) if rates else MAX_SAMPLE_RATE, bitrate=fmt.bitrate or 0))
    return out


def check_output(encoding: int, sample_rate: int) -> None:
    """InvalidRequest when `encoding` cannot be produced at `sample_rate` (message names the rates)."""
    check_sample_rate(audio_format(ENCODING_FORMATS[encoding]), sample_rate)


class AudioEncoder:
    """Float32 chunks at the model rate -> AudioChunk messages in the requested encoding and rate.

    `sample_offset` and `num_samples` count samples at the output rate. For raw encodings a
    chunk's `num_samples` are exactly its samples; for compressed ones they are the samples fed to
    the codec since the previous chunk (a codec holds back a frame or so, sent in later chunks).
    WAV non-stream collects everything so the header carries exact sizes.
    """

    def __init__(self, encoding: int, in_rate: int, out_rate: int, stream: bool,
                 max_chunk_bytes: int = MAX_CHUNK_BYTES):
        self.encoding = encoding or DEFAULT_ENCODING
        fmt = ENCODING_FORMATS[self.encoding]
        self.out_rate = out_rate
        self._collect = fmt == "wav" and not stream
        self._wav_stream = fmt == "wav" and stream
        self._encoder = AudioStreamEncoder("pcm" if self._collect else fmt, out_rate, in_rate)
        self._pending = bytearray()
        self._unsent = 0      # samples fed to the encoder and not yet reported in a chunk
        bytes_per_sample = _BYTES_PER_SAMPLE.get(fmt)
        self._raw = bytes_per_sample is not None
        step = bytes_per_sample or 1
        self._max_bytes = max(step, max_chunk_bytes // step * step)
        self._step = step
        self.index = 0
        self.samples = 0      # samples reported in chunks, at out_rate
        self.finished = False

    @property
    def seconds(self) -> float:
        return self.samples / self.out_rate

    def push(self, samples: np.ndarray, final: bool) -> list[pb2.AudioChunk]:
        if self.finished:
            raise RuntimeError("push after the final chunk")
        before = self._encoder.samples
        data = self._encoder.encode(samples)
        if final:
            data += self._encoder.finish()
        self._unsent += self._encoder.samples - before
        header = b""
        if self._collect:
            self._pending += data
            if not final:
                return []
            data, self._pending = bytes(self._pending), bytearray()
            header = wav_header(len(data) // 2, self.out_rate)
        elif self._wav_stream and self.index == 0:    # the header is no sample
            header, data = data[:44], data[44:]
        if not data and not header and not final:
            return []
        pieces = [data[i:i + self._max_bytes] for i in range(0, len(data), self._max_bytes)] or [b""]
        out = []
        for k, piece in enumerate(pieces):
            last = k == len(pieces) - 1
            n = len(piece) // self._step if self._raw else (self._unsent if k == 0 else 0)
            out.append(pb2.AudioChunk(
                audio=(header if k == 0 else b"") + piece, encoding=self.encoding,
                sample_rate=self.out_rate, index=self.index, is_final=final and last,
                sample_offset=self.samples, num_samples=n))
            self.index += 1
            self.samples += n
        self._unsent = 0
        self.finished = final
        return out


@dataclasses.dataclass
class _Output:
    """What the client asked the audio to be: encoding, sample rate, streamed or whole."""
    encoding: int
    sample_rate: int
    stream: bool
