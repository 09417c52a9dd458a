"""HiFT alone at an offline batch (B utterances of T mel frames): ms per call in float32 and under
bfloat16 / float16 autocast (convolutions in half precision, STFT/iSTFT and the source in
float32), the largest difference from float32, the cost of a request's seeded NSF noise drawn on
the CPU vs on the device, and a profiler table of the float32 call. Where
the offline path's HiFT time goes (docs/offline.md).

    python benchmarks/hift_batch.py --random-preset cosyvoice2-0.5b --device cuda --batch 64 --frames 500
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from async_cosyvoice.model_dir import build_models, load_model_dir
from async_cosyvoice.models.hift import NSFNoise
from async_cosyvoice.random_model import ensure_random_model


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device, repeats: int) -> tuple[float, torch.Tensor]:
    out = fn()  # warm-up (cuDNN algorithm choice)
    times = []
    for _ in range(repeats):
        sync(device)
        t = time.perf_counter()
        out = fn()
        sync(device)
        times.append((time.perf_counter() - t) * 1000)
    return statistics.median(times), out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--model-dir", type=Path)
    src.add_argument("--random-preset")
    ap.add_argument("--random-dir", type=Path, default=Path("/tmp/cosyvoice2-random"))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--frames", type=int, default=100, help="mel frames per utterance (50 per second)")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    model_dir = args.model_dir
    if args.random_preset:
        model_dir = ensure_random_model(args.random_preset, args.random_dir)
    device = torch.device(args.device)
    hift = build_models(load_model_dir(model_dir), device=device, with_llm=False).hift
    mel = torch.randn(args.batch, 80, args.frames, generator=torch.Generator().manual_seed(0)).to(device) - 5
    audio_s = args.batch * args.frames / 50

    def run():
        return hift.inference(mel, None, NSFNoise.zero())[0]

    rows = []
    with torch.inference_mode():
        ms32, ref = timed(run, device, args.repeats)
        rows.append(("float32", ms32, 0.0))
        if device.type == "cuda":
            for dtype in (torch.bfloat16, torch.float16):
                with torch.autocast("cuda", dtype=dtype):
                    ms, out = timed(run, device, args.repeats)
                rows.append((f"{dtype} autocast", ms, (out.float() - ref).abs().max().item()))
        # a request's seeded NSF noise, one generator per row, drawn on the CPU vs on the device
        for where in ("cpu", "cuda") if device.type == "cuda" else ("cpu",):
            def seeded():
                noise = [NSFNoise.random(torch.Generator(device=where).manual_seed(b)) for b in range(args.batch)]
                return hift.inference(mel, None, noise)[0]
            ms, _ = timed(seeded, device, args.repeats)
            rows.append((f"float32, seeded noise drawn on {where}", ms, float("nan")))
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with profile(activities=activities) as prof:
            run()
            sync(device)
    print(f"HiFT, batch {args.batch} x {args.frames} frames = {audio_s:.0f} s of audio, {device}")
    print("| precision | ms per call | x real time | max abs diff vs float32 |")
    print("|---|---|---|---|")
    for name, ms, diff in rows:
        print(f"| {name} | {ms:.1f} | {audio_s / (ms / 1000):.0f} | {diff:.2e} |")
    sort = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    print(prof.key_averages().table(sort_by=sort, row_limit=15, max_name_column_width=50))


if __name__ == "__main__":
    main()
