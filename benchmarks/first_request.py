"""A newly registered speaker's first request against its warm ones, through the gRPC server.

Per trial a fresh speaker is registered while the server is serving, then one streamed request
by it (the cold one) and --warm more (the same text); then the server restarts on the same
speaker store and each speaker again makes one cold request and --warm more. With the exact flow
cache on (token2wav.flow_cache, the CPU default) a registration, and the warm-up of a start,
compute the speakers' flow prompt prefixes, so their first requests do not; --flow-cache off
compares against recomputing flows. Prints per setting and phase: registration time, the cold
request's first chunk, the warm median and their ratio (medians over --trials speakers).

    python benchmarks/first_request.py [--model-dir DIR] [--trials 3] [--warm 5] [--flow-cache on off]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

from async_cosyvoice.config import Config
from grpc_async.client import CosyVoiceClient
from grpc_async.server import ServerThread

REPO = Path(__file__).resolve().parents[1]
PROMPT_WAV = REPO / "tests" / "data" / "prompt.wav"
PROMPT_TEXT = "Hello there, this is a prompt."
TEXT = "The quick brown fox jumps over the lazy dog near the river bank today."


async def first_chunk(client: CosyVoiceClient, speaker_id: str, seed: int) -> float:
    """The request's first-chunk latency; it runs to its end, so the next request has the server alone."""
    t0 = time.perf_counter()
    first = None
    async for chunk in client.synthesize(TEXT, speaker_id=speaker_id, stream=True, seed=seed):
        if first is None and chunk.num_samples:
            first = time.perf_counter() - t0
    if first is None:
        raise RuntimeError("no audio")
    return first


async def trials(target: str, n_trials: int, n_warm: int) -> list[dict]:
    out = []
    async with CosyVoiceClient(target) as client:
        await first_chunk(client, await _warmup_speaker(client), 0)  # the server's own first request: untimed
        for i in range(n_trials):
            speaker = f"first_request_{i}"
            t0 = time.perf_counter()
            await client.register_speaker(speaker, PROMPT_TEXT, PROMPT_WAV, overwrite=True)
            registration = time.perf_counter() - t0
            cold = await first_chunk(client, speaker, seed=0)
            warm = [await first_chunk(client, speaker, seed=k + 1) for k in range(n_warm)]
            out.append({"speaker": speaker, "registration_s": registration, "cold_s": cold, "warm_s": warm})
    return out


async def _warmup_speaker(client: CosyVoiceClient) -> str:
    await client.register_speaker("first_request_warmup", PROMPT_TEXT, PROMPT_WAV, overwrite=True)
    return "first_request_warmup"


async def after_restart(target: str, speakers: list[str], n_warm: int) -> list[dict]:
    """Each speaker's first request on a restarted server (same store), then its warm ones."""
    out = []
    async with CosyVoiceClient(target) as client:
        for speaker in speakers:
            cold = await first_chunk(client, speaker, seed=0)
            warm = [await first_chunk(client, speaker, seed=k + 1) for k in range(n_warm)]
            out.append({"speaker": speaker, "cold_s": cold, "warm_s": warm})
    return out


def run_setting(model_dir: str | None, flow_cache: bool, n_trials: int, n_warm: int) -> dict[str, list[dict]]:
    cfg = Config.model_validate({"model": {"dir": model_dir}, "speakers": {"dir": tempfile.mkdtemp()},
                                 "token2wav": {"flow_cache": flow_cache}, "server": {"port": 0}})
    with ServerThread(cfg) as st:
        registered = asyncio.run(trials(st.target, n_trials, n_warm))
    with ServerThread(cfg) as st:  # a restart on the same speaker store
        restarted = asyncio.run(after_restart(st.target, [r["speaker"] for r in registered], n_warm))
    return {"registered_while_serving": registered, "after_restart": restarted}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", help="CosyVoice2 model directory (default: the demo tiny model)")
    ap.add_argument("--trials", type=int, default=3, help="fresh speakers per setting")
    ap.add_argument("--warm", type=int, default=5, help="warm requests per speaker")
    ap.add_argument("--flow-cache", nargs="+", choices=("on", "off"), default=["on", "off"])
    ap.add_argument("--out", help="write the raw timings as JSON here")
    args = ap.parse_args()

    results = {}
    for setting in args.flow_cache:
        phases = results[f"flow_cache_{setting}"] = run_setting(args.model_dir, setting == "on", args.trials, args.warm)
        for phase, rows in phases.items():
            cold = statistics.median(r["cold_s"] for r in rows)
            warm = statistics.median(statistics.median(r["warm_s"]) for r in rows)
            reg = (f"registration {statistics.median(r['registration_s'] for r in rows) * 1e3:6.1f} ms   "
                   if "registration_s" in rows[0] else "")
            print(f"flow cache {setting:3s}, {phase.replace('_', ' '):25s} {reg}first request {cold * 1e3:6.1f} ms   "
                  f"warm median {warm * 1e3:6.1f} ms   first / warm x{cold / warm:.2f}   ({len(rows)} speakers)")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
