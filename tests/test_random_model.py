"""random_model/ and tools/make_random_model.py: official-format random model directories."""
from __future__ import annotations

import json
import math
import shutil

import numpy as np
import pytest
import torch

from async_cosyvoice.model_dir import fold_weight_norm, load_model_dir, load_state_dict_file, model_dims_from_recipe
from async_cosyvoice.models.dims import ModelDims
from async_cosyvoice.random_model import PRESETS, ensure_random_model, is_random_model, make_random_model
from async_cosyvoice.random_model.recipe import recipe_yaml
from async_cosyvoice.random_model.weights import flow_specs, hift_specs, llm_specs
from async_cosyvoice.recipe import load_recipe
from async_cosyvoice.tools import make_random_model as mrm

OFFICIAL_FILE_BYTES = {"llm": 2_023_316_821, "flow": 450_575_567, "hift": 83_390_254}  # facts sheet §1.1


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_random_model("tiny", tmp_path_factory.mktemp("rm") / "tiny", seed=0)


def _raw(d, name):
    return load_state_dict_file(d / f"{name}.pt", f"{name}.pt")


# ------------------------------------------------------------------ layout

def test_tiny_round_trips_through_load_model_dir(tiny, tiny_dir):
    md = load_model_dir(tiny)
    assert md.dims == PRESETS["tiny"].dims == load_model_dir(tiny_dir).dims
    assert sorted(p.name for p in tiny.iterdir()) == sorted([
        "CosyVoice-BlankEN", "campplus.onnx", "configuration.json", "cosyvoice2.yaml", "flow.pt", "hift.pt",
        "llm.pt", "speech_tokenizer_v2.onnx", "spk2info.pt"])
    assert not (tiny / "CosyVoice-BlankEN" / "model.safetensors").exists()
    assert torch.load(md.spk2info_path, weights_only=True) == {}
    assert len(md.llm_state_dict()) == 30 and len(md.flow_state_dict()) == 230 and len(md.hift_state_dict()) == 246


@pytest.mark.parametrize("name", ["llm", "flow", "hift"])
def test_tiny_keys_and_shapes_equal_fixture(tiny, tiny_dir, name):
    ours, theirs = _raw(tiny, name), _raw(tiny_dir, name)
    assert [(k, v.shape, v.dtype) for k, v in ours.items()] == [(k, v.shape, v.dtype) for k, v in theirs.items()]


def test_yaml_has_official_tag_structure(tiny, tiny_dir):
    ours = load_recipe((tiny / "cosyvoice2.yaml").read_text())
    theirs = load_recipe((tiny_dir / "cosyvoice2.yaml").read_text())

    def shape(node):
        if hasattr(node, "kind"):
            return (node.kind, node.target, shape(node.args))
        if isinstance(node, dict):
            return {k: shape(v) for k, v in node.items()}
        if isinstance(node, list):
            return [shape(v) for v in node]
        return type(node).__name__

    assert shape(ours) == shape(theirs)
    text = (tiny / "cosyvoice2.yaml").read_text()
    assert "static_chunk_size: !ref <chunk_size> * <token_mel_ratio>" in text


def test_weights_are_sane(tiny):
    llm, flow, hift = _raw(tiny, "llm"), _raw(tiny, "flow"), _raw(tiny, "hift")
    tied = llm["llm.model.lm_head.weight"]
    assert tied.untyped_storage().data_ptr() == llm["llm.model.model.embed_tokens.weight"].untyped_storage().data_ptr()
    assert abs(llm["speech_embedding.weight"].std().item() - 0.02) < 2e-3
    assert abs(llm["llm.model.model.norm.weight"].mean().item() - 1) < 0.02
    assert abs(flow["encoder.after_norm.weight"].mean().item() - 1) < 0.02
    alpha = hift["resblocks.0.activations1.0.alpha"]
    assert 0.7 < alpha.min() and alpha.max() < 1.3
    # weight norm: g = ||v|| per dim-0 row, so the folded weight is v itself
    folded = fold_weight_norm(hift)
    for layer in ("conv_pre", "ups.0", "resblocks.4.convs2.1", "conv_post"):
        v = hift[f"{layer}.parametrizations.weight.original1"]
        torch.testing.assert_close(folded[f"{layer}.weight"], v)
        assert hift[f"{layer}.parametrizations.weight.original0"].shape == (v.shape[0], 1, 1)
    assert hift["ups.1.parametrizations.weight.original0"].shape == (16, 1, 1)  # ConvTranspose: per input channel
    assert all(torch.isfinite(t).all() for sd in (llm, flow, hift) for t in sd.values())


def test_tokenizer_encodes_any_text(tiny):
    md = load_model_dir(tiny)
    tok = md.tokenizer()
    assert md.dims.lm.qwen.vocab_size >= len(tok) == 1020
    assert tok.eos_id == json.loads((tiny / "CosyVoice-BlankEN" / "config.json").read_text())["eos_token_id"]
    for text in ["Hello, world!", "今天的天气很好。", "emoji 😀, Ελληνικά, العربية\ttab\nline",
                 "用四川话说这句话<|endofprompt|>[laughter]<strong>强调</strong>"]:
        ids = tok.encode(text)
        assert ids and all(0 <= i < len(tok) for i in ids)
        assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.encode("[breath]") == [tok.token_id("[breath]")]


def test_seed_determinism_and_reuse(tiny, tmp_path):
    again = make_random_model("tiny", tmp_path / "again", seed=0)
    other = make_random_model("tiny", tmp_path / "other", seed=1)
    for name in ("llm", "hift"):
        a, b, c = _raw(tiny, name), _raw(again, name), _raw(other, name)
        assert all(torch.equal(a[k], b[k]) for k in a)
        assert not all(torch.equal(a[k], c[k]) for k in a)
    assert (tiny / "campplus.onnx").read_bytes() == (again / "campplus.onnx").read_bytes()
    vocab = "CosyVoice-BlankEN/vocab.json"
    assert (tiny / vocab).read_bytes() == (other / vocab).read_bytes()  # the tokenizer does not depend on the seed
    assert is_random_model(again, "tiny", 0) and not is_random_model(again, "tiny", 1)
    mtime = (again / "llm.pt").stat().st_mtime_ns
    assert make_random_model("tiny", again, seed=0) == again  # reused, not rewritten
    assert (again / "llm.pt").stat().st_mtime_ns == mtime
    with pytest.raises(FileExistsError):
        make_random_model("tiny", again, seed=1)
    # a cache written by an older generator version is regenerated in place
    cfg = again / "configuration.json"
    info = json.loads(cfg.read_text())
    info["random_model"]["generator_version"] = 0
    cfg.write_text(json.dumps(info))
    assert make_random_model("tiny", again, seed=0) == again and is_random_model(again, "tiny", 0)
    assert all(torch.equal(a, b) for a, b in zip(_raw(tiny, "flow").values(), _raw(again, "flow").values()))
    # a benchmark's scratch folder: reused when it holds the asked (preset, seed), else replaced
    mtime = (again / "llm.pt").stat().st_mtime_ns
    assert ensure_random_model("tiny", again, seed=0) == again
    assert (again / "llm.pt").stat().st_mtime_ns == mtime
    assert ensure_random_model("tiny", again, seed=1) == again and is_random_model(again, "tiny", 1)
    with pytest.raises(ValueError, match="unknown preset"):
        make_random_model("huge", tmp_path / "x")
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())  # no temp dirs left behind


def test_cli(tmp_path, capsys):
    out = tmp_path / "cli"
    assert mrm.main(["--preset", "tiny", "--out", str(out), "--seed", "5"]) == 0
    assert capsys.readouterr().out.strip() == str(out.resolve())
    assert is_random_model(out, "tiny", 5)
    assert mrm.main(["--preset", "tiny", "--out", str(out), "--seed", "6"]) == 2


# ------------------------------------------------------------------ ONNX stand-ins

def test_campplus_standin(tiny):
    ort = pytest.importorskip("onnxruntime")
    s = ort.InferenceSession(str(tiny / "campplus.onnx"), providers=["CPUExecutionProvider"])
    (i,), (o,) = s.get_inputs(), s.get_outputs()
    assert (i.name, i.type, i.shape) == ("input", "tensor(float)", ["B", "T", 80])
    assert (o.name, o.type, o.shape) == ("output", "tensor(float)", ["B", 192])
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 57, 80)).astype(np.float32)
    y = s.run(None, {"input": x})[0]
    assert y.shape == (2, 192) and np.isfinite(y).all()
    assert np.abs(y[0] - y[1]).max() > 1e-3  # depends on the input
    np.testing.assert_allclose(s.run(None, {"input": x[:1]})[0], y[:1], rtol=1e-5, atol=1e-6)


def test_speech_tokenizer_standin(tiny, golden_dir):
    ort = pytest.importorskip("onnxruntime")
    s = ort.InferenceSession(str(tiny / "speech_tokenizer_v2.onnx"), providers=["CPUExecutionProvider"])
    ins, (o,) = s.get_inputs(), s.get_outputs()
    assert [(i.name, i.type, i.shape) for i in ins] == [
        ("feats", "tensor(float)", ["B", 128, "T"]), ("feats_length", "tensor(int32)", ["B"])]
    assert (o.name, o.type, o.shape) == ("indices", "tensor(int32)", ["B", "T_tok"])
    for T in (1, 4, 5, 99, 100, 301):
        feats = np.random.default_rng(T).standard_normal((1, 128, T)).astype(np.float32)
        idx = s.run(None, {"feats": feats, "feats_length": np.array([T], np.int32)})[0]
        assert idx.shape == (1, ((T - 1) // 2) // 2 + 1) and idx.dtype == np.int32
    # real whisper log-mel input (golden frontend feeds): valid codes that vary with the input
    z = np.load(golden_dir / "frontend.npz")
    feats, length = z["p24/whisper_logmel"], z["p24/whisper_feats_length"]
    idx = s.run(None, {"feats": feats, "feats_length": length})[0]
    assert idx.shape == z["p24/tokenizer_indices_raw"].shape
    assert idx.min() >= 0 and idx.max() <= 6560 and len(np.unique(idx)) > 10
    # frames past feats_length do not matter
    n = 200
    a = feats.copy()
    a[:, :, n:] = 0
    b = feats.copy()
    b[:, :, n:] = 5
    ia = s.run(None, {"feats": a, "feats_length": np.array([n], np.int32)})[0]
    ib = s.run(None, {"feats": b, "feats_length": np.array([n], np.int32)})[0]
    assert np.array_equal(ia, ib)


# ------------------------------------------------------------------ modules (once they exist)

def test_tiny_builds_and_synthesizes_finite_audio(tiny):
    pytest.importorskip("async_cosyvoice.models.llm")
    pytest.importorskip("async_cosyvoice.models.flow.flow")
    pytest.importorskip("async_cosyvoice.models.hift")
    from async_cosyvoice.model_dir import build_models
    from async_cosyvoice.sampling import ras_sample

    md = load_model_dir(tiny)
    models = build_models(md)
    text = md.tokenizer().encode("Hi there.")
    gen = torch.Generator().manual_seed(0)
    max_len = 20 * len(text)
    tokens = models.llm.generate_reference(text, [], min_len=2 * len(text), max_len=max_len,
                                           sampler=lambda logp, out: ras_sample(logp, out, generator=gen))
    assert 2 * len(text) <= len(tokens) < max_len  # the raised EOS logit ends generation
    assert all(0 <= t < 6561 for t in tokens)
    mel = models.flow.inference(torch.tensor([tokens]), torch.zeros(1, 0, dtype=torch.long),
                                torch.zeros(1, 0, 80), torch.randn(1, 192, generator=gen),
                                streaming=False, finalize=True)
    assert mel.shape == (1, 80, 2 * len(tokens)) and torch.isfinite(mel).all()
    assert abs(mel.mean().item() + 5) < 1  # a natural log-mel level
    speech, _ = models.hift.inference(mel)
    assert speech.shape == (1, 960 * len(tokens)) and torch.isfinite(speech).all()
    assert 1e-3 < speech.std() and speech.abs().max() < 0.9  # quiet noise, not clipped


# ------------------------------------------------------------------ the 0.5B preset

def test_05b_preset_dims_are_official():
    d = PRESETS["cosyvoice2-0.5b"].dims
    assert d == ModelDims()
    q = d.lm.qwen
    assert (q.num_layers, q.hidden_size, q.num_heads, q.num_kv_heads, q.intermediate_size, q.vocab_size) == (
        24, 896, 14, 2, 4864, 151936)
    assert (d.flow.encoder.output_size, d.flow.encoder.num_blocks) == (512, 6)
    assert (d.flow.estimator.channels, d.flow.estimator.num_mid_blocks, d.flow.estimator.n_blocks) == ((256,), 12, 4)
    assert d.hift.base_channels == 512
    # the yaml the tool writes parses back to the same dims (no weights needed)
    assert model_dims_from_recipe(load_recipe(recipe_yaml(d)), q) == d


def test_05b_parameter_layout_matches_official_file_sizes():
    d = PRESETS["cosyvoice2-0.5b"].dims
    for name, specs in (("llm", llm_specs(d.lm)), ("flow", flow_specs(d.flow)),
                        ("hift", hift_specs(d.hift))):
        n_bytes = 4 * sum(math.prod(shape) for _, shape, init in specs if init[0] != "tied")
        overhead = OFFICIAL_FILE_BYTES[name] - n_bytes  # zip + pickle metadata, a few hundred bytes per key
        assert 0 < overhead < 400 * len(specs), (name, overhead)


@pytest.mark.slow
def test_05b_full_generation(tmp_path):
    """~2.5 GB written (10-35 s, ~2.2 GB RAM on the 2-core box); removed afterwards."""
    try:
        out = make_random_model("cosyvoice2-0.5b", tmp_path / "full", seed=0)
        md = load_model_dir(out)
        assert md.dims == ModelDims()
        for name in ("llm", "flow", "hift"):
            size = (out / f"{name}.pt").stat().st_size
            assert abs(size - OFFICIAL_FILE_BYTES[name]) / OFFICIAL_FILE_BYTES[name] < 1e-3, (name, size)
        llm = md.llm_state_dict()
        assert llm["backbone.embed_tokens.weight"].shape == (151936, 896) and len(llm) == 294
        del llm
        assert len(md.hift_state_dict()) == 246 and len(md.flow_state_dict()) == 1121
        assert len(md.tokenizer()) == 1020
    finally:
        shutil.rmtree(tmp_path / "full", ignore_errors=True)
