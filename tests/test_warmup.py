"""Warm-up coverage: registered speakers' prompt lengths at every batch size, before SERVING and
on registration; torch.compile's cache folder."""
import asyncio
import os

import pytest

from async_cosyvoice.config import Config
from async_cosyvoice.frontend.audio import load_audio
from async_cosyvoice.request import Audio
from async_cosyvoice.speakers import SpeakerStore
from async_cosyvoice.tts import SyncSynthesizer
from async_cosyvoice.warmup import GRAPH_TARGET_TOKENS, Warmup, batch_sizes, compile_in_use, use_compile_cache

TRANSCRIPT = "The morning train was late again."


def test_batch_sizes():
    assert batch_sizes(1) == [1]
    assert batch_sizes(4) == [1, 2, 4]
    assert batch_sizes(5) == [1, 2, 4, 5]


def test_registered_speakers_are_warmed_at_every_batch_size(tiny_dir, tmp_path):
    prompt = load_audio(tiny_dir / "golden" / "prompt_24k.wav")
    short = Audio(prompt.samples[: len(prompt.samples) // 2], prompt.sample_rate)
    base = {"model": {"dir": str(tiny_dir)}, "speakers": {"dir": str(tmp_path / "spk")}}
    with SyncSynthesizer(Config.model_validate(base), warmup=True) as s:
        assert not compile_in_use(s.synth.config)  # CPU: nothing captured, so no coverage by default
        s.register_speaker("long", TRANSCRIPT, prompt)
        assert s.synth.warming.warmed == {}
        n_long = s.synth.speakers.get("long").voice.n_tokens

    config = Config.model_validate({**base, "warmup": {"coverage": True, "max_batch": 3, "register_max_batch": 2}})
    with SyncSynthesizer(config, warmup=True) as s:
        assert s.synth.warming.warmed == {n_long: [1, 2, 3]}  # before the first request
        s.register_speaker("short", TRANSCRIPT, short)
        n_short = s.synth.speakers.get("short").voice.n_tokens
        assert n_short != n_long
        # registered while serving: beside live traffic, so only up to register_max_batch streams
        assert s.synth.warming.warmed == {n_long: [1, 2, 3], n_short: [1, 2]}
        s.register_speaker("long2", TRANSCRIPT, prompt)  # a length already warmed: nothing runs again
        assert list(s.synth.warming.warmed) == [n_long, n_short]


def test_compile_cache_folder(tmp_path, monkeypatch):
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    config = Config.model_validate({"warmup": {"compile_cache_dir": str(tmp_path / "tc")}})
    assert use_compile_cache(config) == tmp_path / "tc"
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "tc")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))  # the operator's choice wins
    assert use_compile_cache(config) == tmp_path / "mine"


@pytest.mark.parametrize("overrides, expected", [
    ({}, False),
    ({"model": {"device": "cuda"}}, True),  # engine.cuda_graphs defaults to true
    ({"model": {"device": "cuda"}, "engine": {"cuda_graphs": False}}, False),
    ({"model": {"device": "cuda"}, "engine": {"cuda_graphs": False}, "token2wav": {"estimator": "compiled"}}, True),
])
def test_compile_in_use(overrides, expected):
    assert compile_in_use(Config.model_validate(overrides)) is expected


def test_graphs_of_a_prompt_length_are_captured_after_its_requests(tmp_path):
    """With CUDA graphs the warm-up also captures the later chunks' calls, which short requests do
    not reach: the flow's of prompt + 1 .. GRAPH_TARGET_TOKENS tokens and HiFT's of every streaming
    chunk's mel length, at the warmed stream counts."""
    events = []

    async def synthesize(request):
        events.append(("request", request.speaker_id))
        return
        yield

    async def capture(max_streams, tokens, frames):
        events.append(("capture", max_streams, tokens, frames))
        return 7

    config = Config.model_validate({"warmup": {"coverage": True, "max_batch": 4}})
    warm = Warmup(config, SpeakerStore(tmp_path), 24000, max_tokens=40, capture=capture)
    asyncio.run(warm.speaker(synthesize, "alice", 150))
    assert events[:-1] == [("request", "alice")] * 7  # 1 + 2 + 4 streams first
    kind, streams, tokens, frames = events[-1]
    assert (kind, streams) == ("capture", 4)
    assert tokens[0] == 151 and tokens[-1] >= 150 + GRAPH_TARGET_TOKENS - 16 and tokens.step <= 16
    # HiFT: every streaming chunk's mel length, up to 8 cached frames + a final chunk of max_hop + 3 tokens
    t2w = config.token2wav
    assert frames[0] <= 16 and frames.step <= 16
    assert frames[-1] >= 8 + 2 * (t2w.first_hop * t2w.max_hop_multiple + 3)
    assert warm.warmed == {150: [1, 2, 4]}
