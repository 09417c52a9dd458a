"""The Synthesizer end to end on the fixture model: every mode, streamed and not."""
import time

import numpy as np
import pytest

from async_cosyvoice.config import Config
from async_cosyvoice.errors import InvalidRequest, SpeakerNotFound, Unsupported
from async_cosyvoice.frontend.audio import load_audio
from async_cosyvoice.request import Mode, SynthesisOptions, SynthesisRequest
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
