"""Time to first audio through each front door: gRPC Synthesize, HTTP /v1/audio/speech per
response_format (chunked `audio` and `sse`), and the WebSocket, against one real server.

Each request stops after its first audio bytes (closing the stream aborts the synthesis), so a run
measures what a listener waits for before playback can start. Prints median and p90 over
--runs requests per path, and the HTTP/WebSocket overhead against gRPC (ratio of medians).

    python benchmarks/http_first_byte.py [--model-dir DIR] [--speaker-file spk2info.pt] [--runs 7]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

import httpx
from websockets.asyncio.client import connect as ws_connect

from async_cosyvoice.config import Config
from async_cosyvoice.speakers import SpeakerStore
from grpc_async.client import CosyVoiceClient
from grpc_async.server import ServerThread

TEXT = "Hello there, this is a short benchmark sentence."


async def grpc_first(target: str, voice: str) -> float:
    async with CosyVoiceClient(target) as c:
        t0 = time.perf_counter()
        async for chunk in c.synthesize(TEXT, speaker_id=voice, stream=True):
            if chunk.audio:
                return time.perf_counter() - t0
    raise RuntimeError("no audio")


async def http_first(http: httpx.AsyncClient, voice: str, fmt: str, stream_format: str) -> float:
    body = {"model": "tts-1", "voice": voice, "input": TEXT, "response_format": fmt, "stream_format": stream_format}
    t0 = time.perf_counter()
    async with http.stream("POST", "/v1/audio/speech", json=body) as r:
        r.raise_for_status()
        async for piece in r.aiter_raw():
            if piece and (stream_format == "audio" or b"speech.audio.delta" in piece):
                return time.perf_counter() - t0
    raise RuntimeError("no audio")


async def ws_first(url: str, voice: str) -> float:
    async with ws_connect(url) as ws:
        await ws.send(json.dumps({"type": "config", "voice": voice, "format": "pcm"}))
        await ws.recv()
        t0 = time.perf_counter()
        await ws.send(json.dumps({"type": "text", "text": TEXT}))
        await ws.send(json.dumps({"type": "end"}))
        while True:
            m = json.loads(await ws.recv())
            if m["type"] == "audio" and m["num_samples"]:
                return time.perf_counter() - t0


def summary(times: list[float]) -> str:
    s = sorted(times)
    p90 = s[min(len(s) - 1, round(0.9 * (len(s) - 1)))]
    return f"median {statistics.median(s) * 1e3:7.1f} ms   p90 {p90 * 1e3:7.1f} ms"


async def bench(st: ServerThread, voice: str, runs: int) -> dict[str, list[float]]:
    ws_url = f"ws://127.0.0.1:{st.server.http_port}/v1/audio/speech/stream"
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{st.server.http_port}", timeout=120) as http:
        paths = {"gRPC Synthesize (pcm16)": lambda: grpc_first(st.target, voice)}
        for fmt in ("pcm", "wav", "mp3", "opus", "aac", "flac"):
            paths[f"HTTP audio {fmt}"] = lambda fmt=fmt: http_first(http, voice, fmt, "audio")
        paths["HTTP sse pcm"] = lambda: http_first(http, voice, "pcm", "sse")
        paths["WebSocket pcm (from text)"] = lambda: ws_first(ws_url, voice)
        for fn in paths.values():  # warm every path once
            await fn()
        results: dict[str, list[float]] = {name: [] for name in paths}
        for _ in range(runs):  # interleaved, so load drift hits every path alike
            for name, fn in paths.items():
                results[name].append(await fn())
        return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", help="CosyVoice2 model directory (default: the demo tiny model)")
    ap.add_argument("--speaker-file", help="spk2info.pt to import (default: the model dir's)")
    ap.add_argument("--voice", default="tiny_zs_spk")
    ap.add_argument("--runs", type=int, default=7)
    args = ap.parse_args()

    spk_dir = tempfile.mkdtemp()
    speaker_file = args.speaker_file or (Path(args.model_dir) / "spk2info.pt" if args.model_dir else None)
    if speaker_file:
        SpeakerStore(spk_dir).import_spk2info(speaker_file)
    cfg = Config.model_validate({"model": {"dir": args.model_dir}, "speakers": {"dir": spk_dir},
                                 "server": {"port": 0, "http_port": 0}})
    with ServerThread(cfg) as st:
        results = asyncio.run(bench(st, args.voice, args.runs))
    grpc_median = statistics.median(results["gRPC Synthesize (pcm16)"])
    print(f"time to first audio, {args.runs} runs each, text {len(TEXT)} chars")
    for name, times in results.items():
        print(f"  {name:28s} {summary(times)}   x{statistics.median(times) / grpc_median:.2f} of gRPC")


if __name__ == "__main__":
    main()
