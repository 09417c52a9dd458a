"""Streaming audio encoders: every format decodes back to the audio that went in."""
from __future__ import annotations

import io
import struct
from concurrent.futures import ThreadPoolExecutor

import av
import numpy as np
import pytest
import soundfile as sf

from async_cosyvoice.audio_encoding import FORMATS, AudioStreamEncoder, _OggPager
from async_cosyvoice.errors import InvalidRequest
from async_cosyvoice.frontend.audio import AudioError, load_audio, pcm_to_audio

SOURCE_RATE = 24000
CHUNK = 14400                       # 0.6 s at 24 kHz, the size of a streaming chunk
SIZES = [14400, 0, 4801, 23999, 960, 14400]   # uneven on purpose; 2.4 s in all
TONE_HZ = 440.0


def _tone(n: int, rate: int = SOURCE_RATE) -> np.ndarray:
    return (0.4 * np.sin(2 * np.pi * TONE_HZ * np.arange(n) / rate)).astype(np.float32)


def _stream(encoder: AudioStreamEncoder, x: np.ndarray, sizes: list[int]) -> list[bytes]:
    parts, start = [], 0
    for n in sizes:
        parts.append(encoder.encode(x[start:start + n]))
        start += n
    parts.append(encoder.finish())
    return parts


def _decode(data: bytes, fmt: str, rate: int) -> tuple[np.ndarray, int]:
    """Mono float32 samples and their rate, decoded by FFmpeg (raw formats by numpy)."""
    if fmt == "pcm":
        return np.frombuffer(data, "<i2").astype(np.float32) / 32767, rate
    if fmt == "f32":
        return np.frombuffer(data, "<f4"), rate
    frames, out_rate = [], None
    to_float = av.AudioResampler(format="flt", layout="mono")
    with av.open(io.BytesIO(data)) as container:
        for frame in container.decode(audio=0):
            out_rate = frame.sample_rate
            frames += [f.to_ndarray().reshape(-1) for f in to_float.resample(frame)]
    frames += [f.to_ndarray().reshape(-1) for f in to_float.resample(None)]
    return np.concatenate(frames), out_rate


def _dominant_hz(y: np.ndarray, rate: int) -> float:
    spectrum = np.abs(np.fft.rfft(y * np.hanning(len(y))))
    return float(np.argmax(spectrum) * rate / len(y))


# Exact formats decode to exactly the resampled length; lossy codecs without an end-trim field in
# their stream (mp3 without a seekable LAME tag, ADTS AAC) add priming/padding: at most 3 frames.
_SLACK_S = {"mp3": 3 * 1152, "aac": 3 * 1024}


@pytest.mark.parametrize("rate", [24000, 48000, 16000])
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_every_format_decodes_back_to_the_input(fmt, rate):
    x = _tone(sum(SIZES))
    encoder = AudioStreamEncoder(fmt, rate)
    data = b"".join(_stream(encoder, x, SIZES))
    expected = round(len(x) * rate / SOURCE_RATE)
    assert encoder.samples == expected
    y, out_rate = _decode(data, fmt, rate)
    duration, want = len(y) / out_rate, expected / rate
    slack = _SLACK_S.get(fmt, 0) / rate
    assert want - 1e-3 <= duration <= want + slack + 1e-3, (duration, want)
    assert abs(duration - want) < CHUNK / SOURCE_RATE       # the promise: within one chunk
    body = y[len(y) // 4: 3 * len(y) // 4]
    assert abs(_dominant_hz(body, out_rate) - TONE_HZ) < 5
    assert 0.7 < np.sqrt(np.mean(body ** 2)) / (0.4 / np.sqrt(2)) < 1.3
    if fmt in ("pcm", "f32", "wav", "flac"):     # lossless after resampling
        ref = AudioStreamEncoder("f32", rate)
        want_y = np.frombuffer(b"".join(_stream(ref, x, [len(x)])), "<f4")
        np.testing.assert_allclose(y[:len(want_y)], want_y, atol=1.5 / 32767 if fmt != "f32" else 1e-5)


LIBSNDFILE_READS = ("wav", "flac", "opus", "mp3")   # libsndfile 1.2.2 has no AAC and no WebM


def _read_like_a_user(data: bytes, fmt: str, rate: int) -> tuple[np.ndarray, int]:
    """What a Python user reads: python-soundfile (libsndfile) where it knows the format, PyAV otherwise."""
    if fmt in LIBSNDFILE_READS:
        y, out_rate = sf.read(io.BytesIO(data), dtype="float32")
        return y, out_rate
    return _decode(data, fmt, rate)


@pytest.mark.parametrize("chunks", ["streamed", "whole"])
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_every_format_round_trips(fmt, chunks):
    """Each format is read back at the right rate and length (libsndfile where it can: FLAC too,
    whose header must carry the length) and is accepted back as prompt audio."""
    rate = 48000
    x = _tone(sum(SIZES))
    encoder = AudioStreamEncoder(fmt, rate)
    data = b"".join(_stream(encoder, x, SIZES if chunks == "streamed" else [len(x)]))
    y, out_rate = _read_like_a_user(data, fmt, rate)
    assert out_rate == rate
    assert encoder.samples <= len(y) <= encoder.samples + _SLACK_S.get(fmt, 0), (len(y), encoder.samples)
    if fmt in ("wav", "flac", "opus", "pcm", "f32"):
        assert len(y) == encoder.samples
    if fmt in ("pcm", "f32"):
        prompt = pcm_to_audio(data, rate, "s16le" if fmt == "pcm" else "f32le")
    else:
        prompt = load_audio(data)
    assert prompt.sample_rate == rate and abs(len(prompt.samples) - len(y)) <= _SLACK_S.get(fmt, 0)
    assert abs(_dominant_hz(prompt.samples[len(y) // 4: len(y) // 2], rate) - TONE_HZ) < 5


def test_flac_comes_out_whole_with_its_length_in_the_header():
    encoder = AudioStreamEncoder("flac", 24000)
    x = _tone(3 * CHUNK)
    assert encoder.encode(x[:CHUNK]) == b"" and encoder.encode(x[CHUNK:]) == b""
    data = encoder.finish()
    assert data[:4] == b"fLaC" and data[4] & 0x7F == 0          # STREAMINFO first
    streaminfo = data[8:8 + 34]
    total = int.from_bytes(streaminfo[13:18], "big") & (2 ** 36 - 1)
    assert total == len(x) and streaminfo[18:34] != bytes(16)   # the length and the MD5 are set
    assert sf.info(io.BytesIO(data)).frames == len(x)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_streaming_equals_one_shot(fmt):
    x = _tone(sum(SIZES))
    chunked = _stream(AudioStreamEncoder(fmt, 24000), x, SIZES)
    whole = b"".join(_stream(AudioStreamEncoder(fmt, 24000), x, [len(x)]))
    data = b"".join(chunked)
    if fmt in ("pcm", "f32", "wav"):
        header = 44 if fmt == "wav" else 0
        assert len(data) == header + len(x) * (4 if fmt == "f32" else 2)
        assert data == whole
    else:
        assert len(_decode(data, fmt, 24000)[0]) == len(_decode(whole, fmt, 24000)[0])
    assert chunked[1] == b""            # an empty chunk in gives nothing out


def test_streaming_resampled_length_is_exact():
    x = _tone(sum(SIZES))
    encoder = AudioStreamEncoder("pcm", 22050)
    data = b"".join(_stream(encoder, x, SIZES))
    assert len(data) == 2 * round(len(x) * 22050 / 24000) == 2 * encoder.samples


def test_first_chunk_comes_out_at_once():
    """Each 0.6 s chunk returns bytes right away (no container holds a page back for long)."""
    x = _tone(CHUNK)
    for fmt in FORMATS:
        if FORMATS[fmt].whole_file:     # FLAC: its header needs the length (test above)
            continue
        encoder = AudioStreamEncoder(fmt, 24000)
        first = encoder.encode(x)
        assert first, fmt
        if fmt not in ("pcm", "f32"):
            y, rate = _decode(first, fmt, 24000)
            assert len(y) / rate > 0.4, (fmt, len(y) / rate)   # most of the chunk is playable


def test_ogg_opus_pages_end_with_the_exact_granule():
    x = _tone(sum(SIZES))
    data = b"".join(_stream(AudioStreamEncoder("opus", 24000), x, SIZES))
    pages, pos = [], 0
    while pos < len(data):
        assert data[pos:pos + 4] == b"OggS"
        flags, granule, _, seq, _, nseg = struct.unpack_from("<BqIIIB", data, pos + 5)
        size = 27 + nseg + sum(data[pos + 27:pos + 27 + nseg])
        pages.append((flags, granule, seq))
        pos += size
    assert [p[2] for p in pages] == list(range(len(pages)))
    assert pages[0][0] == 2 and pages[-1][0] == 4              # BOS first, EOS last
    pre_skip = struct.unpack_from("<H", data, 28 + 10)[0]
    assert pages[-1][1] == pre_skip + len(x) * 2               # granule at 48 kHz


def test_ogg_crc_matches_ffmpeg():
    out = io.BytesIO()
    with av.open(out, "w", format="ogg") as container:
        stream = container.add_stream("libopus", rate=24000, layout="mono")
        frame = av.AudioFrame.from_ndarray(_tone(4800)[None, :], format="flt", layout="mono")
        frame.sample_rate, frame.pts = 24000, 0
        container.mux(stream.encode(frame))
        container.mux(stream.encode(None))
    data = out.getvalue()
    nseg = data[26]
    page = data[:27 + nseg + sum(data[27:27 + nseg])]
    assert _OggPager.crc(page[:22] + b"\0" * 4 + page[26:]) == struct.unpack_from("<I", page, 22)[0]


def test_encoders_run_in_a_thread_pool():
    """No event loop and no shared state: parallel encoders give what sequential ones give."""
    x = _tone(4 * CHUNK)
    fmts = list(FORMATS)

    def encode(fmt):
        return b"".join(_stream(AudioStreamEncoder(fmt, 48000), x, [CHUNK] * 4))

    sequential = [encode(f) for f in fmts]
    with ThreadPoolExecutor(4) as pool:
        parallel = list(pool.map(encode, fmts))
    for fmt, a, b in zip(fmts, sequential, parallel):
        if fmt in ("pcm", "f32", "wav", "flac", "opus"):
            assert a == b, fmt
        else:
            assert len(_decode(a, fmt, 48000)[0]) == len(_decode(b, fmt, 48000)[0])


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_empty_stream_finishes(fmt):
    encoder = AudioStreamEncoder(fmt, 24000)
    data = encoder.finish()
    assert encoder.samples == 0
    if fmt == "wav":
        assert len(data) == 44 and sf.read(io.BytesIO(data))[0].size == 0
    with pytest.raises(RuntimeError, match="after finish"):
        encoder.encode(_tone(10))


@pytest.mark.parametrize("fmt, rate, message", [
    ("ogg", 24000, "unknown audio format 'ogg'; choose one of pcm, f32, wav, opus, webm, mp3, aac, flac"),
    ("opus", 44100, "opus supports sample rates 8000, 12000, 16000, 24000, 48000 Hz; got 44100"),
    ("webm", 22050, "webm supports sample rates 8000, 12000, 16000, 24000, 48000 Hz; got 22050"),
    ("mp3", 96000, "mp3 supports sample rates 8000, 11025, 12000, 16000, 22050, 24000, 32000, 44100, "
                   "48000 Hz; got 96000"),
    ("aac", 7000, "aac supports sample rates"),
    ("pcm", 4000, "pcm sample rate must be 8000..192000 Hz; got 4000"),
    ("flac", 200000, "flac sample rate must be 8000..192000 Hz; got 200000"),
])
def test_bad_format_or_rate(fmt, rate, message):
    with pytest.raises(InvalidRequest) as e:
        AudioStreamEncoder(fmt, rate)
    assert str(e.value).startswith(message)


def test_properties():
    encoder = AudioStreamEncoder("mp3", 24000)
    assert encoder.format == "mp3" and encoder.content_type == "audio/mpeg"
    assert AudioStreamEncoder("webm", 48000).content_type == "audio/webm;codecs=opus"


@pytest.mark.parametrize("upload", [
    b"#EXTM3U\n#EXT-X-TARGETDURATION:10\n#EXTINF:10,\nfile:///etc/passwd\n#EXT-X-ENDLIST\n",
    b"ffconcat version 1.0\nfile '/etc/passwd'\n",
], ids=["hls", "concat"])
def test_prompt_audio_is_never_a_list_of_other_files(upload):
    """FFmpeg decodes what libsndfile cannot, but only audio files: no playlist or concat list."""
    with pytest.raises(AudioError, match="cannot decode"):
        load_audio(upload)
