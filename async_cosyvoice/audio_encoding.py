"""Streaming audio encoders: float32 mono chunks at the model rate -> bytes of one output format.

    encoder = AudioStreamEncoder("opus", 48000)            # source_rate defaults to 24000
    for chunk in chunks:
        send(encoder.encode(chunk.samples))                # may be b"" while a frame fills
    send(encoder.finish())                                 # the rest, then the stream is done

Concatenating everything `encode` and `finish` return gives a file of `format` that plays
(for `pcm`/`f32`, raw little-endian samples). FLAC is the one format that comes out whole at
`finish()`: its STREAMINFO header carries the length and the MD5 of the audio, and libsndfile
(python-soundfile) cannot read a FLAC whose header says "length unknown", which is all a stream
could send before its end. Resampling is one soxr stream per encoder, so chunk
boundaries are seamless and the output length is round(n * out_rate / source_rate).

The work is CPU-bound (resampling, codecs) and synchronous: transports call `encode`/`finish`
from an executor (`await loop.run_in_executor(None, encoder.encode, samples)`), never on the
event loop. An encoder holds no event-loop state, so any thread may call it, one call at a time.

Codecs come from PyAV (FFmpeg's libopus, libmp3lame, native aac and flac). Ogg Opus pages are
written here rather than by FFmpeg's ogg muxer: PyAV cannot flush a muxer mid-stream, and that
muxer holds a page back until the next one (up to 1 s by default), so each encode() would return
audio late. Our pager emits one page per encode() call with every packet the codec produced.
"""
from __future__ import annotations

import binascii
import dataclasses
import io
import struct

import av
import numpy as np
import soxr

from .errors import InvalidRequest

MIN_SAMPLE_RATE, MAX_SAMPLE_RATE = 8000, 192000


@dataclasses.dataclass(frozen=True)
class AudioFormat:
    """One output format: what it is called, its MIME type, how it is made and its limits."""
    name: str
    content_type: str
    codec: str | None = None          # FFmpeg encoder; None for the raw formats
    container: str | None = None      # FFmpeg muxer; None for raw formats and our Ogg pager
    sample_rates: tuple[int, ...] | None = None   # None: any rate in MIN..MAX_SAMPLE_RATE
    bitrate: int | None = None        # default bits/s for lossy codecs
    muxer_options: tuple[tuple[str, str], ...] = ()
    whole_file: bool = False          # the header needs the length: all bytes come out at finish()


_OPUS_RATES = (8000, 12000, 16000, 24000, 48000)
_MP3_RATES = (8000, 11025, 12000, 16000, 22050, 24000, 32000, 44100, 48000)
_AAC_RATES = (8000, 11025, 12000, 16000, 22050, 24000, 32000, 44100, 48000, 64000, 88200, 96000)

FORMATS: dict[str, AudioFormat] = {f.name: f for f in (
    AudioFormat("pcm", "audio/pcm"),                               # s16le, as OpenAI's "pcm"
    AudioFormat("f32", "audio/pcm;encoding=float32"),              # f32le in [-1, 1]
    AudioFormat("wav", "audio/wav"),
    AudioFormat("opus", "audio/ogg;codecs=opus", "libopus", None, _OPUS_RATES, 32000),
    # One cluster per packet: FFmpeg's matroska muxer writes a cluster when the next one starts,
    # so this keeps the hold-back to one 20 ms packet (the default 1 s cluster would hold 1 s).
    AudioFormat("webm", "audio/webm;codecs=opus", "libopus", "webm", _OPUS_RATES, 32000,
                (("cluster_time_limit", "0"), ("write_crc32", "0"), ("live", "1"))),
    AudioFormat("mp3", "audio/mpeg", "libmp3lame", "mp3", _MP3_RATES, 64000),
    AudioFormat("aac", "audio/aac", "aac", "adts", _AAC_RATES, 64000),
    # No 8 KiB PADDING block (room for tags edited in place; a response never is).
    AudioFormat("flac", "audio/flac", "flac", "flac", muxer_options=(("metadata_header_padding", "0"),),
                whole_file=True),
)}


def audio_format(name: str) -> AudioFormat:
    fmt = FORMATS.get(name)
    if fmt is None:
        raise InvalidRequest(f"unknown audio format {name!r}; choose one of {', '.join(FORMATS)}")
    return fmt


def check_sample_rate(fmt: AudioFormat, rate: int) -> int:
    """`rate` if `fmt` can be encoded at it; InvalidRequest saying which rates work otherwise."""
    if fmt.sample_rates is not None:
        if rate not in fmt.sample_rates:
            raise InvalidRequest(f"{fmt.name} supports sample rates {', '.join(map(str, fmt.sample_rates))} "
                                 f"Hz; got {rate}")
    elif not MIN_SAMPLE_RATE <= rate <= MAX_SAMPLE_RATE:
        raise InvalidRequest(f"{fmt.name} sample rate must be {MIN_SAMPLE_RATE}..{MAX_SAMPLE_RATE} Hz; got {rate}")
    return rate


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


class AudioStreamEncoder:
    """Float32 mono chunks at `source_rate` -> the bytes of `format` at `sample_rate_out`.

    `samples` counts the output-rate samples taken in so far (what the bytes returned so far
    and the codec's few buffered milliseconds represent).
    """

    def __init__(self, format: str, sample_rate_out: int, source_rate: int = 24000,
                 bitrate: int | None = None):
        self.audio_format = audio_format(format)
        self.sample_rate = check_sample_rate(self.audio_format, int(sample_rate_out))
        if source_rate <= 0:
            raise InvalidRequest(f"source sample rate must be positive; got {source_rate}")
        self.source_rate = source_rate
        self._resampler = None if source_rate == self.sample_rate else soxr.ResampleStream(
            source_rate, self.sample_rate, 1, dtype="float32", quality="HQ")
        self._sink = _codec_sink(self.audio_format, self.sample_rate, bitrate)
        self.samples = 0
        self.finished = False

    @property
    def format(self) -> str:
        return self.audio_format.name

    @property
    def content_type(self) -> str:
        return self.audio_format.content_type

    @property
    def seconds(self) -> float:
        return self.samples / self.sample_rate

    def encode(self, samples: np.ndarray) -> bytes:
        if self.finished:
            raise RuntimeError("encode() after finish()")
        x = np.asarray(samples, dtype=np.float32).reshape(-1)
        if self._resampler is not None:
            x = self._resampler.resample_chunk(x)
        self.samples += len(x)
        return self._sink.write(x)

    def finish(self) -> bytes:
        """The buffered rest and the container's end; the encoder takes nothing after this."""
        if self.finished:
            raise RuntimeError("finish() called twice")
        self.finished = True
        tail = b""
        if self._resampler is not None:
            x = self._resampler.resample_chunk(np.zeros(0, np.float32), last=True)
            self.samples += len(x)
            tail = self._sink.write(x)
        return tail + self._sink.close()


# ---- sinks: resampled float32 in, bytes out ----

class _RawSink:
    def __init__(self, fmt: AudioFormat, rate: int):
        self.header = wav_header(None, rate) if fmt.name == "wav" else b""
        self.to_bytes = (lambda x: x.astype("<f4", copy=False).tobytes()) if fmt.name == "f32" else float_to_pcm16

    def write(self, x: np.ndarray) -> bytes:
        if not len(x):
            return b""
        header, self.header = self.header, b""
        return header + self.to_bytes(x)

    def close(self) -> bytes:
        header, self.header = self.header, b""
        return header  # a stream with no audio still gets its WAV header


def _frame(x: np.ndarray, rate: int, pts: int) -> av.AudioFrame:
    frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(x)[None, :], format="flt", layout="mono")
    frame.sample_rate = rate
    frame.pts = pts
    return frame


class _Bytes:
    """Non-seekable write target for FFmpeg muxers (so they never seek back to patch headers)."""

    def __init__(self):
        self.data = bytearray()

    def write(self, b) -> int:
        self.data += b
        return len(b)

    def take(self) -> bytes:
        out = bytes(self.data)
        self.data.clear()
        return out


class _MuxedSink:
    """PyAV encoder + FFmpeg muxer writing into memory; each write returns what was muxed.

    A `whole_file` format is muxed into a seekable buffer instead, so the muxer's trailer seeks
    back and rewrites the header with the final counts (FLAC: total samples, frame sizes, MD5),
    and everything is returned by close().
    """

    def __init__(self, fmt: AudioFormat, rate: int, bitrate: int | None):
        self.rate = rate
        self.whole_file = fmt.whole_file
        self.out = io.BytesIO() if fmt.whole_file else _Bytes()
        options = {"flush_packets": "1", **dict(fmt.muxer_options)}
        self.container = av.open(self.out, "w", format=fmt.container, options=options)
        self.stream = self.container.add_stream(fmt.codec, rate=rate, layout="mono")
        if bitrate or fmt.bitrate:
            self.stream.bit_rate = bitrate or fmt.bitrate
        self.pts = 0
        self.container.start_encoding()  # the header goes out with the first write

    def write(self, x: np.ndarray) -> bytes:
        if len(x):
            self.container.mux(self.stream.encode(_frame(x, self.rate, self.pts)))
            self.pts += len(x)
        return b"" if self.whole_file else self.out.take()

    def close(self) -> bytes:
        self.container.mux(self.stream.encode(None))
        self.container.close()
        return self.out.getvalue() if self.whole_file else self.out.take()


class _OggOpusSink:
    """libopus packets in Ogg pages (RFC 7845): OpusHead, OpusTags, then one page per write."""

    VENDOR = b"async_cosyvoice"

    def __init__(self, fmt: AudioFormat, rate: int, bitrate: int | None):
        self.rate = rate
        self.codec = av.CodecContext.create(fmt.codec, "w")
        self.codec.sample_rate, self.codec.layout, self.codec.format = rate, "mono", "flt"
        self.codec.bit_rate = bitrate or fmt.bitrate
        self.codec.open()
        head = bytes(self.codec.extradata)                     # OpusHead, made by libopus
        self.pre_skip = struct.unpack_from("<H", head, 10)[0]  # in 48 kHz samples
        tags = b"OpusTags" + struct.pack("<I", len(self.VENDOR)) + self.VENDOR + struct.pack("<I", 0)
        self.pager = _OggPager()
        self.pending = self.pager.page([head], 0, bos=True) + self.pager.page([tags], 0)
        self.granule = 0
        self.pts = 0

    def _pages(self, packets, eos: bool = False) -> bytes:
        """Pages of <= 255 lacing values (an Opus packet is < 255 * 255 bytes, so never split)."""
        out, self.pending = self.pending, b""
        group: list[bytes] = []
        laces = 0
        for i, packet in enumerate(packets):
            data = bytes(packet)
            n = len(data) // 255 + 1
            if laces + n > 255:
                out += self.pager.page(group, self.granule)
                group, laces = [], 0
            group.append(data)
            laces += n
            # granule position: 48 kHz samples since the start, pre-skip included (RFC 7845 4)
            self.granule = self.pre_skip + (packet.pts + packet.duration) * 48000 // self.rate
        if group or eos:
            out += self.pager.page(group, self.granule, eos=eos)
        return out

    def write(self, x: np.ndarray) -> bytes:
        if not len(x):
            return b""
        packets = self.codec.encode(_frame(x, self.rate, self.pts))
        self.pts += len(x)
        return self._pages(packets)

    def close(self) -> bytes:
        return self._pages(self.codec.encode(None), eos=True)


class _OggPager:
    """Ogg pages (RFC 3533) holding whole packets, for one logical stream."""

    _REVERSE = bytes(int(f"{i:08b}"[::-1], 2) for i in range(256))

    def __init__(self, serial: int = 0x43565632):
        self.serial = serial
        self.sequence = 0

    @classmethod
    def crc(cls, data: bytes) -> int:
        """Ogg's CRC-32 (poly 0x04C11DB7, MSB first, init 0, no final xor) from zlib's reflected
        one: reverse each byte's bits, run it with init 0 and no final xor, reverse the result."""
        raw = ~binascii.crc32(data.translate(cls._REVERSE), 0xFFFFFFFF) & 0xFFFFFFFF
        return int(f"{raw:032b}"[::-1], 2)

    def page(self, packets: list[bytes], granule: int, bos: bool = False, eos: bool = False) -> bytes:
        lacing = b"".join(bytes([255] * (len(p) // 255) + [len(p) % 255]) for p in packets)
        assert len(lacing) <= 255, "caller splits packets over pages"
        flags = (2 if bos else 0) | (4 if eos else 0)
        page = struct.pack("<4sBBqIIIB", b"OggS", 0, flags, granule, self.serial, self.sequence, 0,
                           len(lacing)) + lacing + b"".join(packets)
        self.sequence += 1
        return page[:22] + struct.pack("<I", self.crc(page)) + page[26:]


def _codec_sink(fmt: AudioFormat, rate: int, bitrate: int | None):
    if fmt.codec is None:
        return _RawSink(fmt, rate)
    if fmt.container is None:
        return _OggOpusSink(fmt, rate, bitrate)
    return _MuxedSink(fmt, rate, bitrate)
