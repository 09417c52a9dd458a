"""Native speech-token engine throughput: tokens/s and per-step decode latency for batch sizes 1..64.

For each batch size B, B requests with the same prompt length run concurrently to max_tokens
(stop ids ignored). The decode phase is timed from the moment every stream has its first token
(all prefills done) to the end, so per-step latency = decode time / (max_tokens - 1).

  python benchmarks/bench_llm_engine.py                          # CPU, tiny random model
  python benchmarks/bench_llm_engine.py --model-dir DIR          # real weights
  python benchmarks/bench_llm_engine.py --device cuda --dtype bfloat16 --full-size
  python benchmarks/bench_llm_engine.py --device cuda --check    # greedy engine == reference loop
"""
from __future__ import annotations

import argparse
import asyncio
import random
import time

import torch

from async_cosyvoice.engine.base import GenerationRequest
from async_cosyvoice.engine.native import NativeEngine, NativeEngineConfig
from async_cosyvoice.models.dims import SPEECH_TOKEN_SIZE, LMDims, Qwen2Dims, RASParams
from async_cosyvoice.models.llm import CosyVoice2LM
from async_cosyvoice.sampling import ras_sample

TINY = LMDims(qwen=Qwen2Dims(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                             vocab_size=1024), llm_input_size=64, llm_output_size=64)


def build_model(args) -> CosyVoice2LM:
    if args.model_dir:
        from async_cosyvoice.model_dir import load_model_dir, load_strict
        md = load_model_dir(args.model_dir)
        model = CosyVoice2LM(md.dims.lm)
        load_strict(model, md.llm_state_dict(), "llm.pt")
        return model
    torch.manual_seed(0)
    with torch.device(args.device):  # random init where it will run: a full-size init is slow on CPU
        return CosyVoice2LM(LMDims() if args.full_size else TINY)


def make_request(rid: str, vocab: int, args, rng: random.Random, ras: RASParams = RASParams(),
                 seed: int | None = None, ignore_stop: bool = True) -> GenerationRequest:
    n_text = args.prompt_len // 4
    text = tuple(rng.randrange(vocab) for _ in range(n_text))
    speech = tuple(rng.randrange(SPEECH_TOKEN_SIZE) for _ in range(args.prompt_len - n_text - 2))
    return GenerationRequest(rid, text, speech, min_tokens=0, max_tokens=args.max_tokens, ras=ras, seed=seed,
                             ignore_stop_tokens=ignore_stop)


async def run_batch(engine: NativeEngine, reqs: list[GenerationRequest]) -> tuple[float, float, int]:
    """(seconds until every stream has a token, decode seconds after that, tokens)."""
    t0 = time.perf_counter()
    first_left = len(reqs)
    all_started = asyncio.Event()
    counts = []

    async def one(req):
        nonlocal first_left
        n = 0
        async for tokens in engine.generate(req):
            if n == 0:
                first_left -= 1
                if first_left == 0:
                    all_started.set()
            n += len(tokens)
        counts.append(n)

    tasks = [asyncio.create_task(one(r)) for r in reqs]
    await all_started.wait()
    t1 = time.perf_counter()
    await asyncio.gather(*tasks)
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1, sum(counts)


async def bench(args) -> None:
    model = build_model(args)
    vocab = model.dims.qwen.vocab_size
    config = NativeEngineConfig(max_num_seqs=max(args.batch_sizes), max_model_len=args.max_model_len,
                                max_num_batched_tokens=args.max_num_batched_tokens, device=args.device,
                                dtype=args.dtype, cuda_graphs=not args.no_graphs, compile=args.compile, seed=0)
    t = time.perf_counter()
    engine = NativeEngine(model, config)
    await engine.start()
    print(f"engine ready in {time.perf_counter() - t:.1f}s ({len(engine.runner.graphs)} CUDA graphs); "
          f"params {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M, {args.device} {args.dtype}, "
          f"prompt {args.prompt_len}, max_tokens {args.max_tokens}, KV {engine.runner.cache.nbytes / 2**30:.2f} GiB")
    rng = random.Random(0)
    try:
        if args.check:
            await check(engine, model, vocab, args, rng)
        await run_batch(engine, [make_request("warm", vocab, args, rng)])  # first-touch costs
        print(f"{'batch':>5} {'prefill s':>10} {'step ms':>8} {'decode tok/s':>13} {'total tok/s':>12}")
        for b in args.batch_sizes:
            reqs = [make_request(f"b{b}-{i}", vocab, args, rng) for i in range(b)]
            t_first, t_decode, n = await run_batch(engine, reqs)
            steps = args.max_tokens - 1
            print(f"{b:>5} {t_first:>10.3f} {1e3 * t_decode / steps:>8.2f} {b * steps / t_decode:>13.1f} "
                  f"{n / (t_first + t_decode):>12.1f}")
    finally:
        await engine.stop()


async def check(engine: NativeEngine, model: CosyVoice2LM, vocab: int, args, rng: random.Random) -> None:
    """Greedy streams of 8 concurrent requests equal the one-request reference loop."""
    greedy = RASParams(top_k=1)
    reqs = [make_request(f"check{i}", vocab, args, rng, ras=greedy, ignore_stop=False) for i in range(8)]
    reqs = [GenerationRequest(r.request_id, r.text_tokens[:5 + 3 * i], r.prompt_speech_tokens[:7 * i],
                              min_tokens=4, max_tokens=args.check_tokens, ras=greedy) for i, r in enumerate(reqs)]

    async def one(req):
        return [t async for tokens in engine.generate(req) for t in tokens]
    outs = await asyncio.gather(*(one(r) for r in reqs))
    refs = await asyncio.to_thread(lambda: [model.generate_reference(
        r.text_tokens, r.prompt_speech_tokens, r.min_tokens, r.max_tokens,
        lambda logp, dec: ras_sample(logp, dec, greedy)) for r in reqs])
    same = [o == ref for o, ref in zip(outs, refs)]
    first_diff = [next((i for i, (a, b) in enumerate(zip(o, ref)) if a != b), min(len(o), len(ref)))
                  for o, ref in zip(outs, refs)]
    print(f"check: {sum(same)}/{len(same)} greedy streams identical to the reference; lengths "
          f"{[len(o) for o in outs]}; first difference at {first_diff}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--full-size", action="store_true", help="random CosyVoice2-0.5B-sized model")
    p.add_argument("--model-dir", help="load real weights from an official model directory")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    p.add_argument("--prompt-len", type=int, default=200)
    p.add_argument("--max-tokens", type=int, default=100)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--max-num-batched-tokens", type=int, default=4096)
    p.add_argument("--no-graphs", action="store_true")
    p.add_argument("--compile", action="store_true", help="torch.compile the decoder layers (CUDA)")
    p.add_argument("--check", action="store_true", help="first compare greedy streams with the reference loop")
    p.add_argument("--check-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    asyncio.run(bench(args))


if __name__ == "__main__":
    main()
