"""The exact flow state cache, measured: frames computed and flow time per chunk (cache vs the full
recompute, at 1 and N streams), token2wav batched vs one stream at a time, and the cache's memory
per stream and per speaker (measured, and at full-size dims).

    # CPU, the tiny fixture (default sizes are small)
    python benchmarks/flow_cache_bench.py --model-dir ../shared/fixtures/cosyvoice2-tiny
    # GPU, a full-size random model (written once with make_random_model), the README workload
    python benchmarks/flow_cache_bench.py --random-preset cosyvoice2-0.5b --random-dir /tmp/cv2-full \\
        --device cuda --dtype float16 --streams 1 32 --prompt-tokens 150 --tokens 250

All streams share one registered speaker's prompt (its prefix is cached once) and have their own
random target tokens; every stream's tokens are known up front, so chunks run in lockstep rounds
(one batched call per round, like the token2wav batcher under load). Chunks follow the service's
schedule (ChunkSchedule(first_hop, prompt_align=1), doubling hops up to max_hop_multiple·first_hop).
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from async_cosyvoice.model_dir import build_models, load_model_dir
from async_cosyvoice.models.dims import FlowDims
from async_cosyvoice.models.hift import NSFNoise
from async_cosyvoice.random_model import ensure_random_model
from async_cosyvoice.token2wav import ChunkSchedule, Token2WavRunner, Token2WavStream
from async_cosyvoice.token2wav.flow_cache import speaker_prefix_tokens, state_nbytes

MB = 1 << 20


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Workload:
    def __init__(self, args, device):
        self.device = device
        g = torch.Generator().manual_seed(0)
        self.prompt_token = torch.randint(0, 6561, (1, args.prompt_tokens), generator=g, dtype=torch.int32)
        self.prompt_feat = torch.randn(1, 2 * args.prompt_tokens, 80, generator=g) - 5
        self.embedding = torch.randn(1, 192, generator=g)
        self.tokens = [torch.randint(0, 6561, (args.tokens,), generator=g).tolist() for _ in range(max(args.streams))]
        self.schedule = ChunkSchedule(first_hop=args.first_hop, max_hop_multiple=args.max_hop_multiple, prompt_align=1)

    def streams(self, n: int) -> list[Token2WavStream]:
        return [Token2WavStream(self.prompt_token, self.prompt_feat, self.embedding, schedule=self.schedule,
                                noise=NSFNoise.zero(), device=self.device, prompt_key="speaker") for _ in range(n)]


def lockstep(runner: Token2WavRunner, streams, tokens, device, flow_only: bool):
    """Every stream's chunks, one batched call per round. Returns per round (ms, frames computed per
    stream, frames read from cache per stream, streams), and the largest per-stream state seen."""
    rounds, peak_state = [], 0
    for s, t in zip(streams, tokens):
        s.append(t)
    while jobs := [j for s in streams if (j := s.next_job(llm_done=True)) is not None]:
        st = runner.stats
        frames, cached = st.flow_frames, st.flow_cached_frames
        sync(device)
        t0 = time.perf_counter()
        if flow_only:
            for j, mel in zip(jobs, runner.flow_mels(jobs)):
                hift_mel, _ = j.stream.hift_input(j, mel)
                n = hift_mel.shape[2] * j.stream.schedule.samples_per_frame
                j.stream.finish(j, hift_mel, hift_mel.new_zeros(1, n), hift_mel.new_zeros(1, 1, n))
        else:
            runner.run_many(jobs)
        sync(device)
        ms = (time.perf_counter() - t0) * 1000
        prefix = runner._speaker_prefix(streams[0]) if runner.flow_cache else None
        peak_state = max([peak_state] + [s.flow_state.nbytes(excluding=prefix) for s in streams
                                         if s.flow_state is not None])
        rounds.append((ms, (st.flow_frames - frames) / len(jobs), (st.flow_cached_frames - cached) / len(jobs),
                       len(jobs)))
    return rounds, peak_state


def per_chunk(models, work, args, device):
    print("\n## flow per chunk (flow only; frames per stream; ms per batched call of all streams)")
    print("| streams | mode | chunk | frames computed | frames from cache | flow ms |")
    print("|---|---|---|---|---|---|")
    summary = {}
    for n in args.streams:
        for mode in ("recompute", "cache"):
            runner = Token2WavRunner(models.flow, models.hift, flow_cache=mode == "cache", max_flow_batch=None,
                                     length_bucket_ratio=1e9)
            lockstep(runner, work.streams(n), work.tokens[:n], device, flow_only=True)  # warm-up
            rounds, _ = lockstep(runner, work.streams(n), work.tokens[:n], device, flow_only=True)
            for i, (ms, frames, cached, k) in enumerate(rounds):
                print(f"| {n} | {mode} | {i}{' (final)' if i == len(rounds) - 1 else ''} | {frames:.0f} | "
                      f"{cached:.0f} | {ms:.1f} |")
            summary[(n, mode)] = (sum(r[1] for r in rounds), sum(r[0] for r in rounds), rounds[0][0])
    print("\n| streams | mode | frames computed per utterance | flow ms, all chunks | first chunk ms |")
    print("|---|---|---|---|---|")
    for (n, mode), (frames, ms, first) in summary.items():
        print(f"| {n} | {mode} | {frames:.0f} | {ms:.1f} | {first:.1f} |")


def batched_vs_alone(models, work, args, device):
    n = max(args.streams)
    print(f"\n## token2wav (flow + HiFT) for {n} streams: batched rounds vs one stream at a time (cache on)")
    runner = Token2WavRunner(models.flow, models.hift, length_bucket_ratio=args.length_bucket_ratio)
    lockstep(runner, work.streams(n), work.tokens[:n], device, flow_only=False)  # warm-up
    times = {}
    for rep in range(args.repeats):
        rounds, peak = lockstep(runner, work.streams(n), work.tokens[:n], device, flow_only=False)
        times.setdefault("batched", []).append(sum(r[0] for r in rounds))
        sync(device)
        t0 = time.perf_counter()
        for s, t in zip(work.streams(n), work.tokens[:n]):
            runner.render(s, t)
        sync(device)
        times.setdefault("alone", []).append((time.perf_counter() - t0) * 1000)
    b, a = statistics.median(times["batched"]), statistics.median(times["alone"])
    audio_s = n * args.tokens * 0.04
    print(f"batched {b:.0f} ms, one at a time {a:.0f} ms (medians of {args.repeats}): {a / b:.2f}x; "
          f"{audio_s:.0f} s of audio, batched RTF {b / 1000 / audio_s:.4f}")
    return peak


def memory(models, work, args, device, peak_stream_bytes):
    dtype = next(models.flow.parameters()).dtype
    runner = Token2WavRunner(models.flow, models.hift)
    prefix = runner._speaker_prefix(work.streams(1)[0])
    dims = models.flow.dims
    P, T = args.prompt_tokens, args.tokens
    ps = speaker_prefix_tokens(P, dims.encoder.static_chunk_size, dims.pre_lookahead_len)
    print(f"\n## cache memory ({dtype}; prompt {P} tokens, target {T} tokens)")
    print(f"this model: per speaker {0 if prefix is None else prefix.nbytes() / MB:.2f} MiB ({ps} prompt tokens "
          f"cached), per stream at most {peak_stream_bytes / MB:.2f} MiB beyond its speaker's prefix")
    full = FlowDims()
    last = (P + T - dims.pre_lookahead_len) // dims.encoder.static_chunk_size * dims.encoder.static_chunk_size
    for dt in (torch.float16, torch.float32):
        per_tok = (state_nbytes(full, 1000, dt) - state_nbytes(full, 500, dt)) / 500
        print(f"full-size dims, {dt}: {per_tok / MB:.3f} MiB per cached token ({per_tok / 2 / MB:.3f} per mel frame); "
              f"per speaker {state_nbytes(full, ps, dt) / MB:.0f} MiB; per stream up to "
              f"{(state_nbytes(full, last, dt) - state_nbytes(full, ps, dt)) / MB:.0f} MiB "
              f"(its own {last - ps} tokens, before the final chunk drops it)")
    if device.type == "cuda":
        print(f"CUDA max memory allocated during the run: {torch.cuda.max_memory_allocated(device) / MB:.0f} MiB")


def chunked_final_difference(models, golden_dir: Path):
    """The optional chunked final (Token2WavRunner(chunked_final=True)) against the goldens (upstream's
    exact final: full attention): max |difference| of the final chunk's flow mel and of the audio."""
    print("\n## chunked final vs upstream's full-attention final (the fixture's e2e goldens, zero NSF noise)")
    print("| run | final chunk mel max abs diff | audio max abs diff | audio max abs (scale) | earlier chunks equal |")
    print("|---|---|---|---|---|")
    for path in sorted(golden_dir.glob("e2e_stream_*.npz")):
        g = dict(np.load(path))

        def t(key: str, g=g) -> torch.Tensor:
            return torch.from_numpy(g[key])
        records = []
        runner = Token2WavRunner(models.flow, models.hift, recorder=records.append, chunked_final=True)
        stream = Token2WavStream(t("prompt_token"), t("prompt_feat"), t("embedding"), noise=NSFNoise.zero(),
                                 schedule=ChunkSchedule(first_hop=int(g["token_hop_len"][0])))
        audio = torch.cat(runner.render(stream, g["token"][0].tolist()))
        last = len(records) - 1
        mel_diff = (records[-1].flow_mel - t(f"call{last}/flow_mel")).abs().max().item()
        ref = t("audio_zero_noise")[0]
        n_before = sum(int(x) for x in g["chunk_lengths"][:-1])
        audio_diff = (audio - ref).abs().max().item()
        before = (audio[:n_before] - ref[:n_before]).abs().max().item() <= 1e-4
        print(f"| {path.stem} | {mel_diff:.3g} | {audio_diff:.3g} | {ref.abs().max().item():.3g} | {before} |")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--model-dir", type=Path)
    src.add_argument("--random-preset", help="write (once) and use a random model of this preset")
    ap.add_argument("--random-dir", type=Path, default=Path("/tmp/cosyvoice2-random"))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--prompt-tokens", type=int, default=75)
    ap.add_argument("--tokens", type=int, default=120)
    ap.add_argument("--first-hop", type=int, default=15)
    ap.add_argument("--max-hop-multiple", type=int, default=4)
    ap.add_argument("--length-bucket-ratio", type=float, default=1.5)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--chunked-final-golden", type=Path, default=None,
                    help="a golden dir (the fixture's golden/): measure the chunked final against it")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = args.model_dir
    if args.random_preset:
        model_dir = ensure_random_model(args.random_preset, args.random_dir)
    device = torch.device(args.device)
    md = load_model_dir(model_dir)
    models = build_models(md, device=device, dtype=getattr(torch, args.dtype), with_llm=False)
    print(f"device {device}, flow dtype {args.dtype}, torch threads {torch.get_num_threads()}, "
          f"prompt {args.prompt_tokens} tokens, target {args.tokens} tokens, first hop {args.first_hop}")
    work = Workload(args, device)
    with torch.inference_mode():
        per_chunk(models, work, args, device)
        peak = batched_vs_alone(models, work, args, device)
        memory(models, work, args, device, peak)
        if args.chunked_final_golden:
            chunked_final_difference(models, args.chunked_final_golden)


if __name__ == "__main__":
    main()
