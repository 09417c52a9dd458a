"""Where the first chunk's time goes: timestamps of one request's stages (LLM first token, 18th
token, token2wav job submitted / done, chunk 0) for a few sequential streaming requests.

    python benchmarks/stage_timing.py --model-dir DIR --device cuda [--estimator compiled] [--llm-compile]
"""
from __future__ import annotations

import argparse
import asyncio
import time

import numpy as np

from async_cosyvoice.config import Config
from async_cosyvoice.tts import Audio, Mode, SynthesisOptions, SynthesisRequest, Synthesizer


async def main(args) -> None:
    config = Config.model_validate({
        "model": {"dir": str(args.model_dir), "device": args.device, "llm_dtype": args.llm_dtype,
                  "flow_dtype": args.flow_dtype},
        "engine": {"compile": args.llm_compile, "cuda_graphs": args.device.startswith("cuda")},
        "token2wav": {"estimator": args.estimator}, "speakers": {"dir": "/tmp/stage_timing_spk"}})
    synth = await Synthesizer.create(config)
    t = np.arange(6 * 24000) / 24000
    wav = (0.3 * np.sin(2 * np.pi * 150 * t) * (1 + np.sin(2 * np.pi * 3 * t))).astype(np.float32)
    await synth.register_speaker("timing", "A six second prompt for timing.", Audio(wav, 24000), overwrite=True)
    marks: dict[str, float] = {}
    t0 = 0.0
    generate, submit = synth.engine.generate, synth.batcher.submit

    async def timed_generate(req):
        n = 0
        async for batch in generate(req):
            n += len(batch)
            marks.setdefault("first_token", time.monotonic() - t0)
            if n >= 18:
                marks.setdefault("token_18", time.monotonic() - t0)
            yield batch

    async def timed_submit(job, deadline):
        marks.setdefault("job_submitted", time.monotonic() - t0)
        out = await submit(job, deadline)
        marks.setdefault("job_done", time.monotonic() - t0)
        return out

    runner = synth.batcher.runner
    run_many, flow_mels, hift = runner.run_many, runner.flow_mels, runner.hift.inference

    def synced(name, fn):
        def wrapped(*a, **kw):
            marks.setdefault(name + "_start", time.monotonic() - t0)
            out = fn(*a, **kw)
            if args.device.startswith("cuda"):
                import torch
                torch.cuda.synchronize()
            marks.setdefault(name + "_end", time.monotonic() - t0)
            return out
        return wrapped

    runner.run_many, runner.flow_mels = synced("run_many", run_many), synced("flow", flow_mels)
    runner.hift.inference = synced("hift", hift)
    synth.engine.generate, synth.batcher.submit = timed_generate, timed_submit
    text = "This is a sentence of moderate length that the benchmark speaks many times over."
    for i in range(args.requests):
        marks.clear()
        t0 = time.monotonic()
        request = SynthesisRequest(Mode.ZERO_SHOT_BY_SPK_ID, text=text, speaker_id="timing",
                                   options=SynthesisOptions(stream=True, seed=i, max_tokens=args.tokens))
        async for chunk in synth.synthesize(request):
            if chunk.index == 0:
                marks["chunk_0"] = time.monotonic() - t0
            if chunk.index == 1:
                marks["chunk_1"] = time.monotonic() - t0
        print("request", i, {k: round(v * 1000, 1) for k, v in marks.items()}, "ms", flush=True)
    await synth.close()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--llm-dtype", default="bfloat16")
    ap.add_argument("--flow-dtype", default="float16")
    ap.add_argument("--estimator", default="torch")
    ap.add_argument("--llm-compile", action="store_true")
    ap.add_argument("--requests", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=120)
    asyncio.run(main(ap.parse_args()))
