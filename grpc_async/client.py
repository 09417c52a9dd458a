"""Async client for the CosyVoice gRPC service (the command line is `async-cosyvoice ... --target`).

    import asyncio
    from grpc_async.client import CosyVoiceClient, collect

    async def main():
        async with CosyVoiceClient("127.0.0.1:50051") as client:
            info = await client.get_server_info()
            await client.register_speaker("alice", "transcript of the prompt", "prompt.wav",
                                          overwrite=True)
            result = await collect(client.synthesize("Hello there.", speaker_id="alice"))
            print(f"{len(result.audio) / result.sample_rate:.2f} s of audio from {info.model}")
            ogg = await collect(client.synthesize("Hello there.", speaker_id="alice", encoding="opus"))
            open("hello.opus", "wb").write(ogg.data)      # compressed: the file's bytes

    asyncio.run(main())

`synthesize` picks the mode from what it is given (see `infer_mode`) unless `mode` is set. The
default encoding is the server's (PCM16; `encoding=None` leaves it UNSPECIFIED).
"""
from __future__ import annotations

import asyncio
import io
import os
from dataclasses import dataclass
from pathlib import Path
from typing import AsyncIterable, AsyncIterator, Iterable, Sequence, Union

import av
import grpc
import numpy as np

from ._stubs import load as _load_stubs

pb2, pb2_grpc = _load_stubs()

DEFAULT_TARGET = "127.0.0.1:50051"
TOKEN_ENV = "ASYNC_COSYVOICE_TOKEN"
WAV_HEADER_BYTES = 44

# Prompt/source audio: a file path, a whole file's bytes, (samples, sample_rate), or AudioData.
AudioInput = Union[str, os.PathLike, bytes, tuple, "pb2.AudioData"]

ENCODINGS = {"pcm16": pb2.AUDIO_ENCODING_PCM16, "float32": pb2.AUDIO_ENCODING_FLOAT32,
             "wav": pb2.AUDIO_ENCODING_WAV, "opus": pb2.AUDIO_ENCODING_OPUS, "mp3": pb2.AUDIO_ENCODING_MP3,
             "aac": pb2.AUDIO_ENCODING_AAC, "flac": pb2.AUDIO_ENCODING_FLAC,
             "webm": pb2.AUDIO_ENCODING_WEBM_OPUS}
RAW_ENCODINGS = (pb2.AUDIO_ENCODING_PCM16, pb2.AUDIO_ENCODING_FLOAT32, pb2.AUDIO_ENCODING_WAV)
FILE_SUFFIXES = {"opus": ".opus", "mp3": ".mp3", "aac": ".aac", "flac": ".flac", "webm": ".webm"}
MODES = ("zero_shot", "cross_lingual", "instruct2", "sft", "zero_shot_by_spk_id",
         "instruct2_by_spk_id", "vc")


def audio_data(audio: AudioInput) -> pb2.AudioData:
    """AudioData from a path (sent as file bytes), file bytes, or (float samples, rate)."""
    if isinstance(audio, pb2.AudioData):
        return audio
    if isinstance(audio, (str, os.PathLike)):
        return pb2.AudioData(file=Path(audio).read_bytes())
    if isinstance(audio, (bytes, bytearray, memoryview)):
        return pb2.AudioData(file=bytes(audio))
    if isinstance(audio, tuple) and len(audio) == 2:
        samples, rate = audio
        x = np.asarray(samples, dtype="<f4")
        channels = 1 if x.ndim == 1 else x.shape[1]
        return pb2.AudioData(pcm=pb2.RawPcm(data=x.tobytes(), encoding=pb2.PCM_ENCODING_F32LE,
                                            sample_rate=int(rate), channels=channels))
    raise TypeError(f"cannot send {type(audio).__name__} as audio: pass a path, file bytes, "
                    "(samples, sample_rate) or AudioData")


def infer_mode(*, speaker_id: str | None, prompt_audio, prompt_text: str | None,
               instruct_text: str | None, source_audio) -> str:
    """source_audio -> vc; speaker_id -> zero_shot_by_spk_id (instruct2_by_spk_id with an
    instruction); prompt_audio -> zero_shot with prompt_text, instruct2 with an instruction,
    else cross_lingual. sft must be asked for explicitly."""
    if source_audio is not None:
        return "vc"
    if speaker_id:
        return "instruct2_by_spk_id" if instruct_text else "zero_shot_by_spk_id"
    if prompt_audio is not None:
        if instruct_text:
            return "instruct2"
        return "zero_shot" if prompt_text else "cross_lingual"
    raise ValueError("say whose voice: speaker_id, prompt_audio (+ prompt_text), or source_audio for vc")


def _voice(mode: str, *, speaker_id, prompt_audio, prompt_text, instruct_text, source_audio):
    """(oneof field name, mode message)."""
    if mode == "zero_shot":
        return mode, pb2.ZeroShot(prompt_text=prompt_text or "", prompt_audio=audio_data(prompt_audio))
    if mode == "cross_lingual":
        return mode, pb2.CrossLingual(prompt_audio=audio_data(prompt_audio))
    if mode == "instruct2":
        return mode, pb2.Instruct2(instruct_text=instruct_text or "", prompt_audio=audio_data(prompt_audio))
    if mode == "sft":
        return mode, pb2.Sft(speaker_id=speaker_id or "")
    if mode == "zero_shot_by_spk_id":
        return mode, pb2.ZeroShotBySpeaker(speaker_id=speaker_id or "")
    if mode == "instruct2_by_spk_id":
        return mode, pb2.Instruct2BySpeaker(speaker_id=speaker_id or "", instruct_text=instruct_text or "")
    if mode == "vc":
        return mode, pb2.VoiceConversion(source_audio=audio_data(source_audio),
                                         prompt_audio=audio_data(prompt_audio))
    raise ValueError(f"unknown mode {mode!r}; one of {', '.join(MODES)}")


def options(*, stream: bool = False, speed: float | None = None, text_frontend: bool | None = None,
            encoding: str | int | None = None, sample_rate: int = 0, seed: int | None = None,
            max_tokens: int | None = None) -> pb2.SynthesisOptions:
    """SynthesisOptions; `encoding` None leaves the server's default (PCM16)."""
    if isinstance(encoding, str) and encoding not in ENCODINGS:
        raise ValueError(f"unknown encoding {encoding}; one of {', '.join(ENCODINGS)}")
    o = pb2.SynthesisOptions(stream=stream, sample_rate=sample_rate,
                             encoding=ENCODINGS[encoding] if isinstance(encoding, str) else encoding or 0)
    if speed is not None:
        o.speed = speed
    if text_frontend is not None:
        o.text_frontend = text_frontend
    if seed is not None:
        o.seed = seed
    if max_tokens is not None:
        o.max_tokens = max_tokens
    return o


def chunk_samples(chunk: pb2.AudioChunk) -> np.ndarray:
    """The float32 samples of one PCM16/FLOAT32/WAV chunk (WAV header stripped). Compressed
    chunks are pieces of one stream: `collect` the response and use `Synthesis.audio`."""
    if chunk.encoding not in RAW_ENCODINGS:
        raise ValueError(f"{pb2.AudioEncoding.Name(chunk.encoding)} chunks are not samples; decode the "
                         "concatenated stream (collect(...).audio)")
    data = chunk.audio
    if chunk.encoding == pb2.AUDIO_ENCODING_FLOAT32:
        return np.frombuffer(data, dtype="<f4").astype(np.float32)
    if chunk.encoding == pb2.AUDIO_ENCODING_WAV and chunk.index == 0:
        data = data[WAV_HEADER_BYTES:]
    return np.frombuffer(data, dtype="<i2").astype(np.float32) / 32768.0


def decode_stream(data: bytes) -> tuple[np.ndarray, int]:
    """Mono float32 samples and their rate from a whole compressed stream (Ogg/WebM Opus, MP3,
    AAC, FLAC), decoded by FFmpeg (PyAV). Opus decodes at 48 kHz whatever rate was encoded."""
    to_float = av.AudioResampler(format="flt", layout="mono")
    parts, rate = [], 0
    with av.open(io.BytesIO(data)) as container:
        for frame in container.decode(audio=0):
            rate = frame.sample_rate
            parts += [f.to_ndarray().reshape(-1) for f in to_float.resample(frame)]
    parts += [f.to_ndarray().reshape(-1) for f in to_float.resample(None)]
    return (np.concatenate(parts) if parts else np.zeros(0, np.float32)), rate


@dataclass
class Synthesis:
    audio: np.ndarray           # float32 mono (compressed encodings: decoded)
    sample_rate: int            # of `audio`
    chunks: int
    summary: pb2.SynthesisSummary
    encoding: int = pb2.AUDIO_ENCODING_PCM16
    data: bytes = b""           # the concatenated `audio` bytes as sent (a file for WAV/compressed)


async def collect(chunks: AsyncIterable[pb2.AudioChunk]) -> Synthesis:
    """Gather a response's chunks (checks indices and the final marker); decodes compressed audio."""
    data, rate, n, summary, encoding = [], 0, 0, pb2.SynthesisSummary(), pb2.AUDIO_ENCODING_PCM16
    async for chunk in chunks:
        if chunk.index != n:
            raise RuntimeError(f"chunk {chunk.index} arrived, expected {n}")
        data.append(chunk.audio)
        rate, encoding = chunk.sample_rate, chunk.encoding
        n += 1
        if chunk.is_final:
            summary = chunk.summary
    if not n:
        raise RuntimeError("the server sent no audio")
    stream = b"".join(data)
    if encoding in RAW_ENCODINGS:
        parts = [chunk_samples(pb2.AudioChunk(audio=d, encoding=encoding, index=i)) for i, d in enumerate(data)]
        return Synthesis(np.concatenate(parts), rate, n, summary, encoding, stream)
    audio, decoded_rate = decode_stream(stream)
    return Synthesis(audio, decoded_rate or rate, n, summary, encoding, stream)


def fix_wav_sizes(data: bytes) -> bytes:
    """Rewrite the RIFF and data sizes of a streamed WAV (sent as 0xFFFFFFFF) to the real ones."""
    if len(data) < WAV_HEADER_BYTES or data[:4] != b"RIFF" or data[36:40] != b"data":
        raise ValueError("not a 44-byte-header PCM WAV")
    body = len(data) - WAV_HEADER_BYTES
    return (data[:4] + (36 + body).to_bytes(4, "little") + data[8:40] + body.to_bytes(4, "little")
            + data[WAV_HEADER_BYTES:])


class CosyVoiceClient:
    """Async client. `tls`: False (plaintext), True (system roots) or PEM root certificate bytes /
    path; `client_cert` = (key PEM, cert PEM) for mTLS. The token is sent as bearer metadata."""

    def __init__(self, target: str = DEFAULT_TARGET, token: str | None = None,
                 tls: bool | bytes | str | os.PathLike = False,
                 client_cert: tuple[bytes, bytes] | None = None,
                 max_message_bytes: int = 64 * 1024 * 1024, options: Sequence[tuple] = ()):
        self.target = target
        self._token_md = (("authorization", f"Bearer {token}"),) if token else ()
        opts = [("grpc.max_receive_message_length", max_message_bytes),
                ("grpc.max_send_message_length", max_message_bytes), *options]
        if tls is False:
            self.channel = grpc.aio.insecure_channel(target, options=opts)
        else:
            roots = None
            if isinstance(tls, (str, os.PathLike)):
                roots = Path(tls).read_bytes()
            elif isinstance(tls, bytes):
                roots = tls
            key, cert = client_cert or (None, None)
            creds = grpc.ssl_channel_credentials(roots, key, cert)
            self.channel = grpc.aio.secure_channel(target, creds, options=opts)
        self.stub = pb2_grpc.CosyVoiceStub(self.channel)

    async def __aenter__(self) -> "CosyVoiceClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        await self.channel.close()

    def _md(self, metadata=()) -> tuple:
        return self._token_md + tuple(metadata)

    async def wait_ready(self, timeout: float = 60.0) -> None:
        """Wait until the server's health service reports SERVING (connect, then follow its Watch
        stream: the server pushes each status change, nothing is polled)."""
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        async def serving() -> None:
            await self.channel.channel_ready()
            watch = health_pb2_grpc.HealthStub(self.channel).Watch(health_pb2.HealthCheckRequest(service=""))
            try:
                async for r in watch:
                    if r.status == health_pb2.HealthCheckResponse.SERVING:
                        return
            finally:
                watch.cancel()
            raise ConnectionError(f"{self.target} closed its health stream before SERVING")

        try:
            await asyncio.wait_for(serving(), timeout)
        except asyncio.TimeoutError:
            raise TimeoutError(f"{self.target} not SERVING after {timeout} s") from None

    # ---- synthesis ----

    def synthesize_request(self, text: str = "", *, mode: str | None = None, speaker_id: str | None = None,
                           prompt_audio: AudioInput | None = None, prompt_text: str | None = None,
                           instruct_text: str | None = None, source_audio: AudioInput | None = None,
                           request_id: str = "", **opts) -> pb2.SynthesizeRequest:
        mode = mode or infer_mode(speaker_id=speaker_id, prompt_audio=prompt_audio, prompt_text=prompt_text,
                                  instruct_text=instruct_text, source_audio=source_audio)
        field, msg = _voice(mode, speaker_id=speaker_id, prompt_audio=prompt_audio, prompt_text=prompt_text,
                            instruct_text=instruct_text, source_audio=source_audio)
        return pb2.SynthesizeRequest(text=text, options=options(**opts), request_id=request_id, **{field: msg})

    async def synthesize(self, text: str = "", *, timeout: float | None = None, metadata=(),
                         **kwargs) -> AsyncIterator[pb2.AudioChunk]:
        """Chunks of one synthesis. Keyword arguments: the voice (mode, speaker_id, prompt_audio,
        prompt_text, instruct_text, source_audio), options (stream, speed, text_frontend, encoding
        (a key of ENCODINGS; None = the server's PCM16), sample_rate, seed, max_tokens) and
        request_id. Leaving the loop early (or
        cancelling) cancels the RPC, which stops the work on the server."""
        request = kwargs.pop("request", None) or self.synthesize_request(text, **kwargs)
        call = self.stub.Synthesize(request, timeout=timeout, metadata=self._md(metadata))
        try:
            async for chunk in call:
                yield chunk
        finally:
            call.cancel()

    async def stream_synthesize(self, text_pieces: AsyncIterable[str] | Iterable[str], *, mode: str | None = None,
                                speaker_id: str | None = None, prompt_audio: AudioInput | None = None,
                                prompt_text: str | None = None, instruct_text: str | None = None,
                                request_id: str = "", timeout: float | None = None, metadata=(),
                                text_mode: str | None = None, text_normalization: str | None = None,
                                **opts) -> AsyncIterator[pb2.AudioChunk]:
        """Bidirectional: sends the voice config, then each text piece as it comes, then `end`;
        yields audio while pieces are still being sent. text_mode: "bistream" or "sentence"
        (None: the server's default, GetServerInfo's default_text_mode); text_normalization
        (bistream): "safe" or "raw" (None: safe)."""
        mode = mode or infer_mode(speaker_id=speaker_id, prompt_audio=prompt_audio, prompt_text=prompt_text,
                                  instruct_text=instruct_text, source_audio=None)
        field, msg = _voice(mode, speaker_id=speaker_id, prompt_audio=prompt_audio, prompt_text=prompt_text,
                            instruct_text=instruct_text, source_audio=None)
        modes = {None: pb2.TEXT_MODE_UNSPECIFIED, "bistream": pb2.TEXT_MODE_BISTREAM, "sentence": pb2.TEXT_MODE_SENTENCE}
        normalizations = {None: pb2.TEXT_NORMALIZATION_UNSPECIFIED, "safe": pb2.TEXT_NORMALIZATION_SAFE,
                          "raw": pb2.TEXT_NORMALIZATION_RAW}
        config = pb2.StreamConfig(options=options(**opts), request_id=request_id, text_mode=modes[text_mode],
                                  text_normalization=normalizations[text_normalization], **{field: msg})

        async def requests():
            yield pb2.StreamSynthesizeRequest(config=config)
            if hasattr(text_pieces, "__aiter__"):
                async for piece in text_pieces:
                    yield pb2.StreamSynthesizeRequest(text=piece)
            else:
                for piece in text_pieces:
                    yield pb2.StreamSynthesizeRequest(text=piece)
            yield pb2.StreamSynthesizeRequest(end=pb2.StreamEnd())

        call = self.stub.StreamSynthesize(requests(), timeout=timeout, metadata=self._md(metadata))
        try:
            async for chunk in call:
                yield chunk
        finally:
            call.cancel()

    # ---- speakers ----

    async def register_speaker(self, speaker_id: str, prompt_text: str, prompt_audio: AudioInput,
                               overwrite: bool = False, timeout: float | None = None) -> pb2.Speaker:
        request = pb2.RegisterSpeakerRequest(speaker_id=speaker_id, prompt_text=prompt_text,
                                             prompt_audio=audio_data(prompt_audio), overwrite=overwrite)
        return await self.stub.RegisterSpeaker(request, timeout=timeout, metadata=self._md())

    async def get_speaker(self, speaker_id: str, timeout: float | None = None) -> pb2.Speaker:
        return await self.stub.GetSpeaker(pb2.GetSpeakerRequest(speaker_id=speaker_id),
                                          timeout=timeout, metadata=self._md())

    async def list_speakers(self, page_size: int = 0, page_token: str = "",
                            timeout: float | None = None) -> pb2.ListSpeakersResponse:
        return await self.stub.ListSpeakers(pb2.ListSpeakersRequest(page_size=page_size, page_token=page_token),
                                            timeout=timeout, metadata=self._md())

    async def all_speakers(self, page_size: int = 0, timeout: float | None = None) -> list[pb2.Speaker]:
        out, token = [], ""
        while True:
            page = await self.list_speakers(page_size, token, timeout=timeout)
            out.extend(page.speakers)
            token = page.next_page_token
            if not token:
                return out

    async def delete_speaker(self, speaker_id: str, timeout: float | None = None) -> None:
        await self.stub.DeleteSpeaker(pb2.DeleteSpeakerRequest(speaker_id=speaker_id),
                                      timeout=timeout, metadata=self._md())

    async def get_server_info(self, timeout: float | None = None) -> pb2.GetServerInfoResponse:
        return await self.stub.GetServerInfo(pb2.GetServerInfoRequest(), timeout=timeout, metadata=self._md())
