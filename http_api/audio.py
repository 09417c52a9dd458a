"""Encoded audio out: float32 chunks -> bytes of the requested format, encoded in a worker thread."""
from __future__ import annotations

import asyncio
from concurrent.futures import Executor

import numpy as np

from async_cosyvoice.audio_encoding import AudioStreamEncoder

OPENAI_FORMATS = ("mp3", "opus", "aac", "flac", "wav", "pcm")     # POST /v1/audio/speech
STREAM_FORMATS = ("pcm", "f32", "wav", "opus", "webm", "mp3", "aac", "flac")  # the WebSocket
OPENAI_SAMPLE_RATE = 24000  # OpenAI's pcm is 24 kHz s16le; the other formats follow it


class EncodedAudio:
    """One response's encoder. Calls are awaited one after another (the encoder keeps state)."""

    def __init__(self, encoder: AudioStreamEncoder, pool: Executor):
        self._encoder = encoder
        self._pool = pool
        self.content_type: str = encoder.content_type

    @classmethod
    async def open(cls, fmt: str, sample_rate_out: int, source_rate: int, pool: Executor) -> "EncodedAudio":
        loop = asyncio.get_running_loop()
        encoder = await loop.run_in_executor(pool, lambda: AudioStreamEncoder(fmt, sample_rate_out,
                                                                             source_rate=source_rate))
        return cls(encoder, pool)

    async def encode(self, samples: np.ndarray) -> bytes:
        return await asyncio.get_running_loop().run_in_executor(self._pool, self._encoder.encode, samples)

    async def finish(self) -> bytes:
        return await asyncio.get_running_loop().run_in_executor(self._pool, self._encoder.finish)
