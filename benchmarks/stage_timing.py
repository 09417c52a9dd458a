"""Where the first chunk's time goes, for a few sequential streaming requests: when its token2wav
job was submitted (the LLM had the first hop's tokens), how long it waited, how long its batch
kept the device thread busy, and when chunks 0 and 1 reached the caller. Read from the token2wav
batcher's own timeline; nothing is wrapped or patched.

    python benchmarks/stage_timing.py --model-dir DIR --device cuda [--estimator compiled] [--llm-compile]
"""
from __future__ import annotations

import argparse
import asyncio
import time

import numpy as np

from async_cosyvoice.config import Config
from async_cosyvoice.request import Audio, Mode, SynthesisOptions, SynthesisRequest
from async_cosyvoice.tts import Synthesizer


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
    text = "This is a sentence of moderate length that the benchmark speaks many times over."
    for i in range(args.requests):
        marks: dict[str, float] = {}
        t0 = time.monotonic()
        request = SynthesisRequest(Mode.ZERO_SHOT_BY_SPK_ID, text=text, speaker_id="timing",
                                   options=SynthesisOptions(stream=True, seed=i, max_tokens=args.tokens))
        async for chunk in synth.synthesize(request):
            if chunk.index in (0, 1):
                marks[f"chunk_{chunk.index}"] = time.monotonic() - t0
        # one request at a time: its chunk 0 is the first chunk-0 job of a batch started after t0
        batch, job = next((b, j) for b in synth.batcher.stats.timeline if b.started >= t0 for j in b.jobs
                          if j.chunk == 0)
        marks.update(job_submitted=batch.started - job.queued_s - t0, job_start=batch.started - t0,
                     job_done=batch.started + batch.busy_s - t0)
        print("request", i, {k: round(v * 1000, 1) for k, v in sorted(marks.items(), key=lambda kv: kv[1])}, "ms",
              flush=True)
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
