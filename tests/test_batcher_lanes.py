"""Head-of-line blocking in the token2wav batcher, checked on ORDER (the batcher's own timeline),
not on time: the real runner on the tiny model, real asyncio, no stand-ins.

- a first chunk submitted while a long queue of later chunks waits (all of them more urgent by
  deadline) runs in the next batch, ahead of the queue;
- first-lane batches never run back to back while other jobs wait (no starvation);
- `max_batch_tokens` splits a long render into batches of bounded flow work.
"""
from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
import torch
from conftest import next_job_upto

from async_cosyvoice.config import Config
from async_cosyvoice.model_dir import build_models, load_model_dir
from async_cosyvoice.models.hift import NSFNoise
from async_cosyvoice.token2wav import ChunkSchedule, Token2WavRunner, Token2WavStream
from async_cosyvoice.token2wav.batcher import FIRST_LANE, Token2WavBatcher
from async_cosyvoice.token2wav.stage import token2wav_batcher

torch.set_num_threads(1)

N_STREAMS = 8
HOP = 10
PROMPT_TOKENS = 20


@pytest.fixture(scope="module")
def runner(tiny_dir):
    models = build_models(load_model_dir(tiny_dir))
    return Token2WavRunner(models.flow, models.hift)


@pytest.fixture(scope="module")
def prompt(golden_dir):
    mi = np.load(golden_dir / "model_inputs.npz")
    tok = torch.from_numpy(mi["zero_shot/flow_prompt_speech_token"])[:, :PROMPT_TOKENS]
    feat = torch.from_numpy(mi["zero_shot/prompt_speech_feat"])[:, :2 * PROMPT_TOKENS]
    return tok, feat, torch.from_numpy(mi["zero_shot/flow_embedding"])


def new_stream(prompt) -> Token2WavStream:
    tok, feat, emb = prompt
    return Token2WavStream(tok, feat, emb, schedule=ChunkSchedule(first_hop=HOP, max_hop_multiple=1, prompt_align=1),
                           noise=NSFNoise.zero())


TOKENS = [(7 * i + 11) % 6561 for i in range(200)]


def test_first_chunk_jumps_a_queue_of_later_chunks(runner, prompt):
    async def scenario():
        batcher = Token2WavBatcher(runner, max_batch=2)
        try:
            streams = [new_stream(prompt) for _ in range(N_STREAMS)]
            await asyncio.gather(*(batcher.submit(next_job_upto(s, TOKENS, False), time.monotonic()) for s in streams))
            # every stream's second chunk, all overdue (deadline in the past): by deadline alone a
            # new first chunk (due now) would run after all of them
            later = [asyncio.ensure_future(batcher.submit(next_job_upto(s, TOKENS, False), 0.0)) for s in streams]
            await asyncio.wait(later, return_when=asyncio.FIRST_COMPLETED)  # the queue is being served
            queued_before = batcher.pending
            newcomer = new_stream(prompt)
            samples = await batcher.submit(next_job_upto(newcomer, TOKENS, False), time.monotonic())
            await asyncio.gather(*later)
            return batcher, newcomer, samples, queued_before
        finally:
            await batcher.close()

    batcher, newcomer, samples, queued_before = asyncio.run(scenario())
    assert samples.numel() > 0 and newcomer.chunks_done == 1
    timeline = list(batcher.stats.timeline)
    assert [b.index for b in timeline] == list(range(len(timeline)))
    (first_batch, first_job), = [(b, j) for b in timeline for j in b.jobs if j.stream == id(newcomer)]
    later_jobs = [(b, j) for b in timeline for j in b.jobs if j.chunk == 1]
    assert len(later_jobs) == N_STREAMS
    # submitted while batches of the queue were running or waiting: it ran in the next batch taken
    assert queued_before >= 2
    assert first_batch.index == first_job.after_batch and first_batch.lane == FIRST_LANE
    overtaken = [j for b, j in later_jobs if j.seq < first_job.seq and b.index > first_batch.index]
    assert len(overtaken) >= 2, [(b.index, j) for b, j in later_jobs]
    print(f"first chunk ran in batch {first_batch.index} (submitted after {first_job.after_batch} had started), "
          f"ahead of {len(overtaken)} earlier-submitted overdue chunks; lanes "
          + "".join("F" if b.lane == FIRST_LANE else "m" for b in timeline))
    # the counters the benchmark and Prometheus read
    st = batcher.stage_stats
    assert st.calls == len(timeline) and st.items == 2 * N_STREAMS + 1 and st.failed == 0
    assert st.busy_s == pytest.approx(sum(b.busy_s for b in timeline))
    assert batcher.stats.first_lane_batches == sum(b.lane == FIRST_LANE for b in timeline)


def test_first_lane_does_not_starve_playing_streams(runner, prompt):
    """First chunks keep arriving while later chunks wait: lanes alternate."""
    async def scenario():
        batcher = Token2WavBatcher(runner, max_batch=1)
        try:
            playing = new_stream(prompt)
            await batcher.submit(next_job_upto(playing, TOKENS, False), time.monotonic())
            newcomers = [new_stream(prompt) for _ in range(4)]
            jobs = [batcher.submit(next_job_upto(playing, TOKENS, False), 0.0)]
            jobs += [batcher.submit(next_job_upto(s, TOKENS, False), time.monotonic()) for s in newcomers]
            await asyncio.gather(*jobs)
            return batcher, playing
        finally:
            await batcher.close()

    batcher, playing = asyncio.run(scenario())
    timeline = list(batcher.stats.timeline)
    (chunk1,) = [b for b in timeline if b.jobs[0].stream == id(playing) and b.jobs[0].chunk == 1]
    # one batch at most of the burst of four first chunks runs before it, not all four
    assert chunk1.index <= 2, [(b.index, b.lane) for b in timeline]
    lanes = [b.lane for b in timeline]
    assert not any(a == b == FIRST_LANE for a, b in zip(lanes[1:chunk1.index + 1], lanes[2:chunk1.index + 1]))


def test_max_batch_tokens_bounds_each_batch(runner, prompt):
    budget = 2 * (PROMPT_TOKENS + HOP + 3)  # room for two first chunks

    async def scenario():
        batcher = Token2WavBatcher(runner, max_batch=8, max_batch_tokens=budget)
        try:
            streams = [new_stream(prompt) for _ in range(5)]
            await asyncio.gather(*(batcher.submit(next_job_upto(s, TOKENS, False), time.monotonic()) for s in streams))
            return batcher
        finally:
            await batcher.close()

    batcher = asyncio.run(scenario())
    sizes = [len(b.jobs) for b in batcher.stats.timeline]
    assert sum(sizes) == 5 and max(sizes) == 2, sizes
    assert all(b.flow_positions <= budget for b in batcher.stats.timeline)
    assert all(b.flow_positions == sum(PROMPT_TOKENS + HOP + 3 for _ in b.jobs) for b in batcher.stats.timeline)
    with pytest.raises(ValueError):
        Token2WavBatcher(runner, max_batch_tokens=0)


def test_max_batch_tokens_comes_from_the_config(model_dir):
    models = build_models(model_dir, device="cpu", with_llm=False)
    bounded = Config.model_validate({"token2wav": {"max_batch_tokens": 900}})
    assert token2wav_batcher(bounded, models, model_dir).max_batch_tokens == 900
    assert token2wav_batcher(Config(), models, model_dir).max_batch_tokens is None  # the default: no bound
