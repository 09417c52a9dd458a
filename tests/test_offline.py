"""The offline path renders non-streaming utterances in padded batches without changing any of them.

Utterances of different lengths (both fixture prompts, cut to different lengths, target lengths
18-60 tokens, speeds 0.8-1.25, seeded and zero NSF noise) rendered together (`render_offline`,
and through the real asyncio collector of a Token2WavBatcher) must equal each one rendered alone
by today's one-at-a-time non-streaming path (`Token2WavRunner.render` of a stream=False stream):
the flow mel within MEL_ATOL, the audio within AUDIO_ATOL.
"""
from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import pytest
import torch

from async_cosyvoice.model_dir import build_models, load_model_dir
from async_cosyvoice.models.hift import NSFNoise
from async_cosyvoice.token2wav import Token2WavRunner, Token2WavStream
from async_cosyvoice.token2wav.batcher import Token2WavBatcher
from async_cosyvoice.token2wav.offline import OfflineLimits, padded_groups

torch.set_num_threads(1)

# The flow differs from its own call by float summation order (padded / batched GEMMs, measured
# ~1e-6 on the mel); HiFT's NSF phase is a cumulative sum over the whole utterance and amplifies that
# ~10x, and its own padded-vs-alone convolutions differ by ~5e-6 (measured): audio within 3e-5.
MEL_ATOL = 1e-5
AUDIO_ATOL = 3e-5


@pytest.fixture(scope="module")
def models(tiny_dir):
    return build_models(load_model_dir(tiny_dir), with_llm=False)


def _prompts(golden_dir):
    mi = np.load(golden_dir / "model_inputs.npz")
    t = lambda a: torch.from_numpy(np.asarray(a))  # noqa: E731
    return {k: (t(mi[f"{k}/flow_prompt_speech_token"]), t(mi[f"{k}/prompt_speech_feat"]), t(mi[f"{k}/flow_embedding"]))
            for k in ("zero_shot", "zero_shot_zh_p16")}, t(np.load(golden_dir / "e2e_nonstream.npz")["token"])[0]


# (prompt, prompt start, prompt tokens, target tokens, token multiplier, speed, noise seed or None for zero)
SPECS = [
    ("zero_shot", 0, 75, 60, 1, 1.0, 1),
    ("zero_shot_zh_p16", 0, 74, 52, 7, 1.0, None),
    ("zero_shot", 10, 30, 33, 11, 1.25, 2),
    ("zero_shot_zh_p16", 5, 40, 45, 13, 1.0, 3),
    ("zero_shot", 0, 75, 18, 17, 0.8, None),
    ("zero_shot_zh_p16", 20, 50, 58, 19, 1.0, 4),
    ("zero_shot", 0, 75, 60, 23, 1.0, 5),  # shaped like the first: an equal-length HiFT group
]


def _streams(golden_dir):
    prompts, base = _prompts(golden_dir)
    out = []
    for key, start, n, n_tok, mult, speed, seed in SPECS:
        tok, feat, emb = prompts[key]
        noise = NSFNoise.zero() if seed is None else NSFNoise.random(torch.Generator().manual_seed(seed))
        s = Token2WavStream(tok[:, start:start + n], feat[:, 2 * start:2 * (start + n)], emb, stream=False,
                            speed=speed, noise=noise)
        tokens = [(int(t) * mult + 3 * mult) % 6561 for t in base[:n_tok]]
        out.append((s, tokens))
    return out


def _alone(models, golden_dir):
    records = []
    runner = Token2WavRunner(models.flow, models.hift, recorder=records.append)
    audio = [torch.cat(runner.render(s, toks)) for s, toks in _streams(golden_dir)]
    assert runner.stats.flow_items == runner.stats.flow_calls == len(SPECS)  # really one at a time
    return audio, [r.flow_mel for r in records]


@pytest.fixture(scope="module")
def alone(models, golden_dir):
    return _alone(models, golden_dir)


def _compare(alone, audio, mels):
    ref_audio, ref_mels = alone
    mel_err = [(a - b).abs().max().item() for a, b in zip(ref_mels, mels)]
    audio_err = []
    for ref, got in zip(ref_audio, audio):
        assert ref.shape == got.shape
        audio_err.append((ref - got).abs().max().item())
    print("max |batched - alone| flow mel", " ".join(f"{e:.1e}" for e in mel_err),
          "| audio", " ".join(f"{e:.1e}" for e in audio_err))
    assert max(mel_err) <= MEL_ATOL
    assert max(audio_err) <= AUDIO_ATOL


def test_padded_groups_respect_the_limits():
    lengths = [int(x) for x in np.random.default_rng(0).integers(1, 400, 60)]
    limits = OfflineLimits(max_batch=8, max_frames=1500, length_ratio=1.5)
    groups = padded_groups(lengths, limits)
    assert sorted(i for g in groups for i in g) == list(range(60))
    for g in groups:
        longest = max(lengths[i] for i in g)
        assert lengths[g[0]] == longest and len(g) <= 8
        assert len(g) == 1 or len(g) * longest <= 1500
        assert longest <= 1.5 * min(lengths[i] for i in g)
    assert padded_groups([5000, 10], OfflineLimits(max_frames=100)) == [[0], [1]]  # too long: alone
    with pytest.raises(ValueError):
        OfflineLimits(length_ratio=0.5)


def test_offline_batch_equals_one_at_a_time(models, golden_dir, alone):
    """Through the real asyncio collector of a Token2WavBatcher: the utterances, submitted together,
    run as one padded flow call and one padded HiFT call (render_offline) as soon as the batch is
    full; a cancelled caller's job never runs; every result equals the one-at-a-time render."""
    records = []
    runner = Token2WavRunner(models.flow, models.hift, recorder=records.append, length_bucket_ratio=4.0)
    batcher = Token2WavBatcher(runner, max_batch=8, offline=OfflineLimits(max_batch=8, max_frames=10 ** 6,
                                                                          length_ratio=4.0), offline_wait_s=3600.0)
    streams = _streams(golden_dir)
    extra = _streams(golden_dir)[0][0]  # its caller goes away before the batch is taken
    extra.append(_streams(golden_dir)[0][1])

    async def main():
        try:
            cancelled = asyncio.ensure_future(batcher.submit(extra.next_job(True), 0.0))
            await asyncio.sleep(0)
            cancelled.cancel()
            tasks = []
            for s, toks in streams:
                s.append(toks)
                tasks.append(asyncio.ensure_future(batcher.submit(s.next_job(True), 0.0)))
            # seven pending < max_batch 8 and the wait is an hour: the batch is taken when it is
            # full, so one more (a copy of the first spec) starts it at once
            last, toks = _streams(golden_dir)[0]
            last.append(toks)
            return await asyncio.wait_for(asyncio.gather(*tasks, batcher.submit(last.next_job(True), 0.0)), 600)
        finally:
            await batcher.close()

    out = asyncio.run(main())
    st = batcher.offline.stats
    print(st.to_json())
    assert st.jobs == len(SPECS) + 1 and st.flow_batches == {len(SPECS) + 1: 1}  # one padded flow call
    assert st.hift_batches == {len(SPECS) + 1: 1} and st.flow_padded_frames > st.flow_frames  # padded HiFT
    assert batcher.stage_stats.calls == 1 and batcher.stage_stats.items == len(SPECS) + 1
    assert not extra.finished  # dropped
    _compare(alone, out[:-1], [r.flow_mel for r in records[:-1]])
    assert (out[-1] - alone[0][0]).abs().max() <= AUDIO_ATOL


def test_offline_bench_smoke_on_cpu(tiny_dir, tmp_path):
    """benchmarks/offline_bench.py end to end on the fixture: both paths run, the offline path in
    padded batches, and the JSON and table are written."""
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "offline_bench.py"
    spec = importlib.util.spec_from_file_location("offline_bench", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.main(["--model-dir", str(tiny_dir), "--requests", "4", "--concurrency", "4", "--tokens", "20",
                        "--spread", "0.25", "--stream-requests", "2", "--stream-concurrency", "2",
                        "--prompt-seconds", "2", "--out", str(tmp_path)]) == 0
    r = json.loads((tmp_path / "offline_results.json").read_text())
    offline, streaming = r["phases"]
    assert offline["path"] == "offline" and streaming["path"] == "streaming"
    lengths = [script.spread_tokens(20, 0.25, seed) for seed in range(4)]
    assert len(set(lengths)) > 1  # the requests have different lengths
    assert offline["audio_s"] == pytest.approx(sum(lengths) * 0.04)
    assert streaming["audio_s"] == pytest.approx(sum(lengths[:2]) * 0.04)
    assert offline["offline"]["jobs"] == 4 and offline["x_real_time"] > 0
    assert offline["stages"]["llm_step"]["busy_s"] > 0 and offline["offline"]["flow_s"] > 0
    assert "| offline |" in (tmp_path / "offline_table.txt").read_text()


def test_concurrent_nonstreaming_requests_share_an_offline_batch(tiny_dir, golden_dir, tmp_path):
    """Synthesizer.synthesize(stream=False), the path of gRPC Synthesize and the OpenAI endpoint: several
    requests in flight end up in one padded offline batch, and each one's audio equals the same
    request run alone (greedy forced-length requests, so the tokens are the same either way)."""
    from async_cosyvoice.config import Config
    from async_cosyvoice.frontend.audio import load_audio
    from async_cosyvoice.request import Mode, SynthesisOptions, SynthesisRequest
    from async_cosyvoice.tts import Synthesizer

    prompt = load_audio(golden_dir / "prompt_24k.wav")
    config = Config.model_validate({"model": {"dir": str(tiny_dir)}, "speakers": {"dir": str(tmp_path)}})

    def request(i: int, n_tokens: int) -> SynthesisRequest:
        return SynthesisRequest(Mode.CROSS_LINGUAL, text=f"Sentence number {i} is here.", prompt_audio=prompt,
                                options=SynthesisOptions(stream=False, seed=i, top_k=1, max_tokens=n_tokens),
                                request_id=f"r{i}")

    async def one(synth, req):
        chunks = [c async for c in synth.synthesize(req)]
        assert len(chunks) == 1 and chunks[0].is_final
        return chunks[0].segment_tokens, chunks[0].samples

    async def main():
        synth = await Synthesizer.create(config, warmup=False)
        try:
            specs = [(1, 30), (2, 36), (3, 42), (4, 36)]
            alone = [await one(synth, request(i, n)) for i, n in specs]
            before = dict(synth.batcher.offline.stats.flow_batches)
            together = await asyncio.gather(*(one(synth, request(i, n)) for i, n in specs))
            return alone, together, before, dict(synth.batcher.offline.stats.flow_batches)
        finally:
            await synth.close()

    alone, together, before, after = asyncio.run(main())
    assert before == {1: 4}  # one at a time: batches of one
    print("offline flow batches of the concurrent run", {k: v - before.get(k, 0) for k, v in after.items()})
    assert max(k for k, v in after.items() if v > before.get(k, 0)) >= 2  # some of them shared a batch
    for (tok_a, audio_a), (tok_b, audio_b) in zip(alone, together):
        assert tok_a == tok_b and audio_a.shape == audio_b.shape == (960 * len(tok_a),)
        assert np.abs(audio_a - audio_b).max() <= AUDIO_ATOL


def test_padded_hift_equals_each_item_alone_where_plain_padding_does_not(hift, golden_dir):
    """HiFT.inference_padded on items of 80, 37, 9 and 2 frames (the golden mel, scaled per item, seeded
    NSF noise per item) equals each item's own call; the plain batched call on the same zero-padded
    batch does not (HiFT is not causal: the padding reaches the end of every shorter item)."""
    g = np.load(golden_dir / "hift.npz")
    mel = torch.cat([torch.from_numpy(g["mel1"]), torch.from_numpy(g["mel2"])], dim=2)
    lengths = [mel.shape[2], 37, 9, 2]
    batch = torch.zeros(len(lengths), 80, max(lengths))
    for b, n in enumerate(lengths):
        batch[b, :, :n] = mel[0, :, :n] * (1 + 0.1 * b)

    def noises():
        return [NSFNoise.random(torch.Generator().manual_seed(b)) for b in range(len(lengths))]

    speech, sources = hift.inference_padded(batch, lengths, noises())
    plain, _ = hift.inference(batch, None, NSFNoise.zero())
    plain_zero, _ = hift.inference_padded(batch, lengths, [NSFNoise.zero()] * len(lengths))
    for b, (n, noise) in enumerate(zip(lengths, noises())):
        ref, ref_source = hift.inference(batch[b:b + 1, :, :n], None, noise)
        assert (speech[b, :480 * n] - ref[0]).abs().max() <= 1e-5
        assert (sources[b] - ref_source).abs().max() <= 1e-3  # the NSF phase: ~1e4 rad in float32
        assert not speech[b, 480 * n:].any()
        if n < max(lengths):
            zero_ref, _ = hift.inference(batch[b:b + 1, :, :n], None, NSFNoise.zero())
            assert (plain_zero[b, :480 * n] - zero_ref[0]).abs().max() <= 1e-5
            assert (plain[b, :480 * n] - zero_ref[0]).abs().max() > 1e-3  # what the masks are for


def test_a_nonstreaming_requests_segments_run_at_once(tiny_dir, golden_dir, tmp_path):
    """A non-streaming request of several text segments: all of them at once (their LM requests in
    one engine batch, their token2wav jobs in shared offline batches), the chunks in segment order
    and numbered as the sequential dispatch (offline_segments_ahead 1) numbers them, with the same
    tokens and audio (greedy, forced length). Cancelling a request while its segments' LM requests
    run aborts all of them and renders nothing."""
    from async_cosyvoice.config import Config
    from async_cosyvoice.frontend.audio import load_audio
    from async_cosyvoice.request import Mode, SynthesisOptions, SynthesisRequest
    from async_cosyvoice.tts import Synthesizer

    prompt = load_audio(golden_dir / "prompt_24k.wav")
    text = " ".join(["This sentence is long enough to count as a whole segment of the paragraph."] * 3)
    request = SynthesisRequest(Mode.CROSS_LINGUAL, text=text, prompt_audio=prompt, request_id="multi",
                               options=SynthesisOptions(stream=False, seed=5, top_k=1, max_tokens=20))

    async def run(ahead: int):
        config = Config.model_validate({"model": {"dir": str(tiny_dir)}, "speakers": {"dir": str(tmp_path)},
                                        "token2wav": {"offline_segments_ahead": ahead}})
        synth = await Synthesizer.create(config, warmup=False)
        try:
            chunks = [c async for c in synth.synthesize(request)]
            batches = dict(synth.batcher.offline.stats.flow_batches)
            if ahead > 1:  # a long request whose client goes away while its segments' LM requests run
                long = dataclasses.replace(request, request_id="left",
                                           options=dataclasses.replace(request.options, max_tokens=1500))
                jobs = synth.batcher.offline.stats.jobs
                consumer = asyncio.ensure_future(anext(synth.synthesize(long)))
                for _ in range(200):  # until the voice is encoded and the LM requests run (test-side wait)
                    if synth.engine_stats().running == len(chunks):
                        break
                    await asyncio.sleep(0.05)
                assert synth.engine_stats().running == len(chunks)  # every segment's LM at once
                consumer.cancel()
                await asyncio.gather(consumer, return_exceptions=True)
                assert synth.engine_stats().running == 0 and synth.batcher.offline.pending == 0
                assert synth.batcher.offline.stats.jobs == jobs
            return chunks, batches
        finally:
            await synth.close()

    sequential, seq_batches = asyncio.run(run(1))
    together, batches = asyncio.run(run(8))
    assert len(sequential) == len(together) > 1 and seq_batches == {1: len(sequential)}
    assert max(batches) >= 2  # segments of the request shared an offline batch
    fields = ("index", "sample_offset", "is_final", "segment_index", "n_tokens", "segment_tokens")
    for a, b in zip(sequential, together):
        assert [getattr(a, f) for f in fields] == [getattr(b, f) for f in fields]
        assert np.abs(a.samples - b.samples).max() <= AUDIO_ATOL
    assert together[-1].is_final and together[-1].n_tokens == 20 * len(together)
