"""dims_map.py: the one table between ModelDims and cosyvoice2.yaml / config.json, read and written."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from async_cosyvoice.dims_map import (
    QWEN_FIELDS, RECIPE_FIELDS_BY_KIND, base_dims, qwen_config, read_dims, read_qwen_dims,
    write_recipe,
)
from async_cosyvoice.errors import ModelDirError
from async_cosyvoice.model_dir import load_model_dir
from async_cosyvoice.models.dims import ModelDims, Qwen2Dims
from async_cosyvoice.random_model.presets import PRESETS
from async_cosyvoice.random_model.recipe import OFFICIAL_RECIPE, recipe_yaml
from async_cosyvoice.recipe import load_recipe

# `dataclasses.asdict` of the fixture's dims as the hand-written reader gave them before the table
# (model_dir.py at 8c2efab), frozen once: the table must read the same values with the same types.
FROZEN_FIXTURE_DIMS = Path(__file__).parent / "data" / "fixture_dims.json"


def _leaves(obj, prefix: str = "") -> list[str]:
    out = []
    for f in dataclasses.fields(obj):
        sub = getattr(obj, f.name)
        out += _leaves(sub, f"{prefix}{f.name}.") if dataclasses.is_dataclass(sub) else [prefix + f.name]
    return out


# set by the kind (the yaml's name), not read from the recipe
KIND_FIELDS = {"kind", "lm.kind", "hift.causal"}
CV3_ONLY = {"hift.conv_pre_look_right"}


@pytest.mark.parametrize("kind", ["cosyvoice2", "cosyvoice3"])
def test_every_field_is_mapped_once(kind):
    skip = KIND_FIELDS | (CV3_ONLY if kind == "cosyvoice2" else set())
    recipe_leaves = [p for p in _leaves(base_dims(kind))
                     if not p.startswith("lm.qwen.") and p not in skip]  # lm.qwen: config.json
    assert sorted(f.dims for f in RECIPE_FIELDS_BY_KIND[kind]) == sorted(recipe_leaves)
    assert sorted(f.dims for f in QWEN_FIELDS) == sorted(_leaves(Qwen2Dims()))


def test_fixture_reads_as_before(tiny_dir):
    dims = load_model_dir(tiny_dir).dims
    # compared as JSON text, so an int where a float was (10 vs 10.0) fails too
    assert json.dumps(dataclasses.asdict(dims)) == json.dumps(json.loads(FROZEN_FIXTURE_DIMS.read_text()))


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_presets_round_trip(preset):
    dims = PRESETS[preset].dims
    assert read_dims(load_recipe(recipe_yaml(dims)), dims.lm.qwen, kind=dims.kind) == dims
    assert read_qwen_dims(qwen_config(dims.lm.qwen), "config.json") == dims.lm.qwen


def test_written_yaml_is_the_official_text(tiny_dir):
    assert recipe_yaml(ModelDims()) == OFFICIAL_RECIPE.read_text()  # nothing to change: byte for byte
    fixture = (tiny_dir / "cosyvoice2.yaml").read_text()
    assert recipe_yaml(PRESETS["tiny"].dims).rstrip("\n") == fixture.rstrip("\n")


def test_unusual_dims_round_trip():
    """Optional keys inserted, !ref aliases written through or replaced by literals where they would lie."""
    d = PRESETS["tiny"].dims
    odd = dataclasses.replace(
        d, chunk_size=20, token_frame_rate=50,
        lm=dataclasses.replace(d.lm, llm_input_size=32, min_token_text_ratio=3.0, mix_ratio=(4, 12)),
        flow=dataclasses.replace(
            d.flow, pre_lookahead_len=2,  # the encoder keeps 3: its optional key must be written
            encoder=dataclasses.replace(d.flow.encoder, num_up_blocks=2, upsample_stride=3),
            cfm=dataclasses.replace(d.flow.cfm, n_timesteps=5, t_scheduler="it's")),
        hift=dataclasses.replace(d.hift, sampling_rate=22050),
        feat=dataclasses.replace(d.feat, fmax=None, center=True))
    text = write_recipe(odd, OFFICIAL_RECIPE.read_text())
    assert read_dims(load_recipe(text), odd.lm.qwen) == odd
    assert "\nllm_input_size: 32\n" in text and "    llm_input_size: !ref <llm_input_size>\n" in text
    assert "    input_frame_rate: 25\n" in text and "    sampling_rate: 22050\n" in text
    assert "static_chunk_size: 50\n" in text and "!ref <chunk_size> * <token_mel_ratio>" not in text
    assert "# streaming inference chunk size" in text  # comments kept


def test_alternative_keys():
    q = Qwen2Dims(hidden_size=64, num_heads=4, num_kv_heads=4, rope_theta=10000.0)
    config = qwen_config(q)
    del config["num_key_value_heads"]  # defaults to num_attention_heads
    config["rope_parameters"] = {"rope_theta": config.pop("rope_theta")}  # newer transformers
    assert read_qwen_dims(config, "config.json") == q
    del config["rope_parameters"]
    with pytest.raises(ModelDirError, match="^config.json: missing key rope_theta$"):
        read_qwen_dims(config, "config.json")
    # cfm_params as a plain mapping instead of `!new:omegaconf.DictConfig {content: ...}`
    text = OFFICIAL_RECIPE.read_text()
    plain = text.replace("cfm_params: !new:omegaconf.DictConfig\n            content:\n", "cfm_params:\n")
    assert plain != text
    assert read_dims(load_recipe(plain), Qwen2Dims()) == ModelDims()
