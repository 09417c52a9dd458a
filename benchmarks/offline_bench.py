"""Offline throughput: N forced-length utterances through the offline path (non-streaming requests:
LM in large continuous batches, then whole utterances in length-sorted, padded flow and HiFT
batches) and through the streaming path (the same requests streamed: chunk schedule, flow cache,
the token2wav batcher), in-process on one device.

    # the H200 run (a full-size random model is written once into --random-dir)
    python benchmarks/offline_bench.py --random-preset cosyvoice2-0.5b --random-dir /tmp/cv2-full \\
        --device cuda --dtype float16 --requests 256 --concurrency 128 --tokens 250
    # CPU smoke test on the tiny fixture
    python benchmarks/offline_bench.py --model-dir ../shared/fixtures/cosyvoice2-tiny \\
        --requests 4 --concurrency 4 --tokens 20 --stream-requests 2

Per path it reports the aggregate audio seconds per wall second (x real time) and RTF, where the
device time went (LLM engine steps; offline: flow and HiFT seconds of the offline renderer;
streaming: token2wav batches), the batch sizes used, and the peak GPU memory. Every request
speaks a registered speaker's prompt (--prompt-seconds, 6 s = 150 tokens) with --tokens forced
speech tokens (250 = 10 s; `--spread 0.5`: 125-375 tokens, varying per request, as real texts do). JSON goes to --out (default runs/offline/offline_results.json) and a
table to stdout. A phase stops sending new requests after --max-phase-seconds. `--no-offline` is the baseline:
the non-streaming requests then run through the streaming token2wav batcher (one job each).
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from async_cosyvoice.config import Config
from async_cosyvoice.random_model import ensure_random_model
from cosyvoice_cli import bench


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--model-dir", type=Path)
    src.add_argument("--random-preset", help="write (once) and use a random model of this preset")
    ap.add_argument("--random-dir", type=Path, default=Path("/tmp/cosyvoice2-random"))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", help="flow dtype (HiFT stays float32)")
    ap.add_argument("--llm-dtype", help="default: bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--estimator", choices=["torch", "compiled", "onnxruntime", "tensorrt"], default="torch",
                    help="flow estimator (compiled: CUDA graphs, captured on first use of each shape: slower start)")
    ap.add_argument("--flow-cache", choices=["on", "off"],
                    help="the streaming path's flow state cache (default: off on cuda, as configs/gpu.yaml; on on cpu)")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--concurrency", type=int, default=128, help="offline requests in flight (the LM batch)")
    ap.add_argument("--stream-requests", type=int, default=128, help="streaming path requests")
    ap.add_argument("--stream-concurrency", type=int, default=32,
                    help="streams in flight (the flow cache holds ~1.1 GB per 10 s fp16 stream)")
    ap.add_argument("--tokens", type=int, default=250)
    ap.add_argument("--spread", type=float, default=0.0,
                    help="forced lengths vary per request within tokens x [1 - spread, 1 + spread] (0: all equal)")
    ap.add_argument("--prompt-seconds", type=float, default=6.0)
    ap.add_argument("--offline-max-batch", type=int, default=64)
    ap.add_argument("--offline-max-frames", type=int, default=65536)
    ap.add_argument("--offline-wait-ms", type=float, default=10.0)
    ap.add_argument("--no-offline", action="store_true",
                    help="baseline: non-streaming requests through the streaming token2wav batcher (token2wav.offline off)")
    ap.add_argument("--max-phase-seconds", type=float, default=60.0)
    ap.add_argument("--skip", default="", help="comma list: offline,stream")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("runs/offline"))
    return ap.parse_args(argv)


def log(msg: str) -> None:
    print(f"[offline-bench] {msg}", file=sys.stderr, flush=True)


class SpreadTarget:
    """In-process requests whose forced token count varies with the request's seed (deterministic):
    tokens x (1 - spread + 2 spread u), u spread evenly over [0, 1)."""
    name = "in-process"

    def __init__(self, synth, spread: float):
        if not 0 <= spread < 1:
            raise ValueError(f"--spread must be in [0, 1), got {spread}")
        self.inner = bench.InProcessTarget(synth)
        self.spread = spread

    async def stream(self, workload, seed: int):
        tokens = spread_tokens(workload.tokens, self.spread, seed)
        async for seconds in self.inner.stream(dataclasses.replace(workload, tokens=tokens), seed):
            yield seconds


def spread_tokens(base: int, spread: float, seed: int) -> int:
    """The forced token count of the request with this seed."""
    u = (seed * 0.6180339887) % 1.0
    return max(1, round(base * (1 - spread + 2 * spread * u)))


def make_config(args, model_dir: Path, speakers_dir: Path) -> Config:
    cuda = args.device.startswith("cuda")
    return Config.model_validate({
        "model": {"dir": str(model_dir), "device": args.device, "flow_dtype": args.dtype,
                  "llm_dtype": args.llm_dtype or ("bfloat16" if cuda else "float32")},
        "engine": {"kind": "native", "max_num_seqs": max(args.concurrency, args.stream_concurrency),
                   "max_model_len": 1024 if args.tokens <= 600 else 4096, "cuda_graphs": cuda},
        "token2wav": {"estimator": args.estimator, "max_batch": 64, "offline": not args.no_offline,
                      "flow_cache": args.flow_cache == "on" if args.flow_cache else not cuda,
                      "offline_max_batch": args.offline_max_batch, "offline_max_frames": args.offline_max_frames,
                      "offline_wait_ms": args.offline_wait_ms},
        "speakers": {"dir": str(speakers_dir)},
    })


def _peak_reset(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def _peak_gib(device: str) -> float | None:
    return torch.cuda.max_memory_allocated() / 2 ** 30 if device.startswith("cuda") else None


def _offline_delta(before: dict, after: dict) -> dict:
    out = {k: after[k] - before[k] for k in ("jobs", "flow_calls", "hift_calls", "flow_s", "hift_s", "flow_frames",
                                             "flow_padded_frames")}
    for key in ("flow_batch_sizes", "hift_batch_sizes"):
        out[key] = {k: v - before[key].get(k, 0) for k, v in after[key].items() if v - before[key].get(k, 0)}
    return out


async def run_phase(name: str, synth, target, workload, concurrency: int, requests: int, args) -> dict:
    stages = bench.SynthesizerStages(synth)
    offline = synth.batcher.offline
    off_before = offline.stats.to_json() if offline is not None else None
    _peak_reset(args.device)
    log(f"{name}: {requests} requests x {workload.tokens} tokens, {concurrency} in flight")
    level = await bench.run_level(target, workload, concurrency, requests, stages=stages, detail=False,
                                  max_seconds=args.max_phase_seconds, label=name, progress=bench.Progress())
    out = {"path": name, "requests": level["requests"], "concurrency": concurrency, "errors": level["errors"],
           "audio_s": level["audio_s"], "wall_s": level["wall_s"], "x_real_time": level["audio_s_per_s"],
           "rtf": level["rtf"], "stages": level.get("stages"), "peak_gpu_gib": _peak_gib(args.device)}
    if offline is not None and name == "offline":
        out["offline"] = _offline_delta(off_before, offline.stats.to_json())
    return out


async def measure(args, config: Config, results: dict) -> None:
    from async_cosyvoice.tts import Synthesizer

    t = time.monotonic()
    synth = await Synthesizer.create(config, warmup=True)
    results["load_s"] = time.monotonic() - t
    log(f"synthesizer ready in {results['load_s']:.1f} s")
    try:
        speaker = bench.SpeakerSpec(prompt_seconds=args.prompt_seconds, seed=args.seed)
        results["prompt_tokens"] = await bench.register_in_process(synth, speaker)
        target = SpreadTarget(synth, args.spread)
        workload = bench.Workload(tokens=args.tokens, seed=args.seed, speaker_id=speaker.speaker_id, stream=False)
        skip = {s for s in args.skip.split(",") if s}
        warm = dataclasses.replace(workload, tokens=min(args.tokens, 60))
        t = time.monotonic()
        await bench.run_level(target, warm, min(args.concurrency, args.requests), min(args.concurrency, args.requests),
                              detail=False, label="warm-up (offline)")
        if "stream" not in skip:
            n = min(args.stream_concurrency, args.stream_requests)
            await bench.run_level(target, dataclasses.replace(warm, stream=True), n, n, detail=False,
                                  label="warm-up (streaming)")
        results["warmup_s"] = time.monotonic() - t
        results["phases"] = []
        if "offline" not in skip:
            name = "nonstream-batcher" if args.no_offline else "offline"
            results["phases"].append(await run_phase(name, synth, target, workload, args.concurrency,
                                                     args.requests, args))
        if "stream" not in skip:
            results["phases"].append(await run_phase(
                "streaming", synth, target, dataclasses.replace(workload, stream=True), args.stream_concurrency,
                args.stream_requests, args))
    finally:
        await synth.close()


def format_table(results: dict) -> str:
    spread = f" x [{1 - results['spread']:g}, {1 + results['spread']:g}]" if results.get("spread") else ""
    lines = [f"{results['device']}, flow {results['dtype']}, prompt {results.get('prompt_tokens')} tokens, "
             f"{results['tokens']}{spread} tokens ({results['tokens'] * 0.04:g} s) per request",
             "| path | requests | in flight | audio s | wall s | x real time | RTF | LLM busy s | flow s | HiFT s | "
             "t2w busy s | batch sizes (flow; HiFT) | peak GPU GiB | errors |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for p in results.get("phases", []):
        st = p.get("stages") or {}
        llm = (st.get("llm_step") or {}).get("busy_s")
        t2w = (st.get("token2wav_batch") or {}).get("busy_s")
        off = p.get("offline")
        if off:
            flow_s, hift_s = f"{off['flow_s']:.2f}", f"{off['hift_s']:.2f}"
            sizes = (", ".join(f"{k}x{v}" for k, v in off["flow_batch_sizes"].items()) + "; "
                     + ", ".join(f"{k}x{v}" for k, v in off["hift_batch_sizes"].items()))
        else:
            flow_s = hift_s = "-"
            items = (st.get("token2wav_batch") or {}).get("items_per_call")
            sizes = f"mean {items:.1f} jobs/batch" if items else "-"
        peak = p.get("peak_gpu_gib")
        lines.append(f"| {p['path']} | {p['requests']} | {p['concurrency']} | {p['audio_s']:.1f} | {p['wall_s']:.2f} | "
                     f"{p['x_real_time'] or 0:.1f} | {p['rtf'] or float('nan'):.5f} | "
                     f"{'-' if llm is None else f'{llm:.2f}'} | {flow_s} | {hift_s} | "
                     f"{'-' if t2w is None else f'{t2w:.2f}'} | {sizes} | {'-' if peak is None else f'{peak:.1f}'} | "
                     f"{p['errors']} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    t_all = time.monotonic()
    model_dir = args.model_dir
    if args.random_preset:
        model_dir = ensure_random_model(args.random_preset, args.random_dir)
    with tempfile.TemporaryDirectory(prefix="offline-bench-spk-") as spk:
        config = make_config(args, model_dir, Path(spk))
        results = {"script": "benchmarks/offline_bench.py", "argv": sys.argv[1:] if argv is None else list(argv),
                   "device": bench.environment(args.device).get("gpu", args.device), "dtype": args.dtype,
                   "tokens": args.tokens, "spread": args.spread, "config": config.model_dump(mode="json")}
        try:
            asyncio.run(measure(args, config, results))
        except Exception as e:  # still write (and print) what was measured
            results["error"] = "".join(traceback.format_exception(type(e), e, e.__traceback__))
            log(f"failed: {type(e).__name__}: {e}")
    results["total_s"] = time.monotonic() - t_all
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "offline_results.json"
    path.write_text(json.dumps(results, indent=2, default=str), encoding="utf-8")
    table = format_table(results)
    print(table)
    print(f"\ntotal {results['total_s']:.1f} s (model load {results.get('load_s', 0):.1f} s, warm-up "
          f"{results.get('warmup_s', 0):.1f} s); JSON: {path}")
    if results.get("error"):
        print("FAILED:\n" + results["error"])
    (args.out / "offline_table.txt").write_text(table + "\n", encoding="utf-8")
    return 1 if results.get("error") or any(p["errors"] for p in results.get("phases", [])) else 0


if __name__ == "__main__":
    sys.exit(main())
