"""model_dir.py + frontend/tokenizer.py against the shared cosyvoice2-tiny fixture."""
from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from async_cosyvoice.frontend.tokenizer import COSYVOICE2_SPECIAL_TOKENS, TextTokenizer
from async_cosyvoice.errors import ModelDirError
from async_cosyvoice.model_dir import (
    fold_weight_norm, load_model_dir, load_state_dict_file, load_strict, normalize_hift_state_dict,
)
from async_cosyvoice.models.dims import (
    EncoderDims, EstimatorDims, FlowDims, HiFTDims, LMDims, ModelDims, Qwen2Dims,
)
from async_cosyvoice.recipe import Tagged, load_recipe


@pytest.fixture(scope="module")
def md(tiny_dir):
    return load_model_dir(tiny_dir)


@pytest.fixture(scope="module")
def info(golden_dir):
    return json.loads((golden_dir / "fixture_info.json").read_text())


# ------------------------------------------------------------------ dims

def test_dims_match_fixture_info(md, info):
    d, fi = md.dims, info["dims"]
    q = d.lm.qwen
    assert (q.hidden_size, q.intermediate_size, q.num_layers, q.num_heads, q.num_kv_heads) == (
        fi["qwen_hidden"], fi["qwen_intermediate"], fi["qwen_layers"], fi["qwen_heads"], fi["qwen_kv_heads"])
    assert q.vocab_size == info["tokenizer"]["vocab_size_config"]
    e, est = d.flow.encoder, d.flow.estimator
    assert (e.attention_heads, e.linear_units, e.num_blocks) == (
        fi["flow_attention_heads"], fi["flow_linear_units"], fi["flow_num_blocks"])
    assert est.channels == (fi["dec_channels"],)
    assert (est.attention_head_dim, est.n_blocks, est.num_mid_blocks, est.num_heads) == (
        fi["dec_attention_head_dim"], fi["dec_n_blocks"], fi["dec_num_mid_blocks"], fi["dec_num_heads"])
    assert (d.hift.base_channels, d.hift.f0_cond_channels) == (fi["hift_base_channels"], fi["hift_cond_channels"])


def test_dims_full_value(md):
    """Everything not shrunk in the fixture keeps the official value, incl. resolved !ref arithmetic."""
    expected = dataclasses.replace(
        ModelDims(),
        lm=LMDims(qwen=Qwen2Dims(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                                 num_kv_heads=2, vocab_size=1024), llm_input_size=64, llm_output_size=64),
        flow=FlowDims(encoder=EncoderDims(linear_units=64, num_blocks=1),
                      estimator=EstimatorDims(channels=(64,), attention_head_dim=16, n_blocks=1,
                                              num_mid_blocks=2, num_heads=2)),
        hift=HiFTDims(base_channels=32, f0_cond_channels=32),
    )
    assert md.dims == expected
    assert md.dims.flow.estimator.static_chunk_size == 50  # !ref <chunk_size> * <token_mel_ratio>
    assert md.dims.flow.cfm.sigma_min == 1e-6 and isinstance(md.dims.flow.cfm.sigma_min, float)
    assert md.dims.feat.fmax == 8000.0 and md.dims.feat.center is False
    assert md.dims.samples_per_token == 960


def test_recipe_kept_as_data(md):
    r = md.recipe
    assert r["__set_seed3"] == Tagged("apply", "torch.manual_seed", [1986])
    assert r["llm"].kind == "new" and r["llm"].target == "cosyvoice.llm.llm.Qwen2LM"
    assert r["llm"].args["sampling"] == Tagged("name", "cosyvoice.utils.common.ras_sampling",
                                              {"top_p": 0.8, "top_k": 25, "win_size": 10, "tau_r": 0.1})
    assert r["hifigan"].args["generator"] == r["hift"]  # !ref <hift> gives the node itself
    assert r["get_tokenizer"].args["token_path"] == str(md.path / "CosyVoice-BlankEN")  # override applied


def test_paths(md, tiny_dir):
    assert md.campplus_onnx == tiny_dir.resolve() / "campplus.onnx" and md.campplus_onnx.is_file()
    assert md.speech_tokenizer_onnx.name == "speech_tokenizer_v2.onnx" and md.speech_tokenizer_onnx.is_file()
    assert md.spk2info_path == tiny_dir.resolve() / "spk2info.pt"


# ------------------------------------------------------------------ yaml loader

def test_yaml_refs_arithmetic_and_nesting():
    r = load_recipe("""
a: 3
b: !ref <a>
c: !ref <b> * <a> + 1
d: {x: !ref <c>, y: [1, !ref <a>]}
e: !ref <d[x]>
f: !ref <d.y[1]> // 2
path: !ref <name>/sub
name: base
g: !new:some.module.Cls
    k: !ref <a>
h: !ref <g>
i: !name:x.y
j: !apply:random.seed [7]
k: !tuple [1, 2]
sci: 1e-06
neg: -2.5e3
word: yes
""", overrides={"a": 4})
    assert (r["b"], r["c"], r["e"], r["f"]) == (4, 17, 17, 2)
    assert r["path"] == "base/sub"
    assert r["g"] == Tagged("new", "some.module.Cls", {"k": 4}) and r["h"] == r["g"]
    assert r["i"] == Tagged("name", "x.y", None) and r["j"] == Tagged("apply", "random.seed", [7])
    assert r["k"] == (1, 2)
    assert r["sci"] == 1e-6 and r["neg"] == -2500.0 and r["word"] == "yes"


@pytest.mark.parametrize("text, message", [
    ("a: !ref <b>\nb: !ref <a>\n", "circular !ref"),
    ("a: !ref <nope>\n", "!ref <nope> refers to a missing key nope"),
    ("a: [1, 2\n", "not valid YAML"),
    ("- 1\n- 2\n", "expected a mapping at the top level"),
])
def test_yaml_errors(text, message):
    with pytest.raises(ModelDirError, match="^cosyvoice2.yaml: ") as e:
        load_recipe(text)
    assert message in str(e.value)


# ------------------------------------------------------------------ state dicts

def test_raw_key_counts(tiny_dir, info):
    counts = {n: len(load_state_dict_file(tiny_dir / f"{n}.pt", f"{n}.pt")) for n in ("llm", "flow", "hift")}
    assert counts == info["state_dict_keys"] == {"llm": 31, "flow": 230, "hift": 328}


def test_llm_state_dict(md, tiny_dir):
    raw = load_state_dict_file(tiny_dir / "llm.pt", "llm.pt")
    sd = md.llm_state_dict()
    assert len(sd) == 30 and "llm.model.lm_head.weight" not in sd
    assert not any(k.startswith("llm.") for k in sd)
    for k in ("llm_embedding.weight", "speech_embedding.weight", "llm_decoder.weight", "llm_decoder.bias"):
        assert torch.equal(sd[k], raw[k])
    key = "layers.1.mlp.down_proj.weight"
    assert torch.equal(sd[f"backbone.{key}"], raw[f"llm.model.model.{key}"])
    assert torch.equal(sd["backbone.norm.weight"], raw["llm.model.model.norm.weight"])
    assert sd["speech_embedding.weight"].shape == (6564, 64)


def test_flow_state_dict_unchanged(md, tiny_dir):
    raw = torch.load(tiny_dir / "flow.pt", weights_only=True)
    sd = md.flow_state_dict()
    assert list(sd) == list(raw) and all(torch.equal(sd[k], raw[k]) for k in raw)


def test_hift_fold_matches_torch_weight_norm(md, tiny_dir):
    raw = torch.load(tiny_dir / "hift.pt", weights_only=True)
    sd = md.hift_state_dict()
    assert len(sd) == 328 - 82
    assert not any("parametrizations" in k or k.endswith(("weight_g", "weight_v")) for k in sd)
    assert torch.equal(sd["source_downs.0.weight"], raw["source_downs.0.weight"])  # not weight-normed
    wn = torch.nn.utils.parametrizations.weight_norm
    for name, layer in (("conv_pre", torch.nn.Conv1d(80, 32, 7, padding=3)),
                        ("ups.0", torch.nn.ConvTranspose1d(32, 16, 16, 8, padding=4)),
                        ("f0_predictor.condnet.4", torch.nn.Conv1d(32, 32, 3, padding=1))):
        layer = wn(layer)
        layer.load_state_dict({k[len(name) + 1:]: v for k, v in raw.items() if k.startswith(name + ".")})
        with torch.no_grad():
            torch.testing.assert_close(sd[f"{name}.weight"], layer.weight, rtol=0, atol=0)
        assert torch.equal(sd[f"{name}.bias"], raw[f"{name}.bias"])


def test_hift_legacy_convention_and_generator_prefix(md, tiny_dir):
    raw = torch.load(tiny_dir / "hift.pt", weights_only=True)
    legacy = {}
    for k, v in raw.items():
        k = k.replace(".parametrizations.weight.original0", ".weight_g")
        k = k.replace(".parametrizations.weight.original1", ".weight_v")
        legacy["generator." + k] = v
    a, b = md.hift_state_dict(), normalize_hift_state_dict(legacy)
    assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_fold_weight_norm_errors():
    v = torch.randn(4, 3, 5)
    with pytest.raises(ModelDirError, match=r"^hift.pt: conv: incomplete weight norm, missing original1 \(v\)"):
        fold_weight_norm({"conv.parametrizations.weight.original0": torch.ones(4, 1, 1)})
    with pytest.raises(ModelDirError, match=r"^hift.pt: conv: incomplete weight norm, missing weight_g"):
        fold_weight_norm({"conv.weight_v": v})
    with pytest.raises(ModelDirError, match=r"g \(3, 1, 1\) does not match v \(4, 3, 5\)"):
        fold_weight_norm({"conv.weight_g": torch.ones(3, 1, 1), "conv.weight_v": v})
    g = torch.ones(4, 1, 1)
    for sd in ({"conv.weight": v, "conv.weight_g": g, "conv.weight_v": v},
               {"conv.weight_g": g, "conv.weight_v": v, "conv.weight": v}):
        with pytest.raises(ModelDirError, match=r"conv.weight is present both plain and weight-normed"):
            fold_weight_norm(sd)
    with pytest.raises(ModelDirError, match=r"conv: weight norm stored twice"):
        fold_weight_norm({"conv.weight_g": g, "conv.parametrizations.weight.original0": g})


# ------------------------------------------------------------------ error cases on copies of the fixture

@pytest.fixture
def copy_dir(tiny_dir, tmp_path):
    """A copy of the fixture: small files copied, the .pt/.onnx files symlinked (replace to modify)."""
    dst = tmp_path / "model"
    (dst / "CosyVoice-BlankEN").mkdir(parents=True)
    for p in tiny_dir.iterdir():
        if p.is_file():
            if p.suffix in (".pt", ".onnx"):
                (dst / p.name).symlink_to(p)
            else:
                shutil.copy(p, dst / p.name)
    for p in (tiny_dir / "CosyVoice-BlankEN").iterdir():
        if p.name != "model.safetensors":  # must not be needed
            shutil.copy(p, dst / "CosyVoice-BlankEN" / p.name)
    return dst


def _replace(path: Path, writer):
    path.unlink()
    writer(path)


def test_copy_without_safetensors_loads(copy_dir):
    md = load_model_dir(copy_dir)
    assert md.dims.lm.qwen.hidden_size == 64 and md.tokenizer().eos_id == 1000


@pytest.mark.parametrize("name, message", [
    ("flow.pt", "flow.pt: missing"),
    ("campplus.onnx", "campplus.onnx: missing"),
    ("CosyVoice-BlankEN/config.json", "CosyVoice-BlankEN/config.json: missing"),
    ("cosyvoice2.yaml", "cosyvoice2.yaml: missing"),
])
def test_missing_file(copy_dir, name, message):
    (copy_dir / name).unlink()
    with pytest.raises(ModelDirError) as e:
        load_model_dir(copy_dir)
    assert str(e.value).startswith(message)
    assert e.value.file == name


def test_a_cosyvoice2_recipe_named_cosyvoice3_is_refused_by_its_classes(copy_dir):
    (copy_dir / "cosyvoice2.yaml").rename(copy_dir / "cosyvoice3.yaml")
    with pytest.raises(ModelDirError, match=r"^cosyvoice3.yaml: llm is cosyvoice.llm.llm.Qwen2LM, "
                                            r"expected CosyVoice3LM \(CosyVoice3\)"):
        load_model_dir(copy_dir)


def test_cosyvoice_v1_is_refused_first_like_automodel(copy_dir):
    """upstream AutoModel tries cosyvoice.yaml before cosyvoice2.yaml: a v1 yaml decides"""
    (copy_dir / "cosyvoice.yaml").write_text("llm: !new:cosyvoice.llm.llm.TransformerLM\n")
    with pytest.raises(ModelDirError, match=r"^cosyvoice.yaml: .* CosyVoice \(v1\) model directory, which this "
                                            r"server does not serve; use CosyVoice2-0.5B"):
        load_model_dir(copy_dir)


def test_no_recipe_names_both_kinds(copy_dir):
    (copy_dir / "cosyvoice2.yaml").unlink()
    with pytest.raises(ModelDirError, match=r"cosyvoice2.yaml \(CosyVoice2\) or cosyvoice3.yaml \(CosyVoice3\)"):
        load_model_dir(copy_dir)


def test_kind_is_read_from_the_directory(tiny_dir):
    md = load_model_dir(tiny_dir)
    assert md.kind == md.dims.kind == md.dims.lm.kind == "cosyvoice2"
    assert md.yaml_file == "cosyvoice2.yaml" and md.speech_tokenizer_onnx.name == "speech_tokenizer_v2.onnx"


def test_corrupt_state_dicts(copy_dir):
    _replace(copy_dir / "flow.pt", lambda p: p.write_bytes(b"PK\x03\x04 definitely not a checkpoint"))
    _replace(copy_dir / "hift.pt", lambda p: torch.save([torch.zeros(1)], p))
    _replace(copy_dir / "llm.pt", lambda p: torch.save({"a": 1}, p))
    md = load_model_dir(copy_dir)  # weights are loaded lazily
    with pytest.raises(ModelDirError, match=r"^flow.pt: not a torch state dict \(.+\)"):
        md.flow_state_dict()
    with pytest.raises(ModelDirError, match=r"^hift.pt: not a torch state dict \(got list\)"):
        md.hift_state_dict()
    with pytest.raises(ModelDirError, match=r"^llm.pt: not a torch state dict \(non-tensor entries \[a\]\)"):
        md.llm_state_dict()


def test_state_dict_missing_keys(copy_dir, tiny_dir):
    llm = torch.load(tiny_dir / "llm.pt", weights_only=True)
    del llm["llm.model.lm_head.weight"], llm["llm_decoder.bias"]
    _replace(copy_dir / "llm.pt", lambda p: torch.save(llm, p))
    hift = torch.load(tiny_dir / "hift.pt", weights_only=True)
    del hift["ups.1.parametrizations.weight.original1"]
    _replace(copy_dir / "hift.pt", lambda p: torch.save(hift, p))
    md = load_model_dir(copy_dir)
    with pytest.raises(ModelDirError, match=r"^llm.pt: missing keys \[llm.model.lm_head.weight, llm_decoder.bias\]"):
        md.llm_state_dict()
    with pytest.raises(ModelDirError, match=r"^hift.pt: ups.1: incomplete weight norm, missing original1"):
        md.hift_state_dict()


def _edit_yaml(d: Path, old: str, new: str) -> None:
    p = d / "cosyvoice2.yaml"
    text = p.read_text()
    assert old in text
    p.write_text(text.replace(old, new, 1))


@pytest.mark.parametrize("old, new, message", [
    ("        estimator: !new:cosyvoice.flow.decoder.CausalConditionalDecoder",
     "        not_the_estimator: !new:cosyvoice.flow.decoder.CausalConditionalDecoder",
     "cosyvoice2.yaml: missing key flow.decoder.estimator"),
    ("            num_mid_blocks: 2\n", "", "cosyvoice2.yaml: missing key flow.decoder.estimator.num_mid_blocks"),
    ("        num_blocks: 1\n", "        num_blocks: many\n",
     "cosyvoice2.yaml: flow.encoder.num_blocks must be an integer, got 'many'"),
    ("llm: !new:cosyvoice.llm.llm.Qwen2LM", "llm: !new:cosyvoice.llm.llm.TransformerLM",
     "cosyvoice2.yaml: llm is cosyvoice.llm.llm.TransformerLM, expected Qwen2LM"),
    ("llm_input_size: 64", "llm_input_size: 896",
     "cosyvoice2.yaml: llm_input_size/llm_output_size 896/64 != CosyVoice-BlankEN/config.json hidden_size 64"),
    ("sample_rate: 24000", "sample_rate: !ref <no_such_key>",
     "cosyvoice2.yaml: !ref <no_such_key> refers to a missing key no_such_key"),
])
def test_yaml_content_errors(copy_dir, old, new, message):
    _edit_yaml(copy_dir, old, new)
    with pytest.raises(ModelDirError) as e:
        load_model_dir(copy_dir)
    assert str(e.value).startswith(message)


def test_qwen_config_errors(copy_dir):
    p = copy_dir / "CosyVoice-BlankEN" / "config.json"
    cfg = json.loads(p.read_text())
    del cfg["num_hidden_layers"]
    p.write_text(json.dumps(cfg))
    with pytest.raises(ModelDirError, match="^CosyVoice-BlankEN/config.json: missing key num_hidden_layers"):
        load_model_dir(copy_dir)
    p.write_text("{not json")
    with pytest.raises(ModelDirError, match="^CosyVoice-BlankEN/config.json: not valid JSON"):
        load_model_dir(copy_dir)


def test_tokenizer_file_missing(copy_dir):
    (copy_dir / "CosyVoice-BlankEN" / "merges.txt").unlink()
    md = load_model_dir(copy_dir)
    with pytest.raises(ModelDirError, match=r"^CosyVoice-BlankEN/merges.txt: missing"):
        md.tokenizer()


def test_load_strict_reports_keys_and_shapes():
    module = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4))
    good = {k: torch.randn_like(v) for k, v in module.state_dict().items()}
    load_strict(module, good, "flow.pt")
    assert torch.equal(module[0].weight, good["0.weight"])
    bad = dict(good)
    del bad["1.bias"]
    bad["2.extra"] = torch.zeros(1)
    bad["0.weight"] = torch.zeros(4, 5)
    with pytest.raises(ModelDirError) as e:
        load_strict(module, bad, "flow.pt")
    msg = str(e.value)
    assert msg.startswith("flow.pt: missing keys [1.bias]; unexpected keys [2.extra]; "
                          "shape mismatches [0.weight (file (4, 5), model (4, 3))]")


def test_build_models_fixture(md):
    pytest.importorskip("async_cosyvoice.models.llm")
    pytest.importorskip("async_cosyvoice.models.flow.flow")
    pytest.importorskip("async_cosyvoice.models.hift")
    from async_cosyvoice.model_dir import build_models
    models = build_models(md, dtype=torch.bfloat16)
    assert next(models.llm.parameters()).dtype == torch.bfloat16
    assert next(models.flow.parameters()).dtype == torch.bfloat16
    assert all(p.dtype == torch.float32 for p in models.hift.parameters())
    assert not models.hift.training
    hift = md.hift_state_dict()
    got = models.hift.state_dict()
    assert all(torch.equal(got[k], hift[k]) for k in hift)


# ------------------------------------------------------------------ tokenizer

@pytest.fixture(scope="module")
def tok(tiny_dir):
    return TextTokenizer.from_dir(tiny_dir / "CosyVoice-BlankEN")


def test_tokenizer_golden_texts(tok, golden_dir):
    inputs = json.loads((golden_dir / "inputs.json").read_text())
    golden = np.load(golden_dir / "frontend.npz")
    for name, text in inputs["texts"].items():
        assert tok.encode(text) == golden[f"text_tokens/{name}"][0].tolist(), name
    for token, i in inputs["special_token_ids"].items():
        assert tok.token_id(token) == i


def test_tokenizer_special_order(tok):
    ids = tok.special_ids
    assert list(ids) == ["<|endoftext|>", *COSYVOICE2_SPECIAL_TOKENS]
    assert list(ids.values()) == list(range(1000, 1020)) and len(tok) == 1020
    assert tok.encode("a<|endofprompt|>b[breath]") [1] == 1003
    assert tok.encode("[breath]")[0] == 1004


def test_tokenizer_text_frontend_segments(tok, golden_dir):
    entries = json.loads((golden_dir / "text_frontend.json").read_text())
    n = 0
    for e in entries:
        for seg, ids in zip(e["segments"], e["segment_token_ids"]):
            assert tok.encode(seg) == ids, seg
            n += 1
    assert n == 36


def test_tokenizer_decode_and_cache(tok, tiny_dir):
    text = "今天[laughter]天气 hello, world!"
    ids = tok.encode(text)
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.decode(ids) == "今天天气 hello, world!"
    assert TextTokenizer.from_dir(tiny_dir / "CosyVoice-BlankEN")._tok is tok._tok
    with pytest.raises(KeyError):
        tok.token_id("<|not_a_token|>")


def test_tokenizer_matches_transformers(tok, tiny_dir, golden_dir):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(tiny_dir / "CosyVoice-BlankEN"))
    hf.add_special_tokens({"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>",
                           "additional_special_tokens": list(COSYVOICE2_SPECIAL_TOKENS)})
    texts = [s for e in json.loads((golden_dir / "text_frontend.json").read_text()) for s in e["segments"]]
    texts += ["Emoji 😀 and ΑΒΓ, tabs\tand\nnewlines  ", "<strong>x</strong>[mn]<|im_start|>"]
    for t in texts:
        assert tok.encode(t) == hf([t])["input_ids"][0], t
