"""`synthesize` and `speakers` against a server (`--target HOST:PORT`): gRPC, numpy and soundfile,
no torch (no seconds of torch import per call; the client-only install, clients/python, has no
torch at all)."""
from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import os
import sys
import time
from typing import AsyncIterator

import grpc

from grpc_async import pb2
from grpc_async.client import RAW_ENCODINGS, TOKEN_ENV, CosyVoiceClient, chunk_samples

from . import speakers as speakers_cli
from . import synthesize as synthesize_cli
from .options import DEFAULT_WAIT_SECONDS, check_where
from .synthesize import Piece, Result

NOTICE_AFTER_SECONDS = 1.0  # say that we are waiting when the server is not SERVING by then


def client_from_args(args) -> CosyVoiceClient:
    tls = (args.ca_cert or True) if (args.tls or args.ca_cert) else False
    return CosyVoiceClient(args.target, token=args.token or os.environ.get(TOKEN_ENV), tls=tls)


@contextlib.asynccontextmanager
async def connected(args) -> AsyncIterator[CosyVoiceClient]:
    """A client for --target, once the server reports SERVING (at most --wait seconds)."""
    async with client_from_args(args) as client:
        await wait_serving(client, DEFAULT_WAIT_SECONDS if args.wait is None else args.wait)
        yield client


async def wait_serving(client: CosyVoiceClient, seconds: float) -> None:
    """Follow the server's health until SERVING: a server opens its port before its model is
    loaded, and a command run right after `serve` would otherwise get UNAVAILABLE. A server without
    the health service (UNIMPLEMENTED) is taken as ready."""
    if seconds <= 0:
        return
    ready = asyncio.ensure_future(client.wait_ready(timeout=seconds))
    try:
        done, _ = await asyncio.wait({ready}, timeout=NOTICE_AFTER_SECONDS)
        if not done:
            print(f"waiting up to {seconds:g} s for {client.target} to report SERVING (--wait SECONDS)",
                  file=sys.stderr)
        await ready
    except TimeoutError:
        raise ConnectionError(f"{client.target} did not report SERVING within {seconds:g} s (no server "
                              "listening there, or its model is still loading: wait longer with --wait "
                              "SECONDS)") from None
    except grpc.aio.AioRpcError as e:
        if e.code() != grpc.StatusCode.UNIMPLEMENTED:
            raise
    finally:
        ready.cancel()


# -- synthesize ----------------------------------------------------------------------------------

def synthesize(args) -> int:
    return synthesize_cli.run(args, _pieces)


async def _pieces(args, result: Result) -> AsyncIterator[Piece]:
    async with connected(args) as client:
        kind = None
        if args.speaker and not args.mode:
            kind = _fields(await client.get_speaker(args.speaker, timeout=args.timeout))[1]
        mode = synthesize_cli.choose_mode(args, kind)
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


# -- speakers ------------------------------------------------------------------------------------

def speakers(args) -> int:
    check_where(args)
    return asyncio.run(_speakers(args))


def _fields(s: pb2.Speaker) -> tuple:
    kind = pb2.SpeakerKind.Name(s.kind).removeprefix("SPEAKER_KIND_").lower()
    created = s.created_at.ToDatetime(datetime.timezone.utc).timestamp() if s.HasField("created_at") else None
    return s.speaker_id, kind, s.prompt_speech_tokens, created, s.prompt_text


async def _speakers(args) -> int:
    async with connected(args) as client:
        if args.action == "add":
            s = await client.register_speaker(args.id, args.prompt_text, args.prompt_wav, overwrite=args.overwrite,
                                              timeout=args.timeout)
            print(speakers_cli.line(*_fields(s)))
        elif args.action == "list":
            for s in await client.all_speakers(timeout=args.timeout):
                print(speakers_cli.line(*_fields(s)))
        elif args.action == "show":
            s = await client.get_speaker(args.id, timeout=args.timeout)
            print(json.dumps({**speakers_cli.shown(*_fields(s)), "model_kind": s.model_kind}, indent=2))
        elif args.action == "rm":
            await client.delete_speaker(args.id, timeout=args.timeout)
            print(f"deleted {args.id}")
    return 0
