"""First audio when the text arrives at an LLM's pace: bistream vs sentence mode, end to end.

A 3-sentence reply arrives as pieces of 5 text tokens every 100 ms (a chat LLM's pace: the
model's tokenizer cuts the text into tokens, each group of 5 is decoded back to a piece, so
pieces may end inside a word as LLM output does). Each stream goes through the whole
Synthesizer (`synthesize_stream`: LM engine, token2wav, streaming chunks), with a registered
zero-shot speaker. Measured per stream, from the moment the first text piece is handed over:
- first audio: until the first chunk with audio;
- after text: from the last piece to the final chunk (what the end of the reply waits for);
- audio seconds and speech tokens.
Phases: (1) latency: one stream at a time, `--repeats` times per mode (modes alternate);
(2) throughput: `--streams` streams at once per mode (bistream first), all at the same pace:
audio seconds per wall second and the first-audio distribution under load.
Prints a table; the JSON goes to `--out` (default $OUT/bistream_latency.json, else stdout only).

  python benchmarks/bistream_latency.py                                          # CPU, tiny random model
  python benchmarks/bistream_latency.py --random-preset cosyvoice2-0.5b --device cuda   # ~2-3 min on an H200
  python benchmarks/bistream_latency.py --model-dir DIR --device cuda             # real weights
  python benchmarks/bistream_latency.py --random-preset cosyvoice2-0.5b --device cuda --config configs/gpu.yaml

Random presets push the LM's 6562 logit down (make_random_model, GENERATOR_VERSION 3): upstream's
bistream loop raises when the LM samples 6562, which real weights practically never do.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import yaml

from async_cosyvoice.config import Config
from async_cosyvoice.frontend.sentences import SentenceSplitter
from async_cosyvoice.random_model import make_random_model
from async_cosyvoice.request import Mode, SynthesisOptions, SynthesisRequest
from async_cosyvoice.tts import Synthesizer
from cosyvoice_cli import bench

# a voice agent's reply: three sentences of 20-30 words, as a chat LLM writes them
SENTENCES = ("The next train to the airport leaves from platform four at a quarter past nine, and on most days "
             "it arrives a little after ten.",
             "If you would rather not change trains, the express bus from the main square takes about the same "
             "time and costs a little less.",
             "Would you like me to book a seat on one of them for you?")
SPEAKER = "bistream-bench"
MODES = ("bistream", "sentence")


@dataclass
class StreamResult:
    mode: str
    first_audio_s: float | None  # first text piece -> first chunk with audio
    after_text_s: float | None   # last text piece -> final chunk
    total_s: float
    audio_s: float
    speech_tokens: int
    error: str | None = None


def text_pieces(synth: Synthesizer, text: str, piece_tokens: int) -> list[str]:
    """The text cut as an LLM streams it: groups of `piece_tokens` tokens, decoded back to text."""
    ids = synth.tokenizer.encode(text)
    pieces = [synth.tokenizer.decode(ids[i:i + piece_tokens]) for i in range(0, len(ids), piece_tokens)]
    if "".join(pieces) != text:
        raise RuntimeError("the tokenizer does not decode the reply back to itself; choose another text")
    return pieces


def first_sentence_piece(pieces: list[str]) -> int:
    """Index of the piece that completes the first sentence (sentence mode can start after it)."""
    splitter = SentenceSplitter()
    return next((k for k, piece in enumerate(pieces) if splitter.feed(piece)), len(pieces) - 1)


async def one_stream(synth: Synthesizer, mode: str, pieces: list[str], interval: float, seed: int,
                     max_tokens: int | None) -> StreamResult:
    t0 = time.perf_counter()
    last_piece = [t0]

    async def paced():
        for k, piece in enumerate(pieces):
            delay = t0 + k * interval - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            last_piece[0] = time.perf_counter()
            yield piece

    request = SynthesisRequest(Mode.ZERO_SHOT_BY_SPK_ID, speaker_id=SPEAKER,
                               options=SynthesisOptions(stream=True, seed=seed, max_tokens=max_tokens))
    first = None
    audio = 0.0
    tokens = 0
    try:
        async with contextlib.aclosing(synth.synthesize_stream(paced(), request, text_mode=mode)) as chunks:
            async for chunk in chunks:
                if first is None and len(chunk.samples):
                    first = time.perf_counter() - t0
                audio += len(chunk.samples) / chunk.sample_rate
                if chunk.is_final:
                    tokens = int(chunk.n_tokens)
    except Exception as e:  # noqa: BLE001 - counted and shown; the other streams go on
        return StreamResult(mode, first, None, time.perf_counter() - t0, audio, tokens, f"{type(e).__name__}: {e}")
    end = time.perf_counter()
    return StreamResult(mode, first, end - last_piece[0], end - t0, audio, tokens)


def summary(results: list[StreamResult], wall_s: float | None = None) -> dict:
    ok = [r for r in results if r.error is None]
    out = {"streams": len(results), "errors": len(results) - len(ok),
           "first_audio_s": bench.summarize(r.first_audio_s for r in ok),
           "after_text_s": bench.summarize(r.after_text_s for r in ok),
           "audio_s_mean": statistics.fmean(r.audio_s for r in ok) if ok else None,
           "speech_tokens_mean": statistics.fmean(r.speech_tokens for r in ok) if ok else None,
           "error_examples": sorted({r.error for r in results if r.error})[:3]}
    if wall_s is not None:
        out["wall_s"] = wall_s
        out["audio_s_per_s"] = sum(r.audio_s for r in ok) / wall_s
    return out


def build_config(args, model_dir: Path, speakers_dir: str) -> Config:
    """h200_bench's settings (built-in engine with CUDA graphs, bf16 LM on cuda, eager flow; the
    flow cache off on cuda as in configs/gpu.yaml), or `--config FILE` as the base."""
    cuda = args.device.startswith("cuda")
    data = {"engine": {"kind": "native", "cuda_graphs": cuda},
            "token2wav": {"batching": True, "flow_cache": not cuda}}
    if args.config:
        data = yaml.safe_load(args.config.read_text(encoding="utf-8")) or {}
    data.setdefault("model", {}).update(dir=str(model_dir), device=args.device)
    if args.llm_dtype or not args.config:
        data["model"]["llm_dtype"] = args.llm_dtype or ("bfloat16" if cuda else "float32")
    engine = data.setdefault("engine", {})
    engine["max_num_seqs"] = max(engine.get("max_num_seqs", 0), 16, 2 * args.streams)
    engine["max_model_len"] = max(engine.get("max_model_len", 0), 2048)
    data["speakers"] = {"dir": speakers_dir}
    data.setdefault("limits", {})["max_concurrent_streams"] = max(64, 2 * args.streams)
    return Config.model_validate(data)


def model_dir_for(args) -> Path:
    """--model-dir, else a random preset written once under /tmp (the path h200_bench.py uses, so
    the two share it)."""
    if args.model_dir:
        return Path(args.model_dir)
    path = Path(tempfile.gettempdir()) / "async_cosyvoice_bench" / f"{args.random_preset}-seed{args.seed}"
    return make_random_model(args.random_preset, path, seed=args.seed)


async def measure(args) -> dict:
    t_start = time.perf_counter()
    model_dir = model_dir_for(args)
    t_model = time.perf_counter() - t_start
    with tempfile.TemporaryDirectory(prefix="bistream-bench-spk-") as spk:
        synth = await Synthesizer.create(build_config(args, model_dir, spk), warmup=True)
        try:
            spec = bench.SpeakerSpec(speaker_id=SPEAKER, prompt_seconds=args.prompt_seconds, seed=args.seed)
            prompt_tokens = await bench.register_in_process(synth, spec)
            reply = " ".join(SENTENCES[:args.sentences])
            pieces = text_pieces(synth, reply, args.piece_tokens)
            t_ready = time.perf_counter() - t_start
            for mode in MODES:  # untimed: first-touch costs of both paths
                await one_stream(synth, mode, pieces, 0.0, seed=999, max_tokens=None)
            latency: dict[str, list[StreamResult]] = {m: [] for m in MODES}
            for rep in range(args.repeats):
                for mode in MODES:
                    latency[mode].append(await one_stream(synth, mode, pieces, args.interval, seed=rep,
                                                          max_tokens=None))
            throughput = {}
            for mode in [m for m in args.throughput_modes.split(",") if m] if args.streams else ():
                t = time.perf_counter()
                results = await asyncio.gather(*(one_stream(synth, mode, pieces, args.interval, seed=100 + i,
                                                            max_tokens=args.throughput_max_tokens)
                                                 for i in range(args.streams)))
                throughput[mode] = summary(list(results), time.perf_counter() - t)
        finally:
            await synth.close()
    return {
        "meta": {"script": "benchmarks/bistream_latency.py", "argv": sys.argv[1:], "model_dir": str(model_dir),
                 "random_preset": None if args.model_dir else args.random_preset, "device": args.device,
                 "environment": bench.environment(args.device), "reply": reply, "pieces": len(pieces),
                 "text_tokens": len(synth.tokenizer.encode(reply)), "piece_tokens": args.piece_tokens,
                 "interval_s": args.interval, "last_piece_at_s": (len(pieces) - 1) * args.interval,
                 "first_sentence_at_s": first_sentence_piece(pieces) * args.interval,
                 "prompt_speech_tokens": prompt_tokens, "throughput_max_tokens": args.throughput_max_tokens,
                 "model_s": t_model, "ready_s": t_ready, "total_s": time.perf_counter() - t_start},
        "latency": {m: summary(r) for m, r in latency.items()},
        "latency_runs": {m: [asdict(x) for x in r] for m, r in latency.items()},
        "throughput": throughput,
    }


def _ms(x) -> str:
    return "-" if x is None else f"{1000 * x:.0f}"


def table(results: dict) -> str:
    m = results["meta"]
    lines = [f"{m['device']}, {m['random_preset'] or m['model_dir']}; reply of {m['text_tokens']} text tokens in "
             f"{m['pieces']} pieces of {m['piece_tokens']}, one per {1000 * m['interval_s']:.0f} ms (first sentence "
             f"complete at {1000 * m['first_sentence_at_s']:.0f} ms, last piece at "
             f"{1000 * m['last_piece_at_s']:.0f} ms); prompt {m['prompt_speech_tokens']} speech tokens"
             + (f"; throughput max_tokens {m['throughput_max_tokens']}" if m["throughput_max_tokens"] else ""),
             "", (f"{'phase':<18}{'mode':<10}{'first audio p50':>16}{'p90':>7}{'after text p50':>16}"
                  f"{'audio s':>9}{'audio s/s':>10}{'errors':>8}")]
    for key in ("latency", "throughput"):
        for mode, s in results[key].items():
            label = "1 at a time" if key == "latency" else f"{s['streams']} at once"
            lines.append(f"{label:<18}{mode:<10}{_ms(s['first_audio_s']['p50']):>13} ms{_ms(s['first_audio_s']['p90']):>7}"
                         f"{_ms(s['after_text_s']['p50']):>13} ms{(s['audio_s_mean'] or 0):>9.2f}"
                         f"{s.get('audio_s_per_s', float('nan')):>10.2f}{s['errors']:>8}")
    lat = results["latency"]
    if lat["bistream"]["first_audio_s"]["p50"] and lat["sentence"]["first_audio_s"]["p50"]:
        lines.append(f"\nfirst audio, sentence / bistream (medians, 1 stream): "
                     f"{lat['sentence']['first_audio_s']['p50'] / lat['bistream']['first_audio_s']['p50']:.1f}x")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model-dir", help="an official CosyVoice2 directory (real weights)")
    src.add_argument("--random-preset", default="tiny", help="random model preset: tiny, cosyvoice2-0.5b")
    p.add_argument("--device", default="cpu")
    p.add_argument("--config", type=Path, help="a server config YAML as the base (e.g. configs/gpu.yaml); "
                                              "model dir, device, speakers and stream limits are set here")
    p.add_argument("--llm-dtype", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prompt-seconds", type=float, default=3.0, help="the speaker's prompt (25 tokens/s)")
    p.add_argument("--sentences", type=int, default=3, choices=[1, 2, 3], help="sentences of the reply")
    p.add_argument("--piece-tokens", type=int, default=5, help="text tokens per piece")
    p.add_argument("--interval", type=float, default=0.1, help="seconds between pieces")
    p.add_argument("--repeats", type=int, default=5, help="latency phase: streams per mode, one at a time")
    p.add_argument("--streams", type=int, default=32, help="throughput phase: streams at once per mode (0: skip)")
    p.add_argument("--throughput-modes", default="bistream,sentence", help="modes of the throughput phase")
    p.add_argument("--throughput-max-tokens", type=int,
                   help="throughput phase: bound the speech tokens (bistream: per stream, so the stream stops "
                        "early; sentence: forced per sentence); default: the model decides")
    p.add_argument("--out", type=Path, help="JSON file (default $OUT/bistream_latency.json when $OUT is set)")
    args = p.parse_args(argv)
    results = asyncio.run(measure(args))
    out = args.out or (Path(os.environ["OUT"]) / "bistream_latency.json" if os.environ.get("OUT") else None)
    text = json.dumps(results, indent=1)
    print(text)
    print(table(results))
    if out:
        if out.is_dir():
            out = out / "bistream_latency.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n", encoding="utf-8")
    return 1 if any(s["errors"] for k in ("latency", "throughput") for s in results[k].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
