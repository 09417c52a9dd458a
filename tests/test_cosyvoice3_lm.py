"""CosyVoice3's model directory, tokenizer, LM, prompts and sampler against the public fixture's
upstream goldens (fp32 CPU, one thread): the loader reads the kind and every dimension from the
directory, the reproducer matches every frontend / model-input / LM / sampler golden, seeded
generation is token-identical to upstream, and the native engine serves the CosyVoice3 LM."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import shutil

import numpy as np
import pytest
import torch

from async_cosyvoice.engine.base import GenerationRequest, length_limits
from async_cosyvoice.engine.bistream import BistreamSchedule, UnexpectedStopToken, Verdict
from async_cosyvoice.engine.native import NativeEngine, NativeEngineConfig
from async_cosyvoice.engine.silence import SilenceCap
from async_cosyvoice.errors import ModelDirError
from async_cosyvoice.frontend.model_input import MODE_SPECS, SystemPrompt, build_model_input, instruction_text
from async_cosyvoice.model_dir import build_models, load_model_dir, load_strict
from async_cosyvoice.models.dims import RASParams, SpeechIds
from async_cosyvoice.models.llm import CosyVoice2LM, CosyVoice3LM, Table
from async_cosyvoice.request import Mode, Voice
from async_cosyvoice.sampling import ras_sample
from async_cosyvoice.tools.golden_compare import compare_dirs, format_table
from async_cosyvoice.tools.reproduce_golden import reproduce

GOLDEN_FILES = ("frontend.npz", "model_inputs.npz", "llm.npz", "ras.npz", "flow.npz", "hift.npz",
                *(f"e2e_vc_{run}.npz" for run in ("nonstream", "stream_hop15", "stream_hop25", "stream_hop25_p16")),
                *(f"e2e_llm_{mode}_{kind}.npz" for mode in ("zero_shot", "cross_lingual", "instruct2")
                  for kind in ("nonstream", "stream")))


@pytest.fixture(scope="module")
def md(tiny3_dir):
    return load_model_dir(tiny3_dir)


@pytest.fixture(scope="module")
def lm3(md):
    return build_models(md, with_token2wav=False).llm


@pytest.fixture(scope="module")
def inputs(tiny3_dir):
    return json.loads((tiny3_dir / "golden" / "inputs.json").read_text(encoding="utf-8"))


# -- the model directory ----------------------------------------------------------------------------

def test_kind_and_dims_come_from_the_directory(md, tiny3_dir):
    assert md.kind == md.dims.kind == md.dims.lm.kind == "cosyvoice3"
    assert md.yaml_file == "cosyvoice3.yaml" and md.speech_tokenizer_onnx.name == "speech_tokenizer_v3.onnx"
    info = json.loads((tiny3_dir / "golden" / "fixture_info.json").read_text())["dims"]
    q = md.dims.lm.qwen
    assert (q.hidden_size, q.intermediate_size, q.num_layers, q.num_heads, q.num_kv_heads) == (
        info["qwen_hidden"], info["qwen_intermediate"], info["qwen_layers"], info["qwen_heads"], info["qwen_kv_heads"])
    e = md.dims.flow.estimator
    assert (md.dims.flow.lookahead_channels, e.dim, e.depth, e.heads, e.dim_head, e.ff_mult) == (
        info["lookahead_channels"], info["dit_dim"], info["dit_depth"], info["dit_heads"], info["dit_dim_head"],
        info["dit_ff_mult"])
    assert (md.dims.hift.base_channels, md.dims.hift.f0_cond_channels) == (
        info["hift_base_channels"], info["hift_cond_channels"])
    assert md.dims.hift.causal and md.dims.hift.conv_pre_look_right == 4
    assert md.dims.feat.fmax is None  # 12 kHz prompt mel (CosyVoice2: 8 kHz)
    assert md.dims.flow.estimator.static_chunk_size == 50  # !ref <chunk_size> * <token_mel_ratio>


def test_llm_loads_strictly_with_cosyvoice3_tables(md, lm3, tiny_dir):
    assert isinstance(lm3, CosyVoice3LM)
    assert not hasattr(lm3, "llm_embedding") and lm3.llm_decoder.bias is None
    assert lm3.speech_embedding.num_embeddings == lm3.llm_decoder.out_features == 6561 + 200
    sd = md.llm_state_dict()
    with pytest.raises(ModelDirError, match=r"^llm.pt: missing keys \[llm_embedding.weight"):
        load_strict(CosyVoice2LM(dataclasses.replace(md.dims.lm, kind="cosyvoice2")), sd, "llm.pt")
    with pytest.raises(ValueError, match="CosyVoice3LM needs LMDims"):
        CosyVoice3LM(load_model_dir(tiny_dir).dims.lm)


def test_a_missing_v3_tokenizer_is_named(md, tmp_path):
    dst = tmp_path / "model"
    shutil.copytree(md.path, dst, ignore=shutil.ignore_patterns("golden", "*.pt", "speech_tokenizer_v3.onnx"))
    for name in ("llm.pt", "flow.pt", "hift.pt"):
        (dst / name).symlink_to(md.path / name)
    with pytest.raises(ModelDirError, match=r"^speech_tokenizer_v3.onnx: missing"):
        load_model_dir(dst)


def test_a_cosyvoice3_llm_without_its_head_is_refused(md, tmp_path):
    sd = torch.load(md.path / "llm.pt", weights_only=True)
    del sd["llm_decoder.weight"]
    torch.save(sd, tmp_path / "llm.pt")
    from async_cosyvoice.model_dir import load_state_dict_file, normalize_llm_state_dict
    with pytest.raises(ModelDirError, match=r"^llm.pt: missing keys \[llm_decoder.weight\]"):
        normalize_llm_state_dict(load_state_dict_file(tmp_path / "llm.pt", "llm.pt"), kind="cosyvoice3")


# -- tokenizer and prompts --------------------------------------------------------------------------

def test_tokenizer_adds_278_tokens_at_upstream_ids(md, inputs):
    tok = md.tokenizer()
    assert len(tok) == 151646 + 278
    for token, i in inputs["special_token_ids"].items():
        assert tok.token_id(token) == i
    assert tok.token_id("<|endofprompt|>") == 151646
    golden = np.load(md.path / "golden" / "frontend.npz")
    for name, text in inputs["texts"].items():
        assert tok.encode(text) == golden[f"text_tokens/{name}"][0].tolist(), name


def test_system_prompt_is_added_only_where_the_marker_is_missing(md):
    tok = md.tokenizer()
    system = SystemPrompt.for_tokenizer(tok.encode, "cosyvoice3")
    assert system.tokens == tuple(tok.encode("You are a helpful assistant.<|endofprompt|>"))
    assert system.endofprompt == 151646
    assert SystemPrompt.for_tokenizer(tok.encode, "cosyvoice2") is None
    voice = Voice(np.arange(10, dtype=np.int32), np.zeros((20, 80), np.float32), np.ones(192, np.float32),
                  "hello", tok.encode("hello"))
    text = tok.encode("Good morning.")
    zs = build_model_input(Mode.ZERO_SHOT, voice, text_tokens=text, system_prompt=system)
    assert zs.prompt_text.tolist() == tok.encode("You are a helpful assistant.<|endofprompt|>hello")
    assert zs.text.tolist() == text
    cross = build_model_input(Mode.CROSS_LINGUAL, voice, text_tokens=text, system_prompt=system)
    assert cross.text.tolist() == tok.encode("You are a helpful assistant.<|endofprompt|>Good morning.")
    assert cross.prompt_text.size == 0  # the prefix counts toward the length limits, as upstream's
    already = tok.encode("You are a helpful assistant.<|endofprompt|>Good morning.")
    assert build_model_input(Mode.CROSS_LINGUAL, voice, text_tokens=already,
                             system_prompt=system).text.tolist() == already
    sft = build_model_input(Mode.SFT, Voice.embedding_only(np.ones(192, np.float32)), text_tokens=text,
                            system_prompt=system)
    assert sft.text.tolist()[:len(system.tokens)] == list(system.tokens)
    assert instruction_text("请用四川话表达。", "cosyvoice3") == \
        "You are a helpful assistant. 请用四川话表达。<|endofprompt|>"
    assert instruction_text("Speak slowly.<|endofprompt|>", "cosyvoice3") == "Speak slowly.<|endofprompt|>"
    assert instruction_text("Speak slowly.", "cosyvoice2") == "Speak slowly.<|endofprompt|>"
    instruct = build_model_input(Mode.INSTRUCT2, voice, text_tokens=text, system_prompt=system,
                                 instruction_tokens=tok.encode(instruction_text("Speak slowly.", "cosyvoice3")))
    assert instruct.prompt_text.tolist() == tok.encode("You are a helpful assistant. Speak slowly.<|endofprompt|>")
    assert MODE_SPECS[Mode.INSTRUCT2].lm_prompt_speech is False and instruct.llm_prompt_speech_token.size == 0


# -- every golden through the reproducer -----------------------------------------------------------

@pytest.fixture(scope="module")
def rows(tiny3_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("golden3")
    reproduce(tiny3_dir, out)
    return compare_dirs(tiny3_dir / "golden", out)


def test_every_golden_of_the_fixture(rows):
    """frontend, model inputs, LM, sampler, flow, vocoder and end to end (the production streaming
    path; the seeded LLM runs' tokens drawn as upstream draws them) within tolerance."""
    print("\n" + format_table(rows))
    assert {r.file for r in rows} == set(GOLDEN_FILES)
    failures = [r for r in rows if not r.ok]
    assert not failures, "\n" + format_table(failures)
    keys = {(r.file, r.key) for r in rows}
    for required in [("llm.npz", "zero_shot/logits"), ("llm.npz", "instruct2/sampler_masked_ids"),
                     ("llm.npz", "silent_filter/kept"), ("llm.npz", "cross_lingual/full_forward_logp"),
                     ("ras.npz", "peaked_at_6562_ignore_eos/seed0/result"),
                     ("model_inputs.npz", "zero_shot_spk/prompt_text"), ("frontend.npz", "p16/tokenizer_indices_raw"),
                     ("flow.npz", "chunk/est_step10_out"), ("hift.npz", "real/nonfinal/speech"),
                     ("e2e_vc_stream_hop15.npz", "audio_zero_noise"), ("e2e_llm_zero_shot_stream.npz", "speech_tokens"),
                     ("e2e_llm_instruct2_stream.npz", "audio")]:
        assert required in keys
    # the seeded draws match too (informational for CosyVoice2, which shares no RNG order)
    assert all(r.max_abs == 0 for r in rows if r.file == "ras.npz" and r.key.endswith("/result"))


# -- sampling rules and seeded generation -----------------------------------------------------------

def test_speech_ids_of_both_kinds():
    v3, v2 = SpeechIds.of("cosyvoice3"), SpeechIds.of("cosyvoice2")
    assert (v3.sos, v3.eos, v3.task, v3.fill, v3.vocab, v3.min_len_masked) == (6561, 6562, 6563, 6564, 6761, 6561)
    assert (v2.sos, v2.eos, v2.fill, v2.vocab, v2.min_len_masked) == (None, 6561, 6563, 6564, 6561)
    assert v3.stop_ids == tuple(range(6561, 6761)) and not v3.is_stop(6560) and v3.is_stop(6760)


def test_an_early_stop_id_ends_generation_before_min_len(lm3):
    """min_len masks 6561 only: a sampled 6562 or 6700 stops at once; 6561 never comes before min_len."""
    seen = []

    def sampler(logp, out):
        seen.append(float(logp[6561]))
        return 6700 if len(out) == 3 else 100

    out = lm3.generate_reference([151646, 5, 6], [1, 2], min_len=10, max_len=20, sampler=sampler)
    assert out == [100, 100, 100]
    assert all(v == -np.inf for v in seen)


@pytest.mark.parametrize("case", ["zero_shot", "cross_lingual", "instruct2"])
def test_seeded_generation_is_token_identical_to_upstream(md, lm3, inputs, case, _one_thread):
    """upstream's entry point with torch.manual_seed(seed): the same RAS draws in the same order,
    the silence cap after; both e2e goldens of the mode hold these tokens."""
    tok, texts = md.tokenizer(), inputs["texts"]
    mi = np.load(md.path / "golden" / "model_inputs.npz")
    prompt, text, speech = {
        "zero_shot": (tok.encode(texts["prompt_text"]), tok.encode(texts["tts_short"]),
                      mi["zero_shot/llm_prompt_speech_token"][0].tolist()),
        "cross_lingual": ([], tok.encode(texts["cross_short"]), []),
        "instruct2": (tok.encode(texts["instruct_text"]), tok.encode(texts["tts_short"]), []),
    }[case]
    golden = np.load(md.path / "golden" / f"e2e_llm_{case}_stream.npz")
    torch.manual_seed(int(golden["torch_seed"][0]))
    min_len, max_len = length_limits(len(text))
    out = lm3.generate_reference(prompt + text, speech, min_len, max_len,
                                 lambda logp, decoded: ras_sample(logp, decoded, md.dims.sampling))
    kept = SilenceCap(lm3.dims.silent_tokens).filter(out)
    assert kept == golden["speech_tokens"][0].tolist()
    assert kept == np.load(md.path / "golden" / f"e2e_llm_{case}_nonstream.npz")["speech_tokens"][0].tolist()


def test_silence_cap_keeps_five_in_a_row():
    cap = SilenceCap({1, 2})
    assert cap.filter([1, 1, 2, 1, 2, 1, 2, 7, 1, 1]) == [1, 1, 2, 1, 2, 7, 1, 1]
    assert cap.dropped == 2
    assert SilenceCap(()).filter([1] * 9) == [1] * 9  # CosyVoice2: no silent tokens


# -- the native engine on the CosyVoice3 LM ----------------------------------------------------------

def test_native_engine_greedy_matches_the_reference_loop(md, tiny3_dir):
    lm = build_models(md, with_token2wav=False).llm
    ref = lm.generate_reference([151646, 10, 11, 12], [3, 4, 5], min_len=4, max_len=30,
                                sampler=lambda logp, out: int(logp.argmax()))
    greedy = RASParams(top_k=1)

    async def run():
        engine = NativeEngine(build_models(md, with_token2wav=False).llm,
                              NativeEngineConfig(max_num_seqs=4, max_model_len=256, warm_up_at_start=False))
        await engine.start()
        try:
            req = GenerationRequest("a", (151646, 10, 11, 12), (3, 4, 5), min_tokens=4, max_tokens=30, ras=greedy)
            return [t async for batch in engine.generate(req) for t in batch]
        finally:
            await engine.stop()

    assert asyncio.run(run()) == ref


def test_bistream_schedule_puts_the_system_prompt_after_sos():
    ids = SpeechIds.of("cosyvoice3")
    prompt = [7, 8, 151646, 20, 21, 22]
    s = BistreamSchedule(prompt, [], (5, 15), ids=ids, system_len=3)
    assert s.next_input() is None  # waits for the first text token
    s.add_text([30])
    first = s.next_input()
    # upstream: [sos; prompt text up to <|endofprompt|>]; no prompt speech, so decoding starts at once
    assert first == ((Table.SPEECH, (6561,)), (Table.TEXT, (7, 8, 151646)))
    assert s.fill_index == 15
    with pytest.raises(UnexpectedStopToken):
        s.accept(6562)  # CosyVoice3's EOS while text streams: upstream raises
    s2 = BistreamSchedule(prompt, [], (5, 15), ids=ids, system_len=3)
    s2.add_text([30])
    s2.next_input()
    for _ in range(15):
        assert s2.accept(5) is Verdict.EMIT
    assert s2.accept(6564) is Verdict.FILL  # CosyVoice3's fill
    s2.end_text()
    final = s2.next_input()
    assert final[-1] == (Table.SPEECH, (6563,))  # task
    assert s2.accept(6562) is Verdict.END
    s3 = BistreamSchedule(prompt, [], (5, 15), ids=ids, system_len=3)
    s3.end_text()
    assert s3.next_input()[-1] == (Table.SPEECH, (6563,))
    assert s3.accept(6700) is Verdict.END  # after the text, any CosyVoice3 stop id ends it (unistream's rule)
    with pytest.raises(ValueError, match="must begin with its system part"):
        BistreamSchedule([1, 2], [], (5, 15), ids=ids)
