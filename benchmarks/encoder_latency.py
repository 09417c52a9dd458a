"""Streaming output encoders: bitrate and the latency each adds to a 0.6 s chunk, per format.

Feeds 24 kHz audio (tests/data/prompt.wav resampled, or --input) to `AudioStreamEncoder` in
0.6 s chunks, as the synthesizer produces them, and prints per format:
  kbit/s        size of the whole stream / its duration
  encode ms     wall time of one encode() call (median, p99 over chunks; first call excluded)
  held ms       audio taken in but not yet decodable from the bytes returned so far (median over
                chunks): the codec frame being filled + lookahead + container hold-back
  added ms      encode + held, what a listener waits for beyond the synthesizer

    python benchmarks/encoder_latency.py [--rate 24000] [--chunks 20] [--input FILE]
"""
from __future__ import annotations

import argparse
import io
import time

import av
import numpy as np
import soundfile as sf
import soxr

from async_cosyvoice.audio_encoding import FORMATS, AudioStreamEncoder

SOURCE_RATE = 24000
CHUNK = int(0.6 * SOURCE_RATE)


def decodable_seconds(data: bytes, fmt: str, rate: int) -> float:
    if fmt in ("pcm", "f32"):
        return len(data) / (2 if fmt == "pcm" else 4) / rate
    if not data:
        return 0.0
    n, out_rate = 0, rate
    try:
        with av.open(io.BytesIO(data)) as container:
            for frame in container.decode(audio=0):
                n += frame.samples
                out_rate = frame.sample_rate
    except av.error.FFmpegError:   # a cut-off tail: count what decoded before it
        pass
    return n / out_rate


def source_audio(path: str, seconds: float) -> np.ndarray:
    x, rate = sf.read(path, dtype="float32", always_2d=True)
    x = soxr.resample(x.mean(axis=1), rate, SOURCE_RATE)
    reps = int(np.ceil(seconds * SOURCE_RATE / len(x)))
    return np.tile(x, reps)[:int(seconds * SOURCE_RATE)].astype(np.float32)


def measure(fmt: str, rate: int, x: np.ndarray) -> dict:
    encoder = AudioStreamEncoder(fmt, rate)
    data, times, held = b"", [], []
    for k in range(len(x) // CHUNK):
        start = time.perf_counter()
        data += encoder.encode(x[k * CHUNK:(k + 1) * CHUNK])
        times.append(time.perf_counter() - start)
        taken = (k + 1) * CHUNK / SOURCE_RATE
        held.append(max(0.0, taken - decodable_seconds(data, fmt, rate)))
    data += encoder.finish()
    seconds = len(x) // CHUNK * CHUNK / SOURCE_RATE
    encode_ms = np.array(times[1:]) * 1e3
    return dict(kbps=len(data) * 8 / seconds / 1e3, encode_median=np.median(encode_ms),
                encode_p99=np.percentile(encode_ms, 99), first_ms=times[0] * 1e3,
                held_median=np.median(held) * 1e3, added=np.median(encode_ms) + np.median(held) * 1e3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", type=int, default=24000, help="output sample rate (Hz)")
    parser.add_argument("--chunks", type=int, default=20, help="0.6 s chunks per format")
    parser.add_argument("--input", default="tests/data/prompt.wav", help="audio file to encode")
    args = parser.parse_args()
    x = source_audio(args.input, args.chunks * 0.6)
    print(f"{args.chunks} chunks of 0.6 s, 24 kHz in, {args.rate} Hz out, input {args.input}")
    print(f"{'format':6} {'kbit/s':>8} {'encode ms (median/p99)':>24} {'first call ms':>14} "
          f"{'held ms':>8} {'added ms':>9}")
    for fmt in FORMATS:
        rate = args.rate
        if FORMATS[fmt].sample_rates and rate not in FORMATS[fmt].sample_rates:
            print(f"{fmt:6} (no {rate} Hz)")
            continue
        r = measure(fmt, rate, x)
        print(f"{fmt:6} {r['kbps']:8.1f} {r['encode_median']:13.2f} / {r['encode_p99']:6.2f} "
              f"{r['first_ms']:14.2f} {r['held_median']:8.1f} {r['added']:9.1f}")


if __name__ == "__main__":
    main()
