"""Time to the first 15 speech tokens when the text arrives at an LLM's pace: bistream vs sentence.

Text arrives in pieces of 5 tokens every 100 ms (a chat LLM's pace). Measured at the engine level
(native engine, no token2wav) from the arrival of the first text piece to the 15th speech token
handed to the caller:
- bistream: `generate_bistream` is fed the pieces as they arrive;
- sentence: the request starts once the whole sentence has arrived (what sentence pipelining
  does), as a plain `generate` with upstream's length rules.
Runs `--streams` such utterances at once, `--repeats` times; prints medians and p90 over all.

  python benchmarks/bistream_latency.py                       # CPU, tiny random model
  python benchmarks/bistream_latency.py --model-dir DIR       # real weights
  python benchmarks/bistream_latency.py --full-size --streams 1 --repeats 2
"""
from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time

import torch

from async_cosyvoice.engine.base import BistreamRequest, GenerationRequest
from async_cosyvoice.engine.native import NativeEngine, NativeEngineConfig
from async_cosyvoice.models.dims import EOS2_TOKEN, SPEECH_TOKEN_SIZE, LMDims, Qwen2Dims, RASParams
from async_cosyvoice.models.llm import CosyVoice2LM

TINY = LMDims(qwen=Qwen2Dims(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                             vocab_size=1024), llm_input_size=64, llm_output_size=64)
FIRST = 15  # speech tokens: the first token2wav hop


def build_model(args) -> CosyVoice2LM:
    if args.model_dir:
        from async_cosyvoice.model_dir import load_model_dir, load_strict
        md = load_model_dir(args.model_dir)
        model = CosyVoice2LM(md.dims.lm)
        load_strict(model, md.llm_state_dict(), "llm.pt")
        return model
    torch.manual_seed(0)
    model = CosyVoice2LM(LMDims() if args.full_size else TINY)
    with torch.no_grad():  # random weights would now and then sample 6562, which upstream's bistream loop rejects
        model.llm_decoder.bias[EOS2_TOKEN] = -1e4
    return model


async def text_pieces(tokens: list[int], piece: int, interval: float, t0: float):
    """Piece k is handed over at t0 + k * interval."""
    for k in range(0, len(tokens), piece):
        delay = t0 + (k // piece) * interval - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        yield tokens[k:k + piece]


async def first_tokens(engine: NativeEngine, stream, t0: float, step0: int) -> tuple[float, int]:
    """(seconds, engine steps) from t0 to the FIRST-th token."""
    got = 0
    async for tokens in stream:
        got += len(tokens)
        if got >= FIRST:
            return time.perf_counter() - t0, engine.num_steps - step0
    raise RuntimeError(f"the stream ended after {got} tokens, before {FIRST}")


async def one_utterance(engine: NativeEngine, mode: str, rid: str, prompt_text, prompt_speech, text,
                        args) -> tuple[float, int]:
    t0, step0 = time.perf_counter(), engine.num_steps
    if mode == "bistream":
        req = BistreamRequest(rid, prompt_text, prompt_speech, max_tokens=FIRST, ras=RASParams(), seed=1)
        stream = engine.generate_bistream(req, text_pieces(text, args.piece, args.interval, t0))
        return await first_tokens(engine, stream, t0, step0)
    async for _ in text_pieces(text, args.piece, args.interval, t0):
        pass  # the sentence is complete when its last piece has arrived
    # stop ids masked: a random model may draw one early; the first 15 tokens cost the same
    req = GenerationRequest(rid, tuple(prompt_text) + tuple(text), prompt_speech, min_tokens=FIRST,
                            max_tokens=FIRST, ras=RASParams(), seed=1, ignore_stop_tokens=True)
    return await first_tokens(engine, engine.generate(req), t0, step0)


async def main(args) -> None:
    model = build_model(args)
    engine = NativeEngine(model, NativeEngineConfig(max_num_seqs=max(8, args.streams), max_model_len=1024,
                                                    max_num_batched_tokens=2048, device=args.device,
                                                    dtype=args.dtype, seed=0))
    vocab = model.dims.qwen.vocab_size
    rng = random.Random(0)
    prompt_text = tuple(rng.randrange(vocab) for _ in range(args.prompt_text))
    prompt_speech = tuple(rng.randrange(SPEECH_TOKEN_SIZE) for _ in range(args.prompt_speech))
    text = [rng.randrange(vocab) for _ in range(args.text)]
    await engine.start()
    try:
        await one_utterance(engine, "bistream", "warm-b", prompt_text, prompt_speech, text, args)
        await one_utterance(engine, "sentence", "warm-s", prompt_text, prompt_speech, text, args)
        results: dict[str, list[tuple[float, int]]] = {"bistream": [], "sentence": []}
        for rep in range(args.repeats):
            for mode in results:
                times = await asyncio.gather(*(one_utterance(engine, mode, f"{mode}-{rep}-{i}", prompt_text,
                                                             prompt_speech, text, args)
                                               for i in range(args.streams)))
                results[mode] += times
    finally:
        await engine.stop()
    arrive = (len(text) + args.piece - 1) // args.piece * args.interval - args.interval
    print(f"model {'model-dir' if args.model_dir else 'full-size random' if args.full_size else 'tiny random'}, "
          f"{args.device} {args.dtype}, {torch.get_num_threads()} threads; prompt text {args.prompt_text} + speech "
          f"{args.prompt_speech} tokens; sentence of {args.text} text tokens, {args.piece} tokens every "
          f"{args.interval * 1000:.0f} ms (last piece at {arrive * 1000:.0f} ms); {args.streams} streams x "
          f"{args.repeats} repeats")
    medians = {}
    for mode, res in results.items():
        times = sorted(t for t, _ in res)
        p90 = times[min(len(times) - 1, int(0.9 * len(times)))]
        medians[mode] = statistics.median(times)
        print(f"  {mode:9s} first {FIRST} speech tokens after the first text piece: median "
              f"{medians[mode] * 1000:7.1f} ms   p90 {p90 * 1000:7.1f} ms   "
              f"(engine steps meanwhile: median {statistics.median(n for _, n in res):.0f})")
    ratio = medians["sentence"] / medians["bistream"]
    print(f"  sentence / bistream (medians): {ratio:.1f}x")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir")
    p.add_argument("--full-size", action="store_true", help="random weights at the CosyVoice2-0.5B shape")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--prompt-text", type=int, default=20, help="prompt transcript tokens")
    p.add_argument("--prompt-speech", type=int, default=75, help="prompt speech tokens (3 s)")
    p.add_argument("--text", type=int, default=40, help="target sentence tokens")
    p.add_argument("--piece", type=int, default=5, help="text tokens per piece")
    p.add_argument("--interval", type=float, default=0.1, help="seconds between pieces")
    p.add_argument("--streams", type=int, default=1)
    p.add_argument("--repeats", type=int, default=5)
    asyncio.run(main(p.parse_args()))
