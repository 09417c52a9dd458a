"""token2wav alone (no LLM, no service): per-chunk wall time of one streamed utterance, the first
chunk split into flow and HiFT, and a torch.profiler table of one first chunk (host vs device time).

    python benchmarks/t2w_first_chunk.py --model-dir DIR [--device cuda] [--dtype float16]
"""
from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from async_cosyvoice.model_dir import build_models, load_model_dir
from async_cosyvoice.models.hift import NSFNoise
from async_cosyvoice.token2wav import ChunkSchedule, Token2WavRunner, Token2WavStream


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def main(args) -> None:
    models = build_models(load_model_dir(args.model_dir), device=args.device, dtype=getattr(torch, args.dtype))
    runner = Token2WavRunner(models.flow, models.hift)
    g = torch.Generator().manual_seed(0)
    prompt_token = torch.randint(0, 6561, (1, args.prompt_tokens), generator=g, dtype=torch.int32)
    prompt_feat = torch.randn(1, 2 * args.prompt_tokens, 80, generator=g)
    embedding = torch.randn(1, 192, generator=g)
    tokens = torch.randint(0, 6561, (args.tokens,), generator=g).tolist()
    schedule = ChunkSchedule(first_hop=15, prompt_align=1)

    def stream(noise=None) -> Token2WavStream:
        s = Token2WavStream(prompt_token, prompt_feat, embedding, stream=True, schedule=schedule,
                            noise=noise or NSFNoise.zero())
        s.append(tokens)
        return s

    for rep in range(args.repeats):
        s, times = stream(), []
        while (job := s.next_job(llm_done=True)) is not None:
            sync(args.device)
            t = time.perf_counter()
            runner.run(job)
            sync(args.device)
            times.append(round((time.perf_counter() - t) * 1000, 1))
        print(f"utterance {rep}: chunk ms {times}", flush=True)

    s = stream()
    job = s.next_job(llm_done=True)
    sync(args.device)
    t = time.perf_counter()
    mel = runner.flow_mels([job])[0]
    sync(args.device)
    t_flow = time.perf_counter() - t
    hift_mel, cache = s.hift_input(job, mel)
    t = time.perf_counter()
    models.hift.inference(hift_mel, cache, NSFNoise.zero())
    sync(args.device)
    print(f"first chunk: flow {t_flow * 1000:.1f} ms, HiFT {(time.perf_counter() - t) * 1000:.1f} ms")

    s = stream()
    job = s.next_job(llm_done=True)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device.startswith("cuda") else [])
    with profile(activities=activities) as prof:
        runner.run(job)
        sync(args.device)
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25, max_name_column_width=60))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--prompt-tokens", type=int, default=150)
    ap.add_argument("--tokens", type=int, default=120)
    ap.add_argument("--repeats", type=int, default=4)
    main(ap.parse_args())
