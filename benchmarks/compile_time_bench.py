"""Compile time of the full-size flow estimator: whole-module torch.compile against regional
(token2wav.compile_regions: each transformer / resnet block compiled on its own).

The estimator is built at the official dimensions (models/dims.py: CosyVoice2-0.5B's
CausalConditionalDecoder, 56 transformer blocks and 14 resnets, or with --model cosyvoice3
Fun-CosyVoice3-0.5B's DiT, 22 blocks) with random weights, nothing on disk, and called through
CompiledEstimator (dynamic shapes, as the server builds it) at one tiny bucket. Each measurement
runs in a new process: "cold" with an empty TORCHINDUCTOR_CACHE_DIR, "warm" in a new process on the
cache the cold run left (a restart: Dynamo traces again, inductor's FX-graph cache hits). Prints
the first call's seconds (Dynamo + AOTAutograd + inductor, or cache lookups), the median of
--calls more (the compiled program's speed; on CUDA, CUDA-graph replays),
Dynamo's compiled programs and the largest difference from the eager module.

    PYTHONPATH=. python benchmarks/compile_time_bench.py [--model cosyvoice2] [--modes whole regional] [--batch 2] [--frames 150]
        [--device cpu] [--dtype float32] [--calls 5] [--threads 1]

CPU by default (--device cuda on a GPU machine: there also the CUDA graph of the bucket is
captured in the first call). Threads: --threads for torch; on the CPU one inductor compile worker
(TORCHINDUCTOR_COMPILE_THREADS=1).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
from torch._dynamo.utils import counters

from async_cosyvoice.estimator.torch_backend import CompiledEstimator
from async_cosyvoice.models.cosyvoice3.dit import DiT
from async_cosyvoice.models.dims import DiTDims, EstimatorDims
from async_cosyvoice.models.flow.estimator import CausalConditionalDecoder

MODELS = {"cosyvoice2": lambda: CausalConditionalDecoder(EstimatorDims()), "cosyvoice3": lambda: DiT(DiTDims())}


def measure(model: str, mode: str, batch: int, frames: int, device: str, calls: int = 5,
            dtype: torch.dtype = torch.float32) -> dict:
    """One process's measurement: build, compile (the first call), then the median of `calls` more."""
    torch.manual_seed(0)
    module = MODELS[model]().eval().to(device, dtype)
    est = CompiledEstimator(module, compile_regions=mode == "regional", cuda_graphs=device == "cuda",
                            pad_to_buckets=True, batch_buckets=(batch,))
    g = torch.Generator(device).manual_seed(1)
    x, mu, cond = (torch.randn(batch, 80, frames, generator=g, device=device, dtype=dtype) for _ in range(3))
    args = (x, torch.ones(batch, 1, frames, device=device, dtype=dtype), mu,
            torch.rand(batch, generator=g, device=device, dtype=dtype),
            torch.randn(batch, 80, generator=g, device=device, dtype=dtype), cond)
    seconds = []
    with torch.inference_mode():
        for _ in range(1 + calls):
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = est(*args)
            while est.capture_wanted():  # the first call's bucket (the server captures it in a capture thread)
                pass
            if device == "cuda":
                torch.cuda.synchronize()
            seconds.append(time.perf_counter() - t0)
        err = (out - module(*args)).abs().max().item()
    return {"first_s": seconds[0], "call_s": statistics.median(seconds[1:]),
            "programs": counters["stats"]["unique_graphs"], "compiled": est._compiled, "max_abs_err": err}


def child(args: argparse.Namespace, mode: str, cache_dir: str) -> dict:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache_dir)
    if args.device == "cpu":  # a shared CPU box: one compile worker (a GPU run compiles as the server does)
        env["TORCHINDUCTOR_COMPILE_THREADS"] = "1"
    cmd = [sys.executable, __file__, "--child", mode, "--model", args.model, "--batch", str(args.batch),
           "--frames", str(args.frames), "--device", args.device, "--threads", str(args.threads),
           "--calls", str(args.calls), "--dtype", args.dtype]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if done.returncode:
        raise SystemExit(f"{mode} run failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(MODELS), default="cosyvoice2")
    p.add_argument("--modes", nargs="+", choices=("whole", "regional"), default=["whole", "regional"])
    p.add_argument("--batch", type=int, default=2)
    # not a channel count (80, 256, 320, 512): dynamic shapes would tie the frames to it and specialise
    p.add_argument("--frames", type=int, default=150)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default="float32",
                   help="the estimator's dtype (configs/gpu.yaml runs the flow in float16)")
    p.add_argument("--calls", type=int, default=5, help="calls after the first, timed (median)")
    p.add_argument("--child", choices=("whole", "regional"), help=argparse.SUPPRESS)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.child:
        print(json.dumps(measure(args.model, args.child, args.batch, args.frames, args.device, args.calls,
                                 getattr(torch, args.dtype))))
        return
    print(f"{args.model} estimator on {args.device} in {args.dtype}, batch {args.batch} x {args.frames} frames, "
          f"torch {torch.__version__}, {args.threads} thread(s)")
    print(f"{'mode':<9} {'cache':<5} {'first call s':>12} {'then s/call':>11} {'programs':>8} {'max |err|':>10}")
    for mode in args.modes:
        with tempfile.TemporaryDirectory(prefix="inductor-") as cache_dir:
            for cache in ("cold", "warm"):
                r = child(args, mode, cache_dir)
                flag = "" if r["compiled"] else "  (compile failed: eager)"
                print(f"{mode:<9} {cache:<5} {r['first_s']:>12.1f} {r['call_s']:>11.4f} {r['programs']:>8} "
                      f"{r['max_abs_err']:>10.1e}{flag}", flush=True)


if __name__ == "__main__":
    main()
