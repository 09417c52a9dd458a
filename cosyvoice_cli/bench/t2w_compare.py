"""token2wav alone: C streams of random speech tokens on the streaming chunk schedule, batched vs
one job at a time, in the same run."""
from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Sequence

import numpy as np

from .metrics import RequestResult, summarize_level
from .progress import Progress

if TYPE_CHECKING:
    from async_cosyvoice.token2wav.batcher import Token2WavBatcher
    from async_cosyvoice.tts import Synthesizer


def _t2w_schedule(synth: "Synthesizer", first_hop: int | None):
    """The chunk schedule `Synthesizer` uses for a streamed request."""
    from async_cosyvoice.token2wav import ChunkSchedule

    dims = synth.dims
    return ChunkSchedule(first_hop=first_hop or synth.config.token2wav.first_hop,
                         max_hop_multiple=synth.config.token2wav.max_hop_multiple, prompt_align=1,
                         pre_lookahead=dims.flow.pre_lookahead_len, token_mel_ratio=dims.token_mel_ratio,
                         samples_per_frame=dims.hift.samples_per_frame)


async def _t2w_round(synth: "Synthesizer", batcher, voice, token_lists: Sequence[np.ndarray], schedule,
                     seed: int) -> dict:
    import torch

    prompt_token = torch.from_numpy(np.array(voice.flow_prompt_speech_token, np.int32)).reshape(1, -1)
    prompt_feat = torch.from_numpy(np.array(voice.prompt_speech_feat, np.float32))[None]
    embedding = torch.from_numpy(np.array(voice.flow_embedding, np.float32)).reshape(1, -1)
    rate = synth.sample_rate
    t0 = time.monotonic()

    async def render(i: int, tokens: np.ndarray) -> RequestResult:
        stream = batcher.open_stream(prompt_token, prompt_feat, embedding, seed=seed + i, segment=0, stream=True,
                                     schedule=schedule)
        stream.append(tokens)
        start = time.monotonic()
        result = RequestResult(index=i, seed=seed + i, start_s=start - t0, total_s=0.0)
        first_at, samples = None, 0
        while (job := stream.next_job(llm_done=True)) is not None:
            deadline = time.monotonic() if first_at is None else first_at + samples / rate
            out = await batcher.submit(job, deadline)
            now = time.monotonic()
            first_at = now if first_at is None else first_at
            samples += int(out.numel())
            if out.numel():
                result.arrivals_s.append(now - start)
                result.chunk_audio_s.append(out.numel() / rate)
        result.total_s = time.monotonic() - start
        return result

    results = await asyncio.gather(*(render(i, t) for i, t in enumerate(token_lists)))
    wall = time.monotonic() - t0
    level = summarize_level(len(token_lists), results, wall, detail=False)
    level["batcher"] = _batcher_stats(batcher)
    return level


def _batcher_stats(batcher: "Token2WavBatcher") -> dict:
    st = batcher.stage_stats
    return {"batches": st.calls, "jobs": st.items, "busy_s": st.busy_s,
            "mean_batch": st.items / st.calls if st.calls else None,
            "max_batch_seen": batcher.stats.max_batch_seen, "first_lane_batches": batcher.stats.first_lane_batches}


async def token2wav_compare(synth: "Synthesizer", concurrency: int, tokens: int, speaker_id: str, *,
                            seed: int = 0, first_hop: int | None = None, max_batch: int | None = None,
                            warmup: bool = True, progress: Progress | None = None,
                            target_speedup: float = 8.0) -> dict:
    """The token2wav stage alone at `concurrency` streams of `tokens` random speech tokens each
    (prompt: the registered speaker's), batched vs one job at a time, in this run.

    Both modes use the synthesizer's own Token2WavRunner through a fresh Token2WavBatcher; the
    synthesizer must be idle meanwhile. Throughput = audio seconds rendered / wall seconds."""
    from async_cosyvoice.frontend.model_input import build_model_input
    from async_cosyvoice.request import Mode
    from async_cosyvoice.token2wav.batcher import Token2WavBatcher

    record = synth.speakers.get(speaker_id)
    voice = build_model_input(Mode.ZERO_SHOT_BY_SPK_ID, record.voice, text_tokens=(0,))
    rng = np.random.default_rng(seed)
    vocab = synth.dims.flow.vocab_size
    token_lists = [rng.integers(0, vocab, tokens, dtype=np.int64) for _ in range(concurrency)]
    schedule = _t2w_schedule(synth, first_hop)
    runner = synth.batcher.runner
    batch_size = max_batch or max(concurrency, synth.config.token2wav.max_batch)
    modes = {"batched": dict(max_batch=batch_size, batching=True), "sequential": dict(max_batch=1, batching=False)}
    out: dict = {"concurrency": concurrency, "tokens": tokens, "prompt_tokens": record.voice.n_tokens,
                 "first_hop": schedule.first_hop, "max_batch": batch_size}
    warm_tokens = schedule.first_hop + schedule.pre_lookahead + 2 * schedule.first_hop
    # in the synthesizer's batcher's capture thread (one capture at a time): what the sweep before
    # wanted, captured before anything is timed
    await synth.batcher.capture_all_wanted()
    for name, kwargs in modes.items():
        if warmup:  # a throw-away batcher: first calls of each shape allocate and tune
            if progress:
                progress.note(f"token2wav {name}: warm-up")
            batcher = Token2WavBatcher(runner, **kwargs)  # never serve_captures: captured below
            try:
                await _t2w_round(synth, batcher, voice, [t[:warm_tokens] for t in token_lists], schedule, seed)
            finally:
                await batcher.close()
            # the shapes it met, captured now: the timed round replays them
            await synth.batcher.capture_all_wanted()
        if progress:
            progress.note(f"token2wav {name}: {concurrency} streams x {tokens} tokens")
        batcher = Token2WavBatcher(runner, **kwargs)  # never serve_captures: it captures nothing while timed
        try:
            out[name] = await _t2w_round(synth, batcher, voice, token_lists, schedule, seed)
        finally:
            await batcher.close()
        if progress:
            progress.note(f"token2wav {name}: {out[name]['audio_s_per_s']:.2f} audio s/s, "
                          f"wall {out[name]['wall_s']:.2f} s")
    b, s = out["batched"]["audio_s_per_s"], out["sequential"]["audio_s_per_s"]
    out["speedup"] = b / s if b and s else None
    out["target_speedup"] = target_speedup
    out["met"] = out["speedup"] is not None and out["speedup"] >= target_speedup
    return out
