"""token2wav alone (no LLM, no service): per-chunk wall time of one streamed utterance, the first
chunk split into flow and HiFT, and the kernel launches of one first chunk — for each estimator
set-up asked for (`--setups`):

- `eager`: the flow's PyTorch estimator, recomputing the prefix (flow_cache off);
- `compiled`: the compiled estimator with CUDA graphs per (batch, length) bucket (recomputing);
- `cache`: the exact flow cache (the flow's eager PyTorch module on new frames only);
- `graphs`: the compiled estimator with the whole flow call as one CUDA graph per (streams, tokens)
  bucket (token2wav/flow_graphs.py; recomputing);
- `chunk-graphs`: `graphs`, and HiFT as one CUDA graph per (streams, mel frames) bucket
  (token2wav/hift_graphs.py): the whole chunk in two graph replays.

With `--hift-batch N` each set-up also times HiFT over N streams' chunks of different lengths (a
batch as the server has them: 8 cached frames + 30..120 new): one call per distinct length (how
HiFT batched before token2wav/hift_graphs.py), one padded call, and (chunk-graphs) its graph.

Kernel launches are counted from a torch.profiler trace of one first chunk (flow + HiFT): runtime
calls `cudaLaunchKernel*` / `cuLaunchKernel*` (one kernel each) and `cudaGraphLaunch` (one captured
graph, however many kernels it holds), split into the flow and HiFT halves.

    python benchmarks/t2w_first_chunk.py --model-dir DIR [--device cuda] [--dtype float16] \\
        [--setups eager compiled cache] [--profile-table]
"""
from __future__ import annotations

import argparse
import json
import time

import torch
from torch.profiler import ProfilerActivity, profile

from async_cosyvoice.estimator import make_estimator
from async_cosyvoice.model_dir import build_models, load_model_dir
from async_cosyvoice.models.hift import NSFNoise
from async_cosyvoice.token2wav import ChunkSchedule, Token2WavRunner, Token2WavStream
from async_cosyvoice.token2wav.flow_graphs import FlowGraphs
from async_cosyvoice.token2wav.hift_graphs import HiFTGraphs, render_group

KERNEL_CALLS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")
GRAPH_CALLS = ("cudaGraphLaunch",)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def launches(fn, device: str) -> dict:
    """Kernel and graph launches of fn() (CUDA only), and the host/device time the profiler saw."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    with profile(activities=activities) as prof:
        fn()
        sync(device)
    names = [e.name for e in prof.events()]
    return {"kernels": sum(n in KERNEL_CALLS for n in names), "graphs": sum(n in GRAPH_CALLS for n in names),
            "table": prof.key_averages().table(sort_by="cpu_time_total", row_limit=20, max_name_column_width=60)}


def measure(models, setup: str, args) -> dict:
    estimator = None if setup == "cache" else make_estimator("torch" if setup == "eager" else "compiled", models.flow)
    graphs = FlowGraphs(models.flow, estimator.capturable, estimator) if setup in ("graphs", "chunk-graphs") else None
    schedule = ChunkSchedule(first_hop=15, prompt_align=1)
    hift_graphs = (HiFTGraphs(models.hift, cache_samples=schedule.source_cache_len) if setup == "chunk-graphs"
                   else None)
    runner = Token2WavRunner(models.flow, models.hift, estimator=estimator, flow_cache=setup == "cache",
                             flow_graphs=graphs, hift_graphs=hift_graphs)
    g = torch.Generator().manual_seed(0)
    prompt_token = torch.randint(0, 6561, (1, args.prompt_tokens), generator=g, dtype=torch.int32)
    prompt_feat = torch.randn(1, 2 * args.prompt_tokens, 80, generator=g)
    embedding = torch.randn(1, 192, generator=g)
    tokens = torch.randint(0, 6561, (args.tokens,), generator=g).tolist()

    def stream() -> Token2WavStream:
        # prompt_key: a registered speaker, so the cache set-up shares the prompt's prefix (as served)
        s = Token2WavStream(prompt_token, prompt_feat, embedding, stream=True, schedule=schedule,
                            noise=NSFNoise.zero(), prompt_key="bench-speaker")
        s.append(tokens)
        return s

    utterances = []
    for _ in range(args.repeats):  # the first one compiles / captures / fills the speaker's prefix
        s, times = stream(), []
        while (job := s.next_job(llm_done=True)) is not None:
            sync(args.device)
            t = time.perf_counter()
            runner.run(job)
            sync(args.device)
            times.append(round((time.perf_counter() - t) * 1000, 1))
        utterances.append(times)
        while runner.capture_wanted():  # what the server's batcher's capture thread does, untimed
            pass

    s = stream()
    job = s.next_job(llm_done=True)
    sync(args.device)
    t = time.perf_counter()
    mel = runner.flow_mels([job])[0]
    sync(args.device)
    flow_ms = (time.perf_counter() - t) * 1000
    hift_mel, cache = s.hift_input(job, mel)

    def hift_call():
        return render_group(models.hift, hift_graphs, [hift_mel], [cache], [NSFNoise.zero()])
    hift_call()  # a graph set-up wants its bucket here; captured next
    while runner.capture_wanted():
        pass
    sync(args.device)
    t = time.perf_counter()
    hift_call()
    sync(args.device)
    hift_ms = (time.perf_counter() - t) * 1000

    s = stream()
    job = s.next_job(llm_done=True)
    flow = launches(lambda: runner.flow_mels([job]), args.device)
    mel = runner.flow_mels([job])[0]
    hift_mel, cache = s.hift_input(job, mel)
    hift = launches(lambda: render_group(models.hift, hift_graphs, [hift_mel], [cache], [NSFNoise.zero()]),
                    args.device)
    out = {"setup": setup, "chunk_ms": utterances, "first_chunk_flow_ms": round(flow_ms, 1),
           "first_chunk_hift_ms": round(hift_ms, 1), "flow_launches": {k: flow[k] for k in ("kernels", "graphs")},
           "hift_launches": {k: hift[k] for k in ("kernels", "graphs")}, "flow_profile": flow["table"]}
    if args.hift_batch:
        out["hift_batch_ms"] = hift_batch(models, hift_graphs, args, schedule)
    return out


def hift_batch(models, hift_graphs, args, schedule: ChunkSchedule) -> dict:
    """HiFT over N chunks of different lengths (8 cached frames + 30..120 new): median ms of
    `--repeats` x 5 runs for each way of running it."""
    n, dev, hift = args.hift_batch, args.device, models.hift
    g = torch.Generator().manual_seed(1)
    frames = [schedule.mel_cache_len + 2 * (15 * (1 + k % 4)) for k in range(n)]  # hops 15, 30, 45, 60
    mels = [torch.randn(1, 80, f, generator=g).to(dev) for f in frames]
    caches = [(0.1 * torch.randn(1, 1, schedule.source_cache_len, generator=g)).to(dev) for _ in range(n)]
    noise = [NSFNoise.zero()] * n

    def per_length():
        for f in sorted(set(frames)):
            idx = [i for i in range(n) if frames[i] == f]
            render_group(hift, None, [mels[i] for i in idx], [caches[i] for i in idx], [noise[i] for i in idx])

    ways = {"one call per length": per_length,
            "one padded call": lambda: render_group(hift, None, mels, caches, noise)}
    if hift_graphs is not None:
        ways["one graph replay"] = lambda: render_group(hift, hift_graphs, mels, caches, noise)
    result = {}
    for name, fn in ways.items():
        fn()
        if hift_graphs is not None:  # the bucket the warm call met, captured before the timing
            while hift_graphs.capture_wanted():
                pass
        times = []
        for _ in range(5 * args.repeats):
            sync(dev)
            t = time.perf_counter()
            fn()
            sync(dev)
            times.append((time.perf_counter() - t) * 1000)
        result[name] = round(sorted(times)[len(times) // 2], 2)
    print(f"HiFT over {n} chunks of {sorted(set(frames))} frames, median ms: {result}", flush=True)
    return result


def main(args) -> None:
    models = build_models(load_model_dir(args.model_dir), device=args.device, dtype=getattr(torch, args.dtype))
    results = []
    with torch.inference_mode():
        for setup in args.setups:
            r = measure(models, setup, args)
            results.append(r)
            print(f"{setup}: utterances, chunk ms {r['chunk_ms']}", flush=True)
            if args.profile_table:
                print(r["flow_profile"])
    print("\n| set-up | first chunk flow ms | HiFT ms | flow kernel launches (graph launches) | HiFT kernel launches |")
    print("|---|---|---|---|---|")
    for r in results:
        print(f"| {r['setup']} | {r['first_chunk_flow_ms']} | {r['first_chunk_hift_ms']} | "
              f"{r['flow_launches']['kernels']} ({r['flow_launches']['graphs']}) | {r['hift_launches']['kernels']} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{k: v for k, v in r.items() if k != "flow_profile"} for r in results], f, indent=1)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--prompt-tokens", type=int, default=150)
    ap.add_argument("--tokens", type=int, default=120)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--setups", nargs="+", default=["eager", "compiled", "cache", "graphs", "chunk-graphs"],
                    choices=["eager", "compiled", "cache", "graphs", "chunk-graphs"])
    ap.add_argument("--hift-batch", type=int, default=0, help="also time HiFT over this many chunks of different lengths")
    ap.add_argument("--profile-table", action="store_true", help="print each set-up's profiler table")
    ap.add_argument("--json", help="write the results here")
    main(ap.parse_args())
