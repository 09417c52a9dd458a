"""token2wav through the state pool (the exact flow cache as graphed calls) against the graphed
recompute, on one device: GPU milliseconds per audio-second at N streams, the first chunk alone,
how far the pool's (or the flex recompute's) fp16 mels are from the eager recompute's, and a
torch.profiler breakdown.

    # the H200 run: full-size random model (written once), fp16 flow, the README workload; the pool
    # as first built, then key buckets + compiled step, then the recompute (~150 s of set-up each)
    PYTHONPATH=. python benchmarks/slot_pool_bench.py --device cuda --streams 1 16 32 --profile-streams 32 \
        --setups pool-capacity pool recompute --out $OUT
    # the recompute's attention, SDPA with a dense bias against flex_attention with a block mask
    PYTHONPATH=. python benchmarks/slot_pool_bench.py --device cuda --streams 1 16 32 --profile-streams 32 \
        --setups recompute recompute-flex --skip-difference --out $OUT
    # CPU smoke test, tiny fixture
    python benchmarks/slot_pool_bench.py --model-dir ../shared/fixtures/cosyvoice2-tiny --streams 1 2 --tokens 60
    # CPU set-up of the compiled cached step (its blocks compiled by regions) against the eager one
    PYTHONPATH=. python benchmarks/slot_pool_bench.py --model-dir ../shared/fixtures/cosyvoice2-tiny --compile \
        --streams 1 2 --prompt-tokens 50 --tokens 100 --slots 2 --setups pool-keys pool --skip-difference

Each setup is the token2wav stage the server builds (`token2wav.stage.token2wav_batcher`) from
configs/gpu.yaml with the flow cache off (`recompute`: whole-flow graphs over prompt + all tokens,
compiled estimator) or on through the pool (one graph per (streams, new tokens, key tokens) bucket;
the final chunk recomputes, exactly as upstream):

- `recompute-flex`: `recompute` with the estimator's attention through flex_attention and a block
  mask instead of SDPA and a dense bias (`token2wav.flow_attention: flex`; models/flow/attention.py);
- `pool-capacity`: every call attends over the slots' whole capacity, eager step (the pool as first built);
- `pool-keys`: over the call's key bucket (its streams' filled tokens rounded up), eager step;
- `pool`: key buckets and the cached step's repeated blocks through torch.compile (configs/gpu.yaml's
  estimator: compiled; token2wav/slot_regions.py). On a CPU only with --compile (torch.compile
  without CUDA graphs; without it a CPU runs every setup's estimator eagerly): its set-up against
  `pool-keys` is what compiling the cached step costs.

All streams share one registered speaker's 150-token prompt and run their chunks in lockstep
rounds (one `run_many` per round: flow + HiFT), like the batcher under load. Rounds are timed with
the device synchronised; graphs are captured (and the step compiled) in an untimed first pass. The
pool gets as many slots as fit (`flow_cache_slots: auto`, or --slots); streams past them recompute,
as in the server. Results are written after every setup, so a run cut short keeps what it measured.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import yaml

from async_cosyvoice.config import Config
from async_cosyvoice.model_dir import build_models, load_model_dir
from async_cosyvoice.models.hift import NSFNoise
from async_cosyvoice.random_model import ensure_random_model
from async_cosyvoice.token2wav import ChunkSchedule, Token2WavStream
from async_cosyvoice.token2wav.stage import token2wav_batcher
from async_cosyvoice.token2wav.state_pool import StatePool

REPO = Path(__file__).resolve().parents[1]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


SETUPS = {  # token2wav config of each setup, over configs/gpu.yaml
    "recompute": {"flow_cache": False},
    "recompute-flex": {"flow_cache": False, "flow_attention": "flex"},
    "pool-capacity": {"flow_cache": True, "flow_cache_key_tokens": None, "flow_cache_compile": False},
    "pool-keys": {"flow_cache": True, "flow_cache_compile": False},
    "pool": {"flow_cache": True},
}


def stage(model_dir, models, setup: str, args, estimator: str | None = None, slots: int | None = None):
    raw = yaml.safe_load((REPO / "configs" / "gpu.yaml").read_text())
    raw["model"].update(dir=str(model_dir.path), device=args.device)
    raw.setdefault("limits", {})["max_concurrent_streams"] = max(args.streams)
    t2w = raw["token2wav"]
    if (args.device != "cuda" and not args.compile) or estimator:
        t2w.update(estimator=estimator or "torch")
    t2w.update(SETUPS[setup], max_batch=max(args.streams))
    if t2w["flow_cache"]:
        slot_tokens = args.prompt_tokens + args.tokens
        t2w.update(flow_cache_slots=slots or args.slots or "auto", flow_cache_slot_tokens=slot_tokens,
                   flow_cache_speaker_bytes=StatePool.slot_nbytes(models.flow, slot_tokens))  # one speaker slot
    return token2wav_batcher(Config.model_validate(raw), models, model_dir).runner


class Workload:
    def __init__(self, args, device):
        g = torch.Generator().manual_seed(0)
        self.device = device
        self.prompt_token = torch.randint(0, 6561, (1, args.prompt_tokens), generator=g, dtype=torch.int32)
        self.prompt_feat = torch.randn(1, 2 * args.prompt_tokens, 80, generator=g) - 5
        self.embedding = torch.randn(1, 192, generator=g)
        self.tokens = [torch.randint(0, 6561, (args.tokens,), generator=g).tolist() for _ in range(max(args.streams))]
        self.schedule = ChunkSchedule(first_hop=args.first_hop, prompt_align=1)

    def streams(self, n: int) -> list[Token2WavStream]:
        out = [Token2WavStream(self.prompt_token, self.prompt_feat, self.embedding, schedule=self.schedule,
                               noise=NSFNoise.zero(), device=self.device, prompt_key="speaker") for _ in range(n)]
        for s, t in zip(out, self.tokens):
            s.append(t)
        return out


def lockstep(runner, streams, device) -> list[tuple[float, int, int]]:
    """All chunks, one run_many per round. Returns (ms, jobs, final jobs) per round."""
    rounds = []
    while jobs := [j for s in streams if (j := s.next_job(llm_done=True)) is not None]:
        sync(device)
        t0 = time.perf_counter()
        runner.run_many(jobs)
        sync(device)
        rounds.append(((time.perf_counter() - t0) * 1000, len(jobs), sum(j.finalize for j in jobs)))
    return rounds


def progress(setup: str, what: str, t0: float) -> None:
    print(f"[{setup}] {what}: {time.perf_counter() - t0:.1f} s", flush=True)


def first_chunk_ms(runner, work, device, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        s = work.streams(1)[0]
        job = s.next_job(llm_done=True)
        sync(device)
        t0 = time.perf_counter()
        runner.run_many([job])
        sync(device)
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


def flow_mel_difference(recompute, pool, work) -> float:
    """Largest |pool - recompute| over every chunk's flow mel of one stream (each runner on its own stream;
    `pool` may be any runner: recompute-flex is compared the same way)."""
    a, b = work.streams(1)[0], work.streams(1)[0]
    worst = 0.0
    while (ja := a.next_job(llm_done=True)) is not None:
        jb = b.next_job(llm_done=True)
        ma, mb = recompute.flow_mel(ja), pool.flow_mels([jb])[0]
        worst = max(worst, (ma.float() - mb.float()).abs().max().item() if ma.numel() else 0.0)
        for s, j, m in ((a, ja, ma), (b, jb, mb)):
            hm, _ = s.hift_input(j, m)
            n = hm.shape[2] * s.schedule.samples_per_frame
            s.finish(j, hm, hm.new_zeros(1, n), hm.new_zeros(1, 1, n))
    return worst


def profile(runner, work, n: int, device, out: Path) -> dict:
    """One steady-state pass of n streams under torch.profiler: device time by kernel family."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile
    streams = work.streams(n)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch_profile(activities=activities) as prof:
        rounds = lockstep(runner, streams, device)
    chunks = sum(jobs for _, jobs, _ in rounds)
    families = {"attention": ("sdpa", "fmha", "flash", "attention", "softmax"),
                "gemm": ("gemm", "nvjet", "cutlass", "ampere", "matmul", "xmma"),
                "gather/scatter": ("index", "gather", "scatter"), "copy": ("copy", "memcpy", "memset", "cat"),
                "conv": ("conv", "im2col")}
    totals: dict[str, float] = {}
    kernels = 0
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", 0.0) or 0.0
        if t <= 0 or e.key.startswith(("aten::", "##", "Torch-Compiled", "CompiledFunction", "Cached")):  # CPU-side ranges
            continue
        kernels += e.count
        name = e.key.lower()
        fam = next((f for f, keys in families.items() if any(k in name for k in keys)), "elementwise/other")
        totals[fam] = totals.get(fam, 0.0) + t / 1000
    out.mkdir(parents=True, exist_ok=True)
    (out / f"profile_{n}.txt").write_text(prof.key_averages().table(sort_by="device_time_total" if device.type == "cuda"
                                                                     else "cpu_time_total", row_limit=40))
    return {"device_ms_by_family": {k: round(v, 1) for k, v in totals.items()}, "kernels": kernels, "chunks": chunks,
            "kernels_per_chunk": round(kernels / max(chunks, 1))}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", type=Path)
    ap.add_argument("--random-dir", type=Path, default=Path("/tmp/cosyvoice2-random"))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 16, 32, 64])
    ap.add_argument("--prompt-tokens", type=int, default=150)
    ap.add_argument("--tokens", type=int, default=250)
    ap.add_argument("--first-hop", type=int, default=15)
    ap.add_argument("--setups", nargs="+", default=["recompute", "pool-capacity", "pool"], choices=list(SETUPS))
    ap.add_argument("--profile-streams", type=int, default=None, help="profile one pass at this many streams")
    ap.add_argument("--slots", type=int, help="stream slots of the pool (default: as many as fit, "
                    "flow_cache_slots: auto); streams past them recompute, as in the server")
    ap.add_argument("--compile", action="store_true", help="on a CPU: keep configs/gpu.yaml's compiled "
                    "estimator (torch.compile, no CUDA graphs), so `pool` compiles its cached step (on CUDA it always does)")
    ap.add_argument("--fp32-check", action="store_true", help="also compare pool and recompute with an fp32 flow")
    ap.add_argument("--skip-difference", action="store_true", help="skip the pool-vs-recompute mel difference")
    ap.add_argument("--out", type=Path, default=Path("runs/slot-pool"))
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.device(args.device)
    path = args.model_dir or ensure_random_model("cosyvoice2-0.5b", args.random_dir)
    model_dir = load_model_dir(path)
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    models = build_models(model_dir, device=device, dtype=dtype, with_llm=False)
    work = Workload(args, device)
    audio_s = args.tokens / 25
    results: dict = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                     "workload": vars(args) | {"out": str(args.out), "model_dir": str(path)}, "setups": {}}
    # exactness: one stream's every chunk through each pool setup as timed (graphed, compiled where it
    # compiles) against the eager recompute in the flow's dtype; with --fp32-check also in fp32 (eager step)
    reference = None if args.skip_difference else stage(model_dir, models, "recompute", args, estimator="torch")
    differences = {}
    for setup in args.setups:
        t0 = time.perf_counter()
        runner = stage(model_dir, models, setup, args)
        progress(setup, "built", t0)
        with torch.inference_mode():
            lockstep(runner, work.streams(max(args.streams)), device)  # capture / compile, untimed
            progress(setup, f"first pass of {max(args.streams)} streams (compiles)", t0)
            for n in args.streams:
                lockstep(runner, work.streams(n), device)
            progress(setup, "a pass at every level", t0)
            # the graphs those calls wanted (the server's batcher: in its capture thread)
            progress(setup, f"{runner.capture_all_wanted()} wanted graphs captured", t0)
        res: dict = {"setup_s": round(time.perf_counter() - t0, 1), "levels": {}}
        with torch.inference_mode():
            res["first_chunk_ms"] = round(first_chunk_ms(runner, work, device, 5), 2)
            for n in args.streams:
                rounds = lockstep(runner, work.streams(n), device)
                total = sum(ms for ms, _, _ in rounds)
                res["levels"][n] = {"rounds": len(rounds), "total_ms": round(total, 1),
                                    "gpu_ms_per_audio_s": round(total / (n * audio_s), 2),
                                    "final_round_ms": round(sum(ms for ms, _, f in rounds if f), 1),
                                    "round_ms": [round(ms, 1) for ms, _, _ in rounds]}
            if args.profile_streams:
                res["profile"] = profile(runner, work, args.profile_streams, device, args.out / setup)
            if reference is not None and (runner.state_pool is not None or setup == "recompute-flex"):
                key = f"{setup} {str(dtype).removeprefix('torch.')}"
                differences[key] = res["max_abs_mel_difference"] = flow_mel_difference(reference, runner, work)
        if device.type == "cuda":
            res["peak_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 1)
            torch.cuda.reset_peak_memory_stats(device)
        if runner.state_pool is not None:
            calls = runner.slot_calls
            res["pool_gib"] = round(runner.state_pool.nbytes / 2**30, 1)
            res["pool_slots"] = runner.state_pool.n_stream_slots
            res["pool_stats"] = vars(runner.state_pool.stats)
            res["slot_graphs"] = {"captured": len(calls.graphs), "replays": calls.replays, "fallbacks": calls.fallbacks,
                                  "compiled": calls.compiled,
                                  "programs_per_block_class": {} if calls.regions is None else
                                  {cls.__name__: calls.regions.programs_of(cls) for cls in calls.regions.programs},
                                  "calls_by_key_tokens": dict(sorted(calls.key_buckets.items())),
                                  "buckets": sorted(calls.graphs)}
        results["setups"][setup] = res
        (args.out / "slot_pool_results.json").write_text(json.dumps(results, indent=1, default=str))
        print(setup, json.dumps({k: v for k, v in res.items() if k != "levels"}), flush=True)
        for n, lvl in res["levels"].items():
            print(f"  {n:3d} streams: {lvl['gpu_ms_per_audio_s']:7.2f} ms per audio-s, {lvl['rounds']} rounds, "
                  f"final rounds {lvl['final_round_ms']:.0f} of {lvl['total_ms']:.0f} ms", flush=True)
        del runner  # the next setup gets the device's memory (a full pool and the graph pools do not fit together)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    del reference
    if args.fp32_check and dtype != torch.float32 and not args.skip_difference:
        if device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
        m = build_models(model_dir, device=device, dtype=torch.float32, with_llm=False)
        pair = [stage(model_dir, m, setup, args, estimator="torch", slots=1) for setup in ("recompute", "pool-keys")]
        with torch.inference_mode():
            differences["pool-keys float32"] = flow_mel_difference(*pair, work)
        del pair, m
    results["max_abs_mel_difference"] = differences
    print("max |setup - eager recompute| flow mel:", differences, flush=True)
    (args.out / "slot_pool_results.json").write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()
