"""The Synthesizer end to end on the fixture model: every mode, streamed and not."""
import dataclasses
import time

import numpy as np
import pytest
import torch

from async_cosyvoice.config import Config
from async_cosyvoice.errors import InvalidRequest, SpeakerNotFound, Unsupported
from async_cosyvoice.frontend.audio import load_audio
from async_cosyvoice.request import Audio, Mode, SynthesisOptions, SynthesisRequest
from async_cosyvoice.token2wav.flow_cache import speaker_prefix_tokens, state_nbytes
from async_cosyvoice.tts import SyncSynthesizer

SAMPLES_PER_TOKEN = 960
TEXT = "Hello there. This is a short test."


@pytest.fixture(scope="module")
def synth(tiny_dir, tmp_path_factory):
    # fixed (doubling) hops: the adaptive schedule follows wall-clock pacing, which makes chunk
    # boundaries, and so the cross-faded audio, depend on the machine's load
    config = Config.model_validate({"model": {"dir": str(tiny_dir)}, "token2wav": {"adaptive": False},
                                    "speakers": {"dir": str(tmp_path_factory.mktemp("spk"))}})
    s = SyncSynthesizer(config)
    s.synth.speakers.import_spk2info(tiny_dir / "spk2info.pt")
    s.register_speaker("reg", "The morning train was late again.", load_audio(tiny_dir / "golden" / "prompt_24k.wav"))
    yield s
    s.close()


@pytest.fixture(scope="module")
def prompt(tiny_dir):
    return load_audio(tiny_dir / "golden" / "prompt_24k.wav")


def _request(mode, prompt, stream, **kw):
    opts = SynthesisOptions(stream=stream, seed=kw.pop("seed", 7), **kw.pop("options", {}))
    voice = {
        Mode.ZERO_SHOT: dict(prompt_audio=prompt, prompt_text="The morning train was late again."),
        Mode.CROSS_LINGUAL: dict(prompt_audio=prompt),
        Mode.INSTRUCT2: dict(prompt_audio=prompt, instruct_text="Speak slowly."),
        Mode.SFT: dict(speaker_id="tiny_sft_spk"),
        Mode.ZERO_SHOT_BY_SPK_ID: dict(speaker_id="reg"),
        Mode.INSTRUCT2_BY_SPK_ID: dict(speaker_id="tiny_zs_spk", instruct_text="Speak slowly.<|endofprompt|>"),
        Mode.VC: dict(prompt_audio=prompt, source_audio=prompt),
    }[mode]
    text = kw.pop("text", "" if mode == Mode.VC else TEXT)  # vc converts audio and takes no text
    return SynthesisRequest(mode, text=text, options=opts, **voice, **kw)


def _check_chunks(chunks):
    assert [c.index for c in chunks] == list(range(len(chunks)))
    assert [c.is_final for c in chunks] == [False] * (len(chunks) - 1) + [True]
    offsets = np.cumsum([0] + [len(c.samples) for c in chunks[:-1]])
    assert [c.sample_offset for c in chunks] == offsets.tolist()
    assert all(c.sample_rate == 24000 and c.samples.dtype == np.float32 for c in chunks)
    tokens = [t for c in chunks for t in c.segment_tokens]
    total = sum(len(c.samples) for c in chunks)
    assert total == SAMPLES_PER_TOKEN * len(tokens) > 0
    assert chunks[-1].n_tokens == len(tokens)
    assert all(0 <= t < 6561 for t in tokens)
    assert all(np.isfinite(c.samples).all() for c in chunks)
    return tokens, np.concatenate([c.samples for c in chunks])


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True], ids=["nonstream", "stream"])
@pytest.mark.parametrize("mode", list(Mode), ids=[m.value for m in Mode])
def test_every_mode(synth, prompt, mode, stream):
    # streamed runs force 60 tokens (the random model rarely stops early) to keep the suite fast;
    # non-streamed runs stop on the model's own EOS
    options = {"max_tokens": 60} if stream else {}
    chunks = list(synth.synthesize(_request(mode, prompt, stream, options=options)))
    tokens, _ = _check_chunks(chunks)
    if mode == Mode.VC:  # the flow renders the source audio's own tokens
        assert len(tokens) == synth.synth.prompt_encoder.source_tokens(prompt).size
    if stream:
        assert len(chunks) >= 2


@pytest.mark.slow
def test_seed_makes_it_deterministic(synth, prompt):
    a, b, c = (_check_chunks(list(synth.synthesize(_request(Mode.ZERO_SHOT, prompt, True, seed=seed,
                                                             options={"max_tokens": 50}))))
               for seed in (3, 3, 4))
    assert a[0] == b[0] and np.array_equal(a[1], b[1])
    assert a[0] != c[0]


@pytest.mark.slow
def test_stream_equals_nonstream_tokens_with_greedy(synth, prompt):
    """Greedy decoding makes the LM deterministic: both paths render the same tokens and length."""
    opts = {"top_k": 1}
    a = _check_chunks(list(synth.synthesize(_request(Mode.CROSS_LINGUAL, prompt, True, options=opts))))
    b = _check_chunks(list(synth.synthesize(_request(Mode.CROSS_LINGUAL, prompt, False, options=opts))))
    assert a[0] == b[0] and len(a[1]) == len(b[1])


@pytest.mark.slow
def test_segments_in_order(synth, prompt):
    text = " ".join(["This sentence is long enough to count as a whole segment of the paragraph."] * 6)
    chunks = list(synth.synthesize(_request(Mode.CROSS_LINGUAL, prompt, True, text=text,
                                            options={"max_tokens": 30})))
    _check_chunks(chunks)
    segments = [c.segment_index for c in chunks]
    assert segments == sorted(segments) and segments[-1] >= 1


def test_forced_token_count(synth, prompt):
    chunks = list(synth.synthesize(_request(Mode.CROSS_LINGUAL, prompt, True, text="Hi.",
                                            options={"max_tokens": 40})))
    tokens, audio = _check_chunks(chunks)
    assert len(tokens) == 40 and len(audio) == 40 * SAMPLES_PER_TOKEN


def test_cancel_stops_the_engine(synth, prompt):
    gen = synth.synthesize(_request(Mode.CROSS_LINGUAL, prompt, True, options={"max_tokens": 400}))
    first = next(gen)
    assert first.index == 0 and not first.is_final
    gen.close()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        stats = synth.synth.engine_stats()
        if stats.running == 0 and stats.waiting == 0:
            break
        time.sleep(0.05)
    stats = synth.synth.engine_stats()
    assert (stats.running, stats.waiting, stats.kv_usage) == (0, 0, 0.0)


@pytest.mark.parametrize("request_kw, error", [
    (dict(mode=Mode.CROSS_LINGUAL, text="  "), InvalidRequest),
    (dict(mode=Mode.ZERO_SHOT, prompt_text=""), InvalidRequest),
    (dict(mode=Mode.SFT, speaker_id="nobody"), SpeakerNotFound),
    (dict(mode=Mode.ZERO_SHOT_BY_SPK_ID, speaker_id="tiny_sft_spk"), Unsupported),
    (dict(mode=Mode.CROSS_LINGUAL, options=SynthesisOptions(stream=True, speed=1.5)), InvalidRequest),
    (dict(mode=Mode.CROSS_LINGUAL, options=SynthesisOptions(speed=0.0)), InvalidRequest),
    (dict(mode=Mode.CROSS_LINGUAL, text="。。。"), InvalidRequest),
])
def test_bad_requests(synth, prompt, request_kw, error):
    kw = dict(text=TEXT, prompt_audio=prompt)
    kw.update(request_kw)
    with pytest.raises(error):
        list(synth.synthesize(SynthesisRequest(**kw)))
    stats = synth.synth.engine_stats()
    assert stats.running == 0


def test_register_rejects_duplicates_and_bad_ids(synth, prompt):
    from async_cosyvoice.errors import SpeakerExists
    with pytest.raises(SpeakerExists):
        synth.register_speaker("reg", "again", prompt)
    with pytest.raises(InvalidRequest):
        synth.register_speaker("../etc", "x", prompt)


def test_registration_caches_the_speaker_prompt_prefix(synth, prompt):
    """The flow cache's prefix of a new speaker is computed when it registers, not by its first
    request; a re-registration with other audio replaces it, a deletion drops it."""
    runner = synth.synth.batcher.runner
    cache = runner.speaker_prefixes
    misses = cache.stats.misses
    synth.register_speaker("fresh", "The morning train was late again.", prompt)
    assert "fresh" in cache and cache.stats.misses == misses + 1
    hits = cache.stats.hits
    request = _request(Mode.ZERO_SHOT_BY_SPK_ID, prompt, True, text="Short one.")
    chunks = list(synth.synthesize(dataclasses.replace(request, speaker_id="fresh")))
    assert chunks[-1].is_final
    assert cache.stats.misses == misses + 1 and cache.stats.hits > hits  # the first request found it
    old_tokens = cache._items["fresh"][2]
    shorter = Audio(prompt.samples[: len(prompt.samples) * 2 // 3], prompt.sample_rate)
    synth.register_speaker("fresh", "The morning train.", shorter, overwrite=True)
    assert "fresh" in cache and not torch.equal(cache._items["fresh"][2], old_tokens)
    synth.call(synth.synth.delete_speaker("fresh"))
    assert "fresh" not in cache


def test_registration_stands_when_preparing_the_speaker_fails(tiny_dir, tmp_path, prompt, caplog):
    """Preparing is an optimization: with the token2wav stage already closed the speaker is still
    stored and the registration returns it, with a warning."""
    config = Config.model_validate({"model": {"dir": str(tiny_dir)}, "speakers": {"dir": str(tmp_path / "spk")}})
    with SyncSynthesizer(config) as s:
        s.call(s.synth.batcher.close())
        record = s.register_speaker("stored_anyway", "The morning train was late again.", prompt)
        assert s.synth.speakers.get("stored_anyway").voice.n_tokens == record.voice.n_tokens > 0
    assert any("'stored_anyway' is stored, but preparing it failed" in r.getMessage() for r in caplog.records)


def test_start_computes_the_prefixes_of_the_newest_speakers_that_fit(tiny_dir, tmp_path, prompt):
    """The warm-up before SERVING computes the flow prompt prefixes of the speakers registered last,
    as many as flow_cache_speaker_bytes holds, newest first; sft speakers have none."""
    spk = tmp_path / "spk"
    base = {"model": {"dir": str(tiny_dir)}, "speakers": {"dir": str(spk)}}
    with SyncSynthesizer(Config.model_validate(base)) as first:
        first.synth.speakers.import_spk2info(tiny_dir / "spk2info.pt")  # tiny_zs_spk (zero-shot), tiny_sft_spk
        time.sleep(0.01)
        first.register_speaker("older", "The morning train was late again.", prompt)
        time.sleep(0.01)
        first.register_speaker("newest", "The morning train was late again.", prompt)
        n_prompt = first.synth.speakers.get("newest").voice.n_tokens
        dims = first.synth.dims.flow
    one = state_nbytes(dims, speaker_prefix_tokens(n_prompt, dims.encoder.static_chunk_size, dims.pre_lookahead_len),
                       torch.float32)
    for budget, expected in ((2 << 30, {"tiny_zs_spk", "older", "newest"}), (one + 1, {"newest"})):
        config = Config.model_validate({**base, "token2wav": {"flow_cache_speaker_bytes": budget}})
        with SyncSynthesizer(config, warmup=True) as started:
            cache = started.synth.batcher.runner.speaker_prefixes
            assert set(cache._items) == expected, (budget, set(cache._items))


@pytest.mark.slow
def test_full_size_random_model_synthesizes_on_cpu(tmp_path, prompt):
    """The official dimensions end to end on CPU: generate, load strictly, speak 20 tokens."""
    import shutil

    from async_cosyvoice.random_model import make_random_model

    model = make_random_model("cosyvoice2-0.5b", tmp_path / "full", seed=0)
    try:
        config = Config.model_validate({"model": {"dir": str(model)}, "speakers": {"dir": str(tmp_path / "spk")}})
        with SyncSynthesizer(config) as full:
            assert full.synth.dims.lm.qwen.num_layers == 24
            request = SynthesisRequest(Mode.CROSS_LINGUAL, text="Hello there.", prompt_audio=prompt,
                                       options=SynthesisOptions(stream=True, seed=0, max_tokens=20))
            tokens, audio = _check_chunks(list(full.synthesize(request)))
        assert len(tokens) == 20 and len(audio) == 20 * SAMPLES_PER_TOKEN
        assert np.abs(audio).max() > 0
    finally:
        shutil.rmtree(tmp_path / "full", ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# What each mode feeds the models, the config's defaults, text streams, cancellation


@pytest.mark.parametrize("mode", list(Mode), ids=[m.value for m in Mode])
def test_each_mode_conditions_the_models_as_specified(synth, prompt, mode):
    s = synth.synth
    request = s.rules.check(_request(mode, prompt, False))
    voice = synth.call(s.prepare_voice(request))
    inputs = synth.call(s.model_inputs(request, voice))
    mi = inputs[0]
    tok = s.tokenizer.encode
    stored = s.speakers.get(request.speaker_id).voice if request.speaker_id else None
    instruction = tok("Speak slowly.<|endofprompt|>")
    transcript = tok(s.text_frontend.normalize("The morning train was late again.", split=False))
    expected_prompt_text = {
        Mode.ZERO_SHOT: transcript, Mode.CROSS_LINGUAL: [], Mode.INSTRUCT2: instruction, Mode.SFT: [],
        Mode.ZERO_SHOT_BY_SPK_ID: transcript,  # "reg" was registered with that transcript
        Mode.INSTRUCT2_BY_SPK_ID: instruction, Mode.VC: [],
    }[mode]
    assert mi.prompt_text.tolist() == expected_prompt_text
    if mode == Mode.INSTRUCT2_BY_SPK_ID:  # the stored transcript must not reach the LM
        assert stored.prompt_text_tokens.size and mi.prompt_text.tolist() != stored.prompt_text_tokens.tolist()
    lm_speech = mode in (Mode.ZERO_SHOT, Mode.ZERO_SHOT_BY_SPK_ID)
    assert (mi.llm_prompt_speech_token.size > 0) == lm_speech
    if lm_speech:
        assert np.array_equal(mi.llm_prompt_speech_token, mi.flow_prompt_speech_token)
    assert (mi.flow_prompt_speech_token.size > 0) == (mode != Mode.SFT)
    assert mi.prompt_speech_feat.shape[0] == 2 * mi.flow_prompt_speech_token.size or mode == Mode.VC
    if stored is not None:
        assert np.array_equal(mi.flow_embedding, stored.embedding)
        if mode != Mode.SFT:
            assert np.array_equal(mi.flow_prompt_speech_token, stored.speech_tokens)
    if mode == Mode.VC:
        assert mi.source_speech_token.tolist() == s.prompt_encoder.source_tokens(prompt).tolist()
    else:
        assert mi.text.size > 0 and mi.source_speech_token.size == 0


def test_first_hop_comes_from_the_request_else_the_config(synth, prompt):
    """15 (+3 lookahead) tokens by default; a request's own first_hop wins. A first chunk emits
    its hop x 960 samples minus the 3840 HiFT keeps for the cross-fade (prompt_align=1: no pad)."""
    def first_chunk(**opts):
        gen = synth.synthesize(_request(Mode.CROSS_LINGUAL, prompt, True, options={"max_tokens": 60, **opts}))
        chunk = next(gen)
        gen.close()
        return len(chunk.samples)
    assert synth.synth.config.token2wav.first_hop == 15
    assert first_chunk() == 15 * 960 - 3840
    assert first_chunk(first_hop=25) == 25 * 960 - 3840


@pytest.mark.slow
def test_config_first_hop_reaches_the_library(tiny_dir, tmp_path, prompt):
    config = Config.model_validate({"model": {"dir": str(tiny_dir)}, "speakers": {"dir": str(tmp_path)},
                                    "token2wav": {"first_hop": 20}})
    with SyncSynthesizer(config) as s:
        gen = s.synthesize(_request(Mode.CROSS_LINGUAL, prompt, True, options={"max_tokens": 40}))
        assert len(next(gen).samples) == 20 * 960 - 3840
        gen.close()


def test_cancel_drops_the_pending_token2wav_job(synth, prompt):
    """A job queued behind a running batch is dropped when its request goes away: the batcher never
    runs it and its stream never advances."""
    import asyncio

    from async_cosyvoice.token2wav import ChunkSchedule, Token2WavStream
    from async_cosyvoice.token2wav.batcher import Token2WavBatcher

    s = synth.synth
    voice = s.speakers.get("reg").voice

    def stream():
        t = Token2WavStream(torch.tensor(voice.speech_tokens)[None], torch.tensor(voice.speech_feat)[None],
                            torch.tensor(voice.embedding)[None], schedule=ChunkSchedule(first_hop=15, prompt_align=1))
        t.append(list(range(40)))
        return t

    async def body():
        batcher = Token2WavBatcher(s.batcher.runner, max_batch=1)  # one job per batch: b waits behind a
        a, b = stream(), stream()
        job_a, job_b = a.next_job(False), b.next_job(False)
        run_a = asyncio.ensure_future(batcher.submit(job_a, 0.0))
        run_b = asyncio.ensure_future(batcher.submit(job_b, 1.0))
        await asyncio.sleep(0)  # both submitted (and the batcher task created)
        await asyncio.sleep(0)  # the batcher took a (most urgent) and runs it; b waits
        assert job_a.timing.started > 0 and not job_b.timing.started and batcher.pending == 1
        run_b.cancel()
        await run_a
        await asyncio.sleep(0)
        stats = batcher.stage_stats.items, batcher.pending, a.chunks_done, b.chunks_done
        await batcher.close()
        return stats

    assert synth.call(body()) == (1, 0, 1, 0)


def test_synthesize_stream_prepares_the_voice_once(synth, prompt):
    from async_cosyvoice.request import FLUSH

    s = synth.synth

    async def pieces():
        for piece in ["First sentence here. Second", " one comes", " now. And a third without end", FLUSH,
                      " plus a tail."]:
            yield piece

    async def body():
        request = _request(Mode.ZERO_SHOT, prompt, True, text="", options={"max_tokens": 20})
        return [c async for c in s.synthesize_stream(pieces(), request, text_mode="sentence")]

    before = s.prompt_encoder.prompts_encoded
    chunks = synth.call(body())
    assert s.prompt_encoder.prompts_encoded - before == 1
    assert max(c.segment_index for c in chunks) >= 3  # four sentences, one voice
    assert [c.index for c in chunks] == list(range(len(chunks)))
    assert chunks[-1].is_final and not any(c.is_final for c in chunks[:-1])
    offsets = np.cumsum([0] + [len(c.samples) for c in chunks[:-1]])
    assert [c.sample_offset for c in chunks] == offsets.tolist()
    assert chunks[-1].n_tokens == 20 * (max(c.segment_index for c in chunks) + 1)


@pytest.mark.parametrize("text_mode", [None, "sentence"], ids=["default", "sentence"])
def test_synthesize_stream_times_out_on_silence(synth, prompt, text_mode):
    import asyncio

    from async_cosyvoice.errors import TextTimeout

    s = synth.synth
    s.config.limits.text_idle_seconds, idle = 0.5, s.config.limits.text_idle_seconds

    async def stalled():
        yield "Hello there."
        await asyncio.sleep(30)

    async def body():
        request = _request(Mode.CROSS_LINGUAL, prompt, True, text="", options={"max_tokens": 20})
        return [c async for c in s.synthesize_stream(stalled(), request, text_mode=text_mode)]

    try:
        with pytest.raises(TextTimeout, match="no text arrived for 0.5 s"):
            synth.call(body())
    finally:
        s.config.limits.text_idle_seconds = idle
    assert s.engine_stats().running == 0 and s.batcher.pending == 0


def test_synthesize_stream_bistream_speaks_before_the_text_ends(synth, prompt):
    """One LM request for the whole stream: its first audio arrives while text is still held back.
    (Each 5 text tokens let the LM speak 15 tokens; the first chunk needs 15 + 3, so the first
    pieces hold more than 10 text tokens.)"""
    import asyncio

    s = synth.synth
    assert s.supports_bistream

    async def body():
        first_audio = asyncio.Event()
        sent = []

        async def pieces():
            for piece in ["Hello", " there,", " this is", " a sentence", " that keeps", " going on", " and"]:
                sent.append(piece)
                yield piece
            await asyncio.wait_for(first_audio.wait(), 120)  # audio must come before the rest
            for piece in [" on", " for a while."]:
                sent.append(piece)
                yield piece

        request = _request(Mode.ZERO_SHOT_BY_SPK_ID, prompt, True, text="", options={"max_tokens": 200})
        chunks = []
        async for chunk in s.synthesize_stream(pieces(), request, text_mode="bistream"):
            if len(chunk.samples) and not first_audio.is_set():
                assert sent[-1] == " and"
                first_audio.set()
            chunks.append(chunk)
        return chunks

    chunks = synth.call(body())
    tokens, _ = _check_chunks(chunks)
    assert {c.segment_index for c in chunks} == {0} and 0 < len(tokens) <= 200
    assert s.engine_stats().running == 0


def test_bistream_keeps_upstreams_length_rule_once_the_text_ended(synth, prompt):
    """Upstream's bistream loop has no length rule; the random model never emits EOS, so without
    ours it would speak to max_model_len. Once the text has ended, at most 20 speech tokens per
    text token (the yaml's max_token_text_ratio), as for a whole-text request."""
    s = synth.synth
    pieces = ["Hello", " there,", " a short", " text."]
    n_text = sum(len(s.tokenizer.encode(p)) for p in pieces)

    async def text():
        for piece in pieces:
            yield piece

    async def body():
        request = _request(Mode.CROSS_LINGUAL, prompt, True, text="")
        return [c async for c in s.synthesize_stream(text(), request, text_mode="bistream", text_normalization="raw")]

    tokens, _ = _check_chunks(synth.call(body()))
    assert 0 < len(tokens) <= int(s.dims.lm.max_token_text_ratio * n_text)
    assert s.engine_stats().running == 0


def test_bistream_is_the_default_and_fed_the_normalized_text(synth, prompt):
    """No text_mode: one LM request for the whole reply (bistream; sentence mode would make one
    segment per sentence). What the LM is fed: "safe", the tokens of the whole text normalized;
    "raw", each piece's own tokens (upstream)."""
    s = synth.synth
    assert s.supports_bistream
    pieces = ["It", " costs", " 12", " dollars", ". We", " met", " Dr.", " Smith", " at", " 3", " pm", "."]
    whole = "".join(pieces)

    async def text():
        for piece in pieces:
            yield piece

    async def body():
        request = _request(Mode.SFT, prompt, True, text="", options={"max_tokens": 30})
        chunks = [c async for c in s.synthesize_stream(text(), request)]

        async def fed(normalization):
            return [t async for tokens in s.front.stream_tokens(text(), request, "bistream", normalization)
                    for t in tokens]
        return chunks, await fed("safe"), await fed("raw")

    chunks, safe, raw = synth.call(body())
    _check_chunks(chunks)
    assert {c.segment_index for c in chunks} == {0}
    normalized = s.text_frontend.normalize(whole, split=False)
    assert "twelve dollars" in normalized and "doctor" in normalized
    assert safe == s.tokenizer.encode(normalized)
    assert raw == [t for p in pieces for t in s.tokenizer.encode(p)]


def test_text_normalization_is_checked(synth, prompt):
    s = synth.synth

    async def text():
        yield "Hello there."

    async def run(**kw):
        request = _request(Mode.SFT, prompt, True, text="", options={"max_tokens": 10})
        return [c async for c in s.synthesize_stream(text(), request, **kw)]

    with pytest.raises(InvalidRequest, match="text_normalization must be 'safe' or 'raw'"):
        synth.call(run(text_normalization="fancy"))
    with pytest.raises(InvalidRequest, match="sentence mode normalizes whole sentences"):
        synth.call(run(text_mode="sentence", text_normalization="raw"))
    assert s.engine_stats().running == 0
