"""`async-cosyvoice synthesize`: text to an audio file, in-process or by a server (`--target`).

Both ways go through the same steps: a voice and options from the arguments, chunks as they come
(one progress line on stderr), a file in `--encoding` (the raw encodings as a 16-bit .wav, the
compressed ones as the stream's bytes), and one summary line on stdout.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import AsyncIterator

import numpy as np
import soundfile as sf

from async_cosyvoice.audio_encoding import AudioStreamEncoder
from async_cosyvoice.frontend.audio import load_audio, resample
from async_cosyvoice.progress import ProgressLine
from async_cosyvoice.request import Mode, SynthesisOptions, SynthesisRequest
from async_cosyvoice.tts import Synthesizer
from grpc_async.client import ENCODINGS, MODES, RAW_ENCODINGS, chunk_samples, infer_mode

from .options import add_local, add_remote, check_where, client_from_args, config_from_args

LOCAL_ONLY = ("first_hop", "top_k", "save_tokens")
RAW = ("pcm16", "float32", "wav")
LIBRARY_FORMAT = {"pcm16": "pcm", "float32": "f32"}  # the library's names where they differ


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_local(p)
    add_remote(p)
    p.add_argument("--text", help="text to speak ('-' reads stdin)")
    p.add_argument("--text-file", type=Path, help="read the text from a file")
    p.add_argument("--speaker", help="registered speaker id")
    p.add_argument("--mode", choices=MODES, help="default: inferred from the voice arguments")
    p.add_argument("--prompt-wav", type=Path, help="prompt audio file (wav/flac/ogg)")
    p.add_argument("--prompt-text", help="transcript of the prompt audio (zero-shot)")
    p.add_argument("--instruct", help="instruction (instruct2 modes)")
    p.add_argument("--source-wav", type=Path, help="source audio for voice conversion")
    p.add_argument("--stream", action="store_true", help="stream chunks (first audio sooner)")
    p.add_argument("--speed", type=float)
    p.add_argument("--no-text-frontend", action="store_true", help="skip text normalization")
    p.add_argument("--seed", type=int)
    p.add_argument("--max-tokens", type=int, help="generate exactly this many speech tokens per segment, "
                   "ignoring EOS (benchmarks; a server caps it with limits.max_forced_tokens)")
    p.add_argument("--sample-rate", type=int, help="output rate (default: native 24000)")
    p.add_argument("--encoding", choices=ENCODINGS, default="pcm16",
                   help="pcm16/float32/wav are written as a 16-bit .wav; opus/webm/mp3/aac/flac as the "
                        "stream's bytes, e.g. out.opus (default pcm16)")
    p.add_argument("--first-hop", type=int, help="in-process: tokens in the first streamed chunk")
    p.add_argument("--top-k", type=int, help="in-process: RAS top-k (1 = greedy)")
    p.add_argument("--save-tokens", type=Path, help="in-process: write the speech tokens as a JSON list")
    p.add_argument("--out", type=Path, required=True, help="output file")
    p.set_defaults(func=run)


@dataclass
class Piece:
    """One chunk as the command keeps it, from either source."""
    index: int
    audio_end_s: float          # audio seconds from the start through this chunk
    samples: np.ndarray | None  # raw encodings: float32 mono at Result.samples_rate
    data: bytes = b""           # compressed encodings: the stream's next bytes


@dataclass
class Result:
    sample_rate: int = 0        # of the file
    samples_rate: int = 0       # of Piece.samples (the file's is resampled from the whole at the end)
    speech_tokens: list[int] = field(default_factory=list)
    n_speech_tokens: int = 0
    server_first_chunk_s: float | None = None
    chunks_seen: int = 0
    started: float = 0.0        # time.monotonic() when the request went out (after a model load)


def run(args) -> int:
    check_where(args, local_only=LOCAL_ONLY)
    if args.text_file:
        args.text = args.text_file.read_text(encoding="utf-8")
    elif args.text == "-":
        args.text = sys.stdin.read()
    mode = args.mode or _infer_mode(args)
    result = Result()
    source = _remote(args, mode, result) if args.target else _local(args, mode, result)
    return asyncio.run(_write(args, source, result))


def _infer_mode(args) -> str:
    try:
        return infer_mode(speaker_id=args.speaker, prompt_audio=args.prompt_wav, prompt_text=args.prompt_text,
                          instruct_text=args.instruct, source_audio=args.source_wav)
    except ValueError:
        raise ValueError("give a voice: --prompt-wav [--prompt-text], --speaker ID, or --source-wav with "
                         "--prompt-wav") from None


async def _write(args, source: AsyncIterator[Piece], result: Result) -> int:
    progress = ProgressLine()
    samples, data, chunks, seconds, first, text = [], [], 0, 0.0, None, "no audio"
    async for piece in source:
        elapsed = time.monotonic() - result.started
        if first is None and piece.audio_end_s > 0:
            first = (elapsed, piece.audio_end_s)
        if piece.samples is not None:
            samples.append(piece.samples)
        data.append(piece.data)
        chunks, seconds = piece.index + 1, piece.audio_end_s
        text = f"chunk {piece.index:3d}  audio {piece.audio_end_s:6.2f} s  elapsed {elapsed:6.2f} s"
        progress.show(text)
    wall = time.monotonic() - result.started
    progress.end(text)
    if args.encoding in RAW:
        audio = np.concatenate(samples) if samples else np.zeros(0, np.float32)
        if result.samples_rate != result.sample_rate:
            audio = resample(audio, result.samples_rate, result.sample_rate)
        sf.write(args.out, np.clip(audio, -1.0, 1.0), result.sample_rate, subtype="PCM_16")
    else:
        args.out.write_bytes(b"".join(data))
    first_ms, first_audio = (1e3 * first[0], first[1]) if first else (0.0, 0.0)
    server = (f" (server {1e3 * result.server_first_chunk_s:.0f} ms)"
              if result.server_first_chunk_s is not None else "")
    print(f"wrote {args.out}: {seconds:.2f} s at {result.sample_rate} Hz, {chunks} chunk(s), "
          f"{result.n_speech_tokens} speech tokens, first chunk {first_ms:.0f} ms{server} "
          f"({first_audio:.2f} s of audio), RTF {wall / max(seconds, 1e-9):.3f}")
    if args.save_tokens:
        args.save_tokens.write_text(json.dumps(result.speech_tokens) + "\n", encoding="utf-8")
    return 0


# -- in-process --------------------------------------------------------------------------------

def _request(args, mode: str) -> SynthesisRequest:
    options = SynthesisOptions(stream=args.stream, speed=1.0 if args.speed is None else args.speed,
                               text_frontend=not args.no_text_frontend, seed=args.seed, top_k=args.top_k,
                               max_tokens=args.max_tokens,
                               **({"first_hop": args.first_hop} if args.first_hop else {}))
    return SynthesisRequest(Mode(mode), text=args.text or "", prompt_text=args.prompt_text or "",
                            prompt_audio=load_audio(args.prompt_wav) if args.prompt_wav else None,
                            instruct_text=args.instruct or "", speaker_id=args.speaker or "",
                            source_audio=load_audio(args.source_wav) if args.source_wav else None,
                            options=options)


async def _local(args, mode: str, result: Result) -> AsyncIterator[Piece]:
    request = _request(args, mode)
    synth = await Synthesizer.create(config_from_args(args), warmup=False)
    try:
        native = result.samples_rate = synth.sample_rate
        result.sample_rate = args.sample_rate or native
        encoder = None
        if args.encoding not in RAW:
            encoder = AudioStreamEncoder(LIBRARY_FORMAT.get(args.encoding, args.encoding), result.sample_rate,
                                         native)
        loop = asyncio.get_running_loop()
        last = (0, 0.0)
        result.started = time.monotonic()
        async for chunk in synth.synthesize(request):
            result.speech_tokens.extend(chunk.segment_tokens)
            end_s = (chunk.sample_offset + len(chunk.samples)) / chunk.sample_rate
            if encoder is not None:  # codecs are CPU work: off the loop the synthesizer runs on
                data = await loop.run_in_executor(None, encoder.encode, chunk.samples)
                yield Piece(chunk.index, end_s, None, data)
            else:
                yield Piece(chunk.index, end_s, chunk.samples)
            last = chunk.index, end_s
        if encoder is not None:
            yield Piece(*last, None, await loop.run_in_executor(None, encoder.finish))
        result.n_speech_tokens = len(result.speech_tokens)
    finally:
        await synth.close()


# -- by a server -------------------------------------------------------------------------------

async def _remote(args, mode: str, result: Result) -> AsyncIterator[Piece]:
    async with client_from_args(args) as client:
        samples_so_far = 0
        result.started = time.monotonic()
        async for chunk in client.synthesize(
                args.text or "", mode=mode, speaker_id=args.speaker, prompt_audio=args.prompt_wav,
                prompt_text=args.prompt_text, instruct_text=args.instruct, source_audio=args.source_wav,
                stream=args.stream, speed=args.speed, text_frontend=False if args.no_text_frontend else None,
                encoding=args.encoding, sample_rate=args.sample_rate or 0, seed=args.seed,
                max_tokens=args.max_tokens, timeout=args.timeout):
            if chunk.index != result.chunks_seen:
                raise ConnectionError(f"chunk {chunk.index} arrived, expected {result.chunks_seen}")
            result.chunks_seen += 1
            result.sample_rate = result.samples_rate = chunk.sample_rate
            samples_so_far += chunk.num_samples
            end_s = samples_so_far / chunk.sample_rate if chunk.sample_rate else 0.0
            if chunk.is_final:
                result.n_speech_tokens = chunk.summary.speech_tokens
                result.server_first_chunk_s = chunk.summary.first_chunk_latency_seconds
            if chunk.encoding in RAW_ENCODINGS:
                yield Piece(chunk.index, end_s, chunk_samples(chunk))
            else:
                yield Piece(chunk.index, end_s, None, chunk.audio)
        if not result.chunks_seen:
            raise ConnectionError("the server sent no audio")
