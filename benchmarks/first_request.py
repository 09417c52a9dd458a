"""First requests against warm ones, through the gRPC server: the server's own first request after
SERVING, and a newly registered speaker's first request.

After SERVING (issue 23's measurement, the GPU server bench's step 4): a speaker registered from a
generated 6-s prompt, then the server's very first synthesis (--tokens forced speech tokens), then
--warm more; each with the server's own split of the first chunk (its Prometheus histogram): until
its speech tokens (LM prefill and steps) / waiting for a token2wav batch / the batch, and the LM's
ms per step over the request. After the restart below, the same for that speaker's first request.

Per trial a fresh speaker is registered while the server is serving, then one streamed request
by it (the cold one) and --warm more (the same text); then the server restarts on the same
speaker store and each speaker again makes one cold request and --warm more. With the exact flow
cache on (token2wav.flow_cache, the CPU default) a registration, and the warm-up of a start,
compute the speakers' flow prompt prefixes, so their first requests do not; --flow-cache off
compares against recomputing flows. Prints per setting and phase: registration time, the cold
request's first chunk, the warm median and their ratio (medians over --trials speakers).

    python benchmarks/first_request.py [--model-dir DIR] [--trials 3] [--warm 5] [--tokens 250] [--flow-cache on off]
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
from cosyvoice_cli.bench import (
    GrpcTarget,
    PrometheusStages,
    SpeakerSpec,
    Workload,
    register_grpc,
    run_level,
)
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


def split(level: dict) -> dict:
    """A level's mean first chunk and the server's split of it (ms), and the LM's ms per step."""
    st = level.get("stages") or {}

    def ms(name: str) -> float | None:
        return st.get(name, {}).get("ms_per_call")
    return {"first_chunk_ms": level["first_chunk_s"]["avg"] * 1e3, "tokens_ms": ms("first_chunk_tokens"),
            "wait_ms": ms("first_chunk_wait"), "t2w_ms": ms("first_chunk_t2w"), "llm_ms_per_step": ms("llm_step")}


async def first_and_warm(target: str, metrics: str, workload: Workload, n_warm: int,
                         speaker: SpeakerSpec | None) -> dict:
    """`speaker` registered (None: stored already), then one request timed alone, then n_warm more."""
    stages = PrometheusStages(metrics)
    async with CosyVoiceClient(target) as client:
        if speaker is not None:
            await register_grpc(client, speaker)
        grpc = GrpcTarget(client)
        first = await run_level(grpc, workload, 1, 1, stages=stages, detail=False)
        warm = await run_level(grpc, workload, 1, n_warm, stages=stages, detail=False)
    return {"first": split(first), "warm": split(warm)}


async def trials(target: str, n_trials: int, n_warm: int) -> list[dict]:
    out = []
    async with CosyVoiceClient(target) as client:
        for i in range(n_trials):
            speaker = f"first_request_{i}"
            t0 = time.perf_counter()
            await client.register_speaker(speaker, PROMPT_TEXT, PROMPT_WAV, overwrite=True)
            registration = time.perf_counter() - t0
            cold = await first_chunk(client, speaker, seed=0)
            warm = [await first_chunk(client, speaker, seed=k + 1) for k in range(n_warm)]
            out.append({"speaker": speaker, "registration_s": registration, "cold_s": cold, "warm_s": warm})
    return out


async def after_restart(target: str, speakers: list[str], n_warm: int) -> list[dict]:
    """Each speaker's first request on a restarted server (same store), then its warm ones."""
    out = []
    async with CosyVoiceClient(target) as client:
        for speaker in speakers:
            cold = await first_chunk(client, speaker, seed=0)
            warm = [await first_chunk(client, speaker, seed=k + 1) for k in range(n_warm)]
            out.append({"speaker": speaker, "cold_s": cold, "warm_s": warm})
    return out


def run_setting(model_dir: str | None, flow_cache: bool, n_trials: int, n_warm: int, tokens: int) -> dict:
    cfg = Config.model_validate({"model": {"dir": model_dir}, "speakers": {"dir": tempfile.mkdtemp()},
                                 "token2wav": {"flow_cache": flow_cache}, "server": {"port": 0, "metrics_port": 0}})
    speaker = SpeakerSpec(prompt_seconds=6.0)
    workload = Workload(tokens=tokens, speaker_id=speaker.speaker_id)

    def metrics(st: ServerThread) -> str:
        return f"{cfg.server.host}:{st.server.metrics_port}"
    with ServerThread(cfg) as st:
        serving = asyncio.run(first_and_warm(st.target, metrics(st), workload, n_warm, speaker))
        registered = asyncio.run(trials(st.target, n_trials, n_warm))
    with ServerThread(cfg) as st:  # a restart on the same speaker store
        restart = asyncio.run(first_and_warm(st.target, metrics(st), workload, n_warm, None))
        restarted = asyncio.run(after_restart(st.target, [r["speaker"] for r in registered], n_warm))
    return {"server_first_request": {"after_serving": serving, "after_restart": restart},
            "registered_while_serving": registered, "after_restart": restarted}


def format_split(name: str, d: dict) -> str:
    def f(v: float | None, width: int) -> str:
        return f"{v:{width}.1f}" if v is not None else f"{'-':>{width}}"
    return (f"  {name:26s} first chunk {f(d['first_chunk_ms'], 7)} ms = tokens {f(d['tokens_ms'], 6)} + wait "
            f"{f(d['wait_ms'], 4)} + t2w {f(d['t2w_ms'], 6)} (+ the rest)   LM {f(d['llm_ms_per_step'], 5)} ms/step")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", help="CosyVoice2 model directory (default: the demo tiny model)")
    ap.add_argument("--trials", type=int, default=3, help="fresh speakers per setting")
    ap.add_argument("--warm", type=int, default=5, help="warm requests per speaker")
    ap.add_argument("--tokens", type=int, default=250, help="forced speech tokens of the server's first requests")
    ap.add_argument("--flow-cache", nargs="+", choices=("on", "off"), default=["on", "off"])
    ap.add_argument("--out", help="write the raw timings as JSON here")
    args = ap.parse_args()

    results = {}
    for setting in args.flow_cache:
        phases = results[f"flow_cache_{setting}"] = run_setting(args.model_dir, setting == "on", args.trials,
                                                                args.warm, args.tokens)
        print(f"flow cache {setting}: the server's first request ({args.tokens} tokens, a 6-s prompt speaker) "
              f"and its {args.warm} warm ones (means):")
        for phase, levels in phases["server_first_request"].items():
            for which, d in levels.items():
                print(format_split(f"{phase.replace('_', ' ')}, {which}", d))
        for phase in ("registered_while_serving", "after_restart"):
            rows = phases[phase]
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
