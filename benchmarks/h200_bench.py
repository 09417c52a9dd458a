"""The whole GPU measurement of issue 6 in one run: streaming sweep, offline throughput and
token2wav batched vs one at a time, on a full-size random-weight CosyVoice2 model.

    python benchmarks/h200_bench.py                                    # the H200 run (cuda)
    python benchmarks/h200_bench.py --device cpu --preset tiny --quick # CPU smoke test, < ~60 s

Needs our package importable (`pip install --no-deps -e .`, or PYTHONPATH=. from the repo root)
and its runtime dependencies; matplotlib is optional (without it the plots are skipped).

Steps (each timed; the results say how long):
1. `make_random_model(preset)` into /tmp (reused when it is already there);
2. an in-process Synthesizer on the device: built-in engine (CUDA graphs), PyTorch token2wav,
   LLM in --llm-dtype (default bfloat16 on cuda), flow in --flow-dtype (default float32);
3. a speaker registered from a generated 6 s speech-like prompt wav (150 prompt tokens);
4. an untimed full-length warm-up round at every concurrency level (compiles / captures shapes);
5. the streaming sweep 1, 2, 4, 8, 16, 32, 64 with 250 forced tokens per request (10 s of
   audio), closed loop, requests per level 4, 4, 8, 16, 32, 64, 128 (each level stops sending
   new requests after --max-level-seconds, default 40 s);
6. offline: 256 non-streaming requests of 250 tokens, 128 in flight (the engine's batch);
7. token2wav alone at 32 streams x 250 tokens, streaming schedule, batched vs one at a time;
8. optionally (--torch-profile C, default 32 on cuda) a short level under torch.profiler: the
   top operators by device time go to profile_c<C>.txt.
A wall-clock budget (--budget-s, default 450 s from the start) keeps the run under ~8 minutes:
a sweep level or phase that would start too late to leave room for the later phases is
skipped and listed under "skipped".
Then it checks the issue's targets, prints a table and writes into $OUT (default ./runs/h200):
h200_results.json, h200-latency.png, h200-throughput.png, h200-t2w.png, h200_table.txt.
Per level the JSON also holds where the device time went (`stages`: busy seconds, calls and
ms per call of the LLM engine's steps and of the token2wav batches, and the mean batch).
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np
import torch

from cosyvoice_cli import bench
from async_cosyvoice.config import Config
from async_cosyvoice.random_model import make_random_model

FULL = dict(levels=[1, 2, 4, 8, 16, 32, 64], requests={1: 4, 2: 4, 4: 8, 8: 16, 16: 32, 32: 64, 64: 128},
            tokens=250, prompt_seconds=6.0, offline_requests=256, offline_concurrency=128, t2w_concurrency=32,
            warmup_concurrency=64, max_num_seqs=128, max_model_len=1024)
QUICK = dict(levels=[1, 2], requests={1: 2, 2: 2}, tokens=30, prompt_seconds=2.0, offline_requests=4,
             offline_concurrency=4, t2w_concurrency=2, warmup_concurrency=0, max_num_seqs=8, max_model_len=512)

TARGETS = {  # issue 6
    "first_chunk_p50_c1_s": 0.075,
    "first_chunk_p99_c32_s": 0.250,
    "underruns_c32": 0,
    "underruns_c64": 0,
    "offline_rtf": 0.002,
    "t2w_speedup_c32": 8.0,
}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--preset", default="cosyvoice2-0.5b", help="make_random_model preset (tiny for CPU tests)")
    ap.add_argument("--model-dir", type=Path, help="use this model directory instead of generating one")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "runs/h200")))
    ap.add_argument("--llm-dtype", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--flow-dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    ap.add_argument("--estimator", choices=["torch", "compiled", "onnxruntime", "tensorrt"], default="torch",
                    help="flow estimator backend")
    ap.add_argument("--llm-compile", action="store_true", help="torch.compile the native engine's decode step")
    ap.add_argument("--t2w-max-batch", type=int, default=64, help="token2wav batcher's largest batch")
    ap.add_argument("--tokens", type=int, help="forced tokens per request (default 250; quick 30)")
    ap.add_argument("--max-level-seconds", type=float, default=40.0)
    ap.add_argument("--torch-profile", type=int, metavar="C",
                    help="profile a short level at concurrency C (default 32 on cuda, off on cpu; 0 = off)")
    ap.add_argument("--budget-s", type=float, default=450.0,
                    help="wall-clock budget: later phases are skipped (and listed) once it is spent (default 450)")
    ap.add_argument("--skip", default="", help="comma list of phases to skip: sweep,offline,t2w,profile")
    ap.add_argument("--quick", action="store_true", help="tiny workload for a CPU smoke test")
    return ap.parse_args(argv)


def log(msg: str) -> None:
    print(f"[h200] {msg}", file=sys.stderr, flush=True)


def make_config(args, plan: dict, model_dir: Path, speakers_dir: Path) -> Config:
    cuda = args.device.startswith("cuda")
    llm_dtype = args.llm_dtype or ("bfloat16" if cuda else "float32")
    return Config.model_validate({
        "model": {"dir": str(model_dir), "device": args.device, "llm_dtype": llm_dtype,
                  "flow_dtype": args.flow_dtype},
        "engine": {"kind": "native", "max_num_seqs": plan["max_num_seqs"], "max_model_len": plan["max_model_len"],
                   "cuda_graphs": cuda, "compile": args.llm_compile},
        "token2wav": {"batching": True, "max_batch": args.t2w_max_batch, "estimator": args.estimator},
        "speakers": {"dir": str(speakers_dir)},
    })


async def torch_profile(target, workload: bench.Workload, concurrency: int, path: Path, device: str) -> dict:
    """One short level under torch.profiler; writes the operator table sorted by device time."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    short = dataclasses.replace(workload, tokens=min(workload.tokens or 100, 100))
    kwargs = {}
    try:  # ops run in the stages' executor threads, not in this one
        kwargs["experimental_config"] = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    except (AttributeError, TypeError):
        log("this torch cannot profile all threads: CPU operators of the worker threads are missing")
    with profile(activities=activities, record_shapes=False, **kwargs) as prof:
        level = await bench.run_level(target, short, concurrency, concurrency, detail=False,
                                      label=f"torch profile x{concurrency}")
    sort = "self_device_time_total" if device.startswith("cuda") else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=sort, row_limit=40)
    path.write_text(f"torch.profiler, {concurrency} streams x {short.tokens} tokens, sorted by {sort}\n\n{table}\n",
                    encoding="utf-8")
    return {"concurrency": concurrency, "tokens": short.tokens, "file": path.name, "wall_s": level["wall_s"]}


def check_targets(results: dict) -> list[dict]:
    by_c = {lv["concurrency"]: lv for lv in results.get("levels", [])}
    rows = []

    def row(name, value, target, ok_when, unit=""):
        met = None if value is None else ok_when(value, target)
        rows.append({"target": name, "value": value, "goal": target, "unit": unit, "met": met})

    c1, c32, c64 = by_c.get(1), by_c.get(32), by_c.get(64)
    row("first chunk p50 at concurrency 1 <= 75 ms", c1 and c1["first_chunk_s"]["p50"],
        TARGETS["first_chunk_p50_c1_s"], lambda v, t: v <= t, "s")
    row("first chunk p99 at concurrency 32 <= 250 ms", c32 and c32["first_chunk_s"]["p99"],
        TARGETS["first_chunk_p99_c32_s"], lambda v, t: v <= t, "s")
    row("zero underruns at concurrency 32", c32 and c32["underruns"]["late_chunks"], 0, lambda v, t: v <= t,
        "late chunks")
    row("zero underruns at concurrency 64", c64 and c64["underruns"]["late_chunks"], 0, lambda v, t: v <= t,
        "late chunks")
    off = results.get("offline")
    row("offline aggregate RTF <= 0.002 (>= 500x real time)", off and off["rtf"], TARGETS["offline_rtf"],
        lambda v, t: v <= t, "")
    cmp = results.get("t2w_compare")
    row("batched token2wav >= 8x one-at-a-time at 32", cmp and cmp.get("speedup"), TARGETS["t2w_speedup_c32"],
        lambda v, t: v >= t, "x")
    return rows


def format_targets(rows: list[dict]) -> str:
    out = ["targets (issue 6):"]
    for r in rows:
        v = r["value"]
        if v is None:
            shown, verdict = "not measured", "-"
        else:
            shown = f"{1e3 * v:.1f} ms" if r["unit"] == "s" else (f"{v:.2f}x" if r["unit"] == "x" else
                                                                   f"{v:.4f}" if isinstance(v, float) else str(v))
            verdict = "met" if r["met"] else "MISSED"
        out.append(f"  {verdict:7s} {r['target']}: {shown}")
    return "\n".join(out)


async def measure(args, plan: dict, config: Config, results: dict, phases: dict, skip: set[str],
                  deadline: float) -> None:
    """Phases 2-8. A phase that fails is recorded in results["phase_errors"] and the next one
    runs; a phase (or sweep level) that would start after `deadline` minus what the later
    phases need is skipped and listed in results["skipped"]."""
    from async_cosyvoice.tts import Synthesizer

    progress = bench.Progress()
    skipped = results.setdefault("skipped", [])
    errors = results.setdefault("phase_errors", {})
    reserve = {"sweep": 150.0, "offline": 75.0, "t2w": 20.0, "profile": 0.0} if not args.quick else {}

    def time_left(phase: str, label: str | None = None) -> bool:
        if deadline - time.monotonic() - reserve.get(phase, 0.0) > 0:
            return True
        skipped.append(label or phase)
        log(f"out of time budget: skipping {label or phase}")
        return False

    async def run_phase(name: str, coro) -> None:
        t = time.monotonic()
        try:
            await coro
        except Exception as e:  # keep what the other phases measure
            errors[name] = "".join(traceback.format_exception(type(e), e, e.__traceback__))
            log(f"{name} failed: {type(e).__name__}: {e}")
        phases[f"{name}_s"] = time.monotonic() - t

    t = time.monotonic()
    synth = await Synthesizer.create(config, warmup=not args.quick)
    phases["load_s"] = time.monotonic() - t
    log(f"synthesizer ready in {phases['load_s']:.1f} s")
    stages = bench.SynthesizerStages(synth)
    try:
        speaker = bench.SpeakerSpec(prompt_seconds=plan["prompt_seconds"], seed=args.seed)
        results["meta"]["prompt_tokens"] = await bench.register_in_process(synth, speaker)
        log(f"speaker {speaker.speaker_id!r}: {results['meta']['prompt_tokens']} prompt tokens")
        target = bench.InProcessTarget(synth)
        workload = bench.Workload(tokens=plan["tokens"], seed=args.seed, speaker_id=speaker.speaker_id)
        results["meta"]["workload"] = workload.to_json()

        if plan["warmup_concurrency"]:
            async def warm_every_level():
                # one untimed full-length round per level: every (batch, length) shape the sweep
                # meets is compiled / captured before it is timed
                for c in plan["levels"]:
                    await bench.run_level(target, workload, c, c, progress=progress, label=f"warm-up x{c}",
                                          detail=False)
            await run_phase("warmup", warm_every_level())

        async def sweep():
            results["levels"] = []
            counts = bench.requests_per_level(plan["levels"], plan["requests"])
            for c in plan["levels"]:
                if time_left("sweep", f"sweep level {c}"):
                    level_budget = deadline - time.monotonic() - reserve.get("sweep", 0.0)
                    results["levels"].append(await bench.run_level(
                        target, workload, c, counts[c], progress=progress, stages=stages,
                        max_seconds=min(args.max_level_seconds, max(level_budget, 1.0))))

        async def offline():
            results["offline"] = await bench.run_level(
                target, dataclasses.replace(workload, stream=False), plan["offline_concurrency"],
                plan["offline_requests"], progress=progress, max_seconds=2 * args.max_level_seconds,
                stages=stages, detail=False, label=f"offline x{plan['offline_concurrency']}")

        async def t2w():
            results["t2w_compare"] = await bench.token2wav_compare(
                synth, plan["t2w_concurrency"], plan["tokens"], speaker.speaker_id, seed=args.seed,
                max_batch=args.t2w_max_batch, warmup=not args.quick, progress=progress)

        c = args.torch_profile if args.torch_profile is not None else (32 if args.device.startswith("cuda") else 0)

        async def profile():
            results["torch_profile"] = await torch_profile(target, workload, c, args.out / f"profile_c{c}.txt",
                                                           args.device)

        for name, fn, wanted in (("sweep", sweep, True), ("offline", offline, True), ("t2w", t2w, True),
                                 ("profile", profile, bool(c))):
            if wanted and name not in skip and (name == "sweep" or time_left(name)):
                await run_phase(name, fn())
    finally:
        await synth.close()


def main(argv=None) -> int:
    args = parse_args(argv)
    plan = dict(QUICK if args.quick else FULL)
    if args.tokens:
        plan["tokens"] = args.tokens
    skip = {s for s in args.skip.split(",") if s}
    args.out.mkdir(parents=True, exist_ok=True)
    t_all = time.monotonic()
    phases: dict = {}
    torch.manual_seed(args.seed)
    np.random.seed(args.seed)

    t = time.monotonic()
    model_dir = args.model_dir or (Path(tempfile.gettempdir()) / "async_cosyvoice_bench"
                                   / f"{args.preset}-seed{args.seed}")
    if not args.model_dir:
        log(f"random model {args.preset} -> {model_dir}")
        model_dir = make_random_model(args.preset, model_dir, seed=args.seed)
    phases["model_s"] = time.monotonic() - t
    log(f"model ready in {phases['model_s']:.1f} s")

    scratch = tempfile.TemporaryDirectory(prefix="h200-bench-spk-")  # the speaker store, removed at exit
    config = make_config(args, plan, model_dir, Path(scratch.name))
    results = {"title": f"async_cosyvoice on {args.device}", "meta": {
        "script": "benchmarks/h200_bench.py", "argv": sys.argv[1:] if argv is None else list(argv),
        "preset": None if args.model_dir else args.preset, "model_dir": str(model_dir), "quick": args.quick,
        "plan": {k: (v if not isinstance(v, dict) else {str(a): b for a, b in v.items()}) for k, v in plan.items()},
        "config": config.model_dump(mode="json"), "environment": bench.environment(args.device),
        "phases": phases}}
    if args.device.startswith("cuda"):
        results["title"] = f"async_cosyvoice on {results['meta']['environment'].get('gpu', args.device)}"
    try:
        asyncio.run(measure(args, plan, config, results, phases, skip, deadline=t_all + args.budget_s))
    except Exception as e:  # e.g. the model did not load: still write what there is
        results.setdefault("phase_errors", {})["setup"] = "".join(
            traceback.format_exception(type(e), e, e.__traceback__))
        log(f"failed: {type(e).__name__}: {e}")
    finally:
        scratch.cleanup()
        phases["total_s"] = time.monotonic() - t_all
        results["targets"] = check_targets(results)
        path = bench.write_json(results, args.out / "h200_results.json")
        log(f"wrote {path}")

    text = []
    if results.get("levels"):
        text += [f"streaming, {plan['tokens']} tokens per request ({plan['tokens'] * bench.SECONDS_PER_TOKEN:g} s of "
                 f"audio), prompt {results['meta'].get('prompt_tokens')} tokens:",
                 bench.format_table(results["levels"]),
                 "", bench.format_stages(results["levels"], "where the time went")]
    if results.get("offline"):
        off = results["offline"]
        text += ["", f"offline (non-streaming), {off['requests']} requests, {off['concurrency']} in flight: "
                     f"{off['audio_s']:.1f} audio s in {off['wall_s']:.2f} s = "
                     f"{off['audio_s_per_s'] or 0.0:.1f}x real time, "
                     f"RTF {off['rtf'] or float('nan'):.5f}, errors {off['errors']}"]
    if results.get("t2w_compare"):
        text += ["", bench.format_t2w(results["t2w_compare"])]
    if results.get("skipped"):
        text += ["", "skipped to stay within --budget-s: " + ", ".join(results["skipped"])]
    for name, trace in (results.get("phase_errors") or {}).items():
        text += ["", f"phase {name} FAILED:", trace.rstrip()]
    text += ["", format_targets(results["targets"]),
             "", "phases: " + ", ".join(f"{k} {v:.1f} s" for k, v in phases.items())]
    table = "\n".join(text)
    print(table)
    (args.out / "h200_table.txt").write_text(table + "\n", encoding="utf-8")
    targets_ms = {"75 ms": 75.0, "250 ms": 250.0} if not args.quick else None
    for p in bench.write_plots(results, args.out, prefix="h200-", targets=targets_ms):
        log(f"wrote {p}")
    errors = sum(lv["errors"] for lv in results.get("levels", [])) + (results.get("offline") or {}).get("errors", 0)
    return 1 if errors or results.get("phase_errors") else 0


if __name__ == "__main__":
    sys.exit(main())
