"""`async-cosyvoice synthesize`: text to an audio file, in-process (cosyvoice_cli.local) or by a
server (`--target`, cosyvoice_cli.remote).

Both ways go through the same steps: a voice and options from the arguments, chunks as they come
(one progress line on stderr), a file in `--encoding` (the raw encodings as a 16-bit .wav, the
compressed ones as the stream's bytes), and one summary line on stdout. This module imports no
torch: it is half of the client path (see cli.py).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import AsyncIterator, Callable

import numpy as np
import soundfile as sf

from async_cosyvoice.progress import ProgressLine
from grpc_async.client import ENCODINGS, MODES, infer_mode

from .options import add_local, add_remote, check_where

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
    # (samples, rate in, rate out) -> samples: how the whole raw audio reaches the file's rate where
    # samples_rate differs (in-process: the library's resampler; a server sends the asked rate)
    resample: Callable[[np.ndarray, int, int], np.ndarray] | None = None


def run(args, pieces: Callable[[argparse.Namespace, "Result"], AsyncIterator[Piece]]) -> int:
    """The command, with `pieces(args, result)` the chunks from where it runs (local or remote)."""
    check_where(args, local_only=LOCAL_ONLY)
    if args.text_file:
        args.text = args.text_file.read_text(encoding="utf-8")
    elif args.text == "-":
        args.text = sys.stdin.read()
    result = Result()
    return asyncio.run(write(args, pieces(args, result), result))


def choose_mode(args, speaker_kind: str | None = None) -> str:
    """--mode, else what the voice arguments say. A speaker stored as an embedding only
    (`speaker_kind` "sft") speaks in sft mode; a prompt without its transcript is refused rather
    than silently spoken cross-lingual."""
    if args.mode:
        return args.mode
    if args.speaker and speaker_kind == "sft" and not args.instruct:
        return "sft"
    if args.prompt_wav is not None and not (args.speaker or args.prompt_text or args.instruct or args.source_wav):
        raise ValueError("--prompt-wav needs its transcript: pass --prompt-text \"what the prompt says\" "
                         "(zero-shot), or --mode cross_lingual to use the voice without a transcript")
    try:
        return infer_mode(speaker_id=args.speaker, prompt_audio=args.prompt_wav, prompt_text=args.prompt_text,
                          instruct_text=args.instruct, source_audio=args.source_wav)
    except ValueError:
        raise ValueError("give a voice: --prompt-wav with --prompt-text, --speaker ID, or --source-wav with "
                         "--prompt-wav") from None


async def write(args, source: AsyncIterator[Piece], result: Result) -> int:
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
            audio = result.resample(audio, result.samples_rate, result.sample_rate)
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


