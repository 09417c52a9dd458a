"""The token2wav batcher batches the flow across streams without changing any stream's audio.

Eight concurrent streams (different prompts, prompt lengths, token counts, first hops, streaming
and non-streaming, seeded and zero NSF noise, staggered starts so they end at different times)
go through the real asyncio Token2WavBatcher (max_batch 8); each must equal the same stream
rendered alone, one job at a time: flow mels within MEL_ATOL, audio within AUDIO_ATOL.
"""
from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
import torch
from conftest import next_job_upto

from async_cosyvoice.estimator import TorchEstimator
from async_cosyvoice.model_dir import build_models, load_model_dir
from async_cosyvoice.models.hift import NSFNoise
from async_cosyvoice.token2wav import (
    ChunkSchedule,
    Token2WavRunner,
    Token2WavStream,
    length_groups,
)
from async_cosyvoice.token2wav.batcher import Token2WavBatcher

torch.set_num_threads(1)

# batched vs alone. The flow differs by float summation order only (padded / batched GEMMs and convs,
# measured <= 1.2e-6 on the mel); HiFT amplifies mel differences about 10x (the NSF phase is a cumulative
# sum over thousands of samples) and its own batch-of-2 vs batch-of-1 convolutions differ by ~3e-6, so the
# emitted audio is held to 2e-5 (measured <= 1.1e-5).
MEL_ATOL = 1e-5
AUDIO_ATOL = 2e-5
SAMPLE_RATE = 24000


@pytest.fixture(scope="module")
def models(tiny_dir):
    return build_models(load_model_dir(tiny_dir))


def _arrays(golden_dir):
    mi = np.load(golden_dir / "model_inputs.npz")
    e2e = np.load(golden_dir / "e2e_stream_hop15.npz")
    t = lambda a: torch.from_numpy(np.asarray(a))  # noqa: E731
    prompts = {
        "a": (t(mi["zero_shot/flow_prompt_speech_token"]), t(mi["zero_shot/prompt_speech_feat"]),
              t(mi["zero_shot/flow_embedding"])),
        "b": (t(mi["zero_shot_zh_p16/flow_prompt_speech_token"]), t(mi["zero_shot_zh_p16/prompt_speech_feat"]),
              t(mi["zero_shot_zh_p16/flow_embedding"])),
    }
    return prompts, t(e2e["token"])[0].tolist()


def _prompt(prompts, key, start, n, emb_sign=1.0):
    tok, feat, emb = prompts[key]
    return tok[:, start:start + n], feat[:, 2 * start:2 * (start + n)], emb * emb_sign


# (prompt, prompt start, prompt tokens, emb sign, target tokens, token permutation, first hop, stream, noise seed
#  or None for zero noise, start delay s, tokens per burst)
SPECS = [
    ("a", 0, 75, 1.0, 40, 1, 15, True, 1, 0.00, 6),
    ("b", 0, 74, 1.0, 52, 7, 25, True, None, 0.00, 9),
    ("a", 10, 30, -1.0, 33, 11, 15, False, 2, 0.02, 33),
    ("b", 5, 10, 1.0, 27, 13, 10, True, 3, 0.05, 4),
    ("a", 0, 0, 1.0, 20, 17, 15, True, None, 0.00, 5),
    ("b", 20, 50, -1.0, 58, 19, 15, True, 4, 0.10, 12),
    ("a", 0, 75, -1.0, 46, 23, 15, True, None, 0.00, 6),  # shaped like the first: HiFT batches them
    ("b", 30, 40, 1.0, 45, 29, 25, True, 5, 0.01, 8),
]


def _streams(prompts, base_tokens):
    out = []
    for key, start, n, sign, n_tok, mult, hop, stream, seed, delay, burst in SPECS:
        tok, feat, emb = _prompt(prompts, key, start, n, sign)
        noise = NSFNoise.zero() if seed is None else NSFNoise.random(torch.Generator().manual_seed(seed))
        s = Token2WavStream(tok, feat, emb, stream=stream, schedule=ChunkSchedule(first_hop=hop), noise=noise)
        tokens = [(t * mult + 3 * mult) % 6561 for t in base_tokens][:n_tok]
        out.append((s, tokens, delay, burst))
    return out


class RecordingRunner(Token2WavRunner):
    """Keeps every job's flow mel, keyed by (stream index, chunk index)."""

    def __init__(self, *args, streams, **kw):
        super().__init__(*args, **kw)
        self.ids = {id(s): i for i, s in enumerate(streams)}
        self.mels = {}

    def flow_mels(self, jobs):
        mels = super().flow_mels(jobs)
        for job, mel in zip(jobs, mels):
            self.mels[(self.ids[id(job.stream)], job.index)] = mel.clone()
        return mels


class SpyEstimator(TorchEstimator):
    """The eager estimator, recording the batch of every call."""

    def __init__(self, module):
        super().__init__(module)
        self.batches = []

    def __call__(self, x, *args):
        self.batches.append(x.shape[0])
        return super().__call__(x, *args)


async def _drive(batcher, stream, tokens, delay, burst, t0):
    await asyncio.sleep(delay)
    chunks, n = [], 0
    while not stream.finished:
        n = min(len(tokens), n + burst)
        done = n == len(tokens)
        while (job := next_job_upto(stream, tokens[:n], done)) is not None:
            deadline = t0 + stream.samples_emitted / SAMPLE_RATE  # when the audio sent so far runs out
            chunks.append(await batcher.submit(job, deadline))
        await asyncio.sleep(0.001)  # the "LLM" produces the next burst
    return chunks


def test_batched_streams_equal_streams_alone(models, golden_dir):
    prompts, base = _arrays(golden_dir)

    streams = _streams(prompts, base)
    alone_runner = RecordingRunner(models.flow, models.hift, streams=[s for s, *_ in streams])
    alone = [alone_runner.render(s, toks) for s, toks, _, _ in streams]
    assert alone_runner.stats.flow_items == alone_runner.stats.flow_calls  # really one at a time

    streams = _streams(prompts, base)
    spy = SpyEstimator(models.flow.decoder.estimator)
    runner = RecordingRunner(models.flow, models.hift, estimator=spy, streams=[s for s, *_ in streams])
    batcher = Token2WavBatcher(runner, max_batch=8)

    async def main():
        t0 = time.monotonic()
        try:
            return await asyncio.gather(*(_drive(batcher, s, toks, d, b, t0) for s, toks, d, b in streams))
        finally:
            await batcher.close()

    batched = asyncio.run(main())
    st = runner.stats
    print(f"batcher {batcher.stats}; runner {st}; estimator batches {sorted(set(spy.batches))}")
    assert batcher.stats.max_batch_seen > 1
    assert max(spy.batches) > 2  # one estimator call carried several streams (2 rows each)
    assert st.flow_items > st.flow_calls
    assert st.hift_items > st.hift_calls  # equal-length chunks shared a HiFT call
    assert runner.mels.keys() == alone_runner.mels.keys()
    mel_errors = [(runner.mels[k] - alone_runner.mels[k]).abs().max().item() for k in runner.mels
                  if runner.mels[k].numel()]
    errors = []
    for ref, got in zip(alone, batched):
        assert [len(c) for c in ref] == [len(c) for c in got]
        errors.append(max((a - b).abs().max().item() for a, b in zip(ref, got) if len(a)))
    print(f"max |batched - alone|: flow mel {max(mel_errors):.1e}; audio per stream",
          " ".join(f"{e:.1e}" for e in errors))
    assert max(mel_errors) <= MEL_ATOL
    assert max(errors) <= AUDIO_ATOL


def test_length_groups():
    assert length_groups([], 1.5) == []
    assert length_groups([100, 90, 70, 60, 40], 1.5) == [[0, 1, 2], [3, 4]]
    assert length_groups([10, 10, 10], 1.0) == [[0, 1, 2]]
    assert length_groups([10, 11], 1.0) == [[1], [0]]
    assert length_groups([5] * 5, 2.0, max_size=2) == [[0, 1], [2, 3], [4]]
    lengths = [int(x) for x in np.random.default_rng(0).integers(1, 400, 50)]
    groups = length_groups(lengths, 1.25)
    assert sorted(i for g in groups for i in g) == list(range(50))
    for g in groups:
        assert max(lengths[i] for i in g) <= 1.25 * min(lengths[i] for i in g)
    with pytest.raises(ValueError):
        length_groups([1], 0.5)


def test_length_groups_split_the_flow(models, golden_dir):
    """With ratio 1 only equal lengths share a flow call; the audio is the same either way."""
    prompts, base = _arrays(golden_dir)
    outs = {}
    for ratio in (1.0, 4.0):
        runner = Token2WavRunner(models.flow, models.hift, length_bucket_ratio=ratio)
        streams = [(s, toks) for s, toks, _, _ in _streams(prompts, base)[:3]]
        jobs = [next_job_upto(s, toks, True) for s, toks in streams]
        outs[ratio] = runner.run_many(jobs)
        # streaming chunks (cached: grouped by new tokens, here all of them but the look-ahead) and
        # final calls (grouped by prompt + target tokens) never share a call
        cached = [j.streaming and not j.finalize for j in jobs]
        lengths = {(c, j.stream.prompt_token.shape[1] + j.n_tokens - 3 * c) for c, j in zip(cached, jobs)}
        assert runner.stats.flow_calls == (len(lengths) if ratio == 1.0 else len(set(cached)))
    for a, b in zip(outs[1.0], outs[4.0]):
        assert (a - b).abs().max() <= AUDIO_ATOL
