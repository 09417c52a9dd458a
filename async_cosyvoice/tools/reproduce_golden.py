"""Recompute a fixture's golden outputs from its inputs only.

    python -m async_cosyvoice.tools.reproduce_golden MODEL_DIR OUT_DIR

Reads MODEL_DIR/golden/inputs.json, prompt_16k.wav, prompt_24k.wav, the model dir's spk2info.pt,
and only the input keys of the golden npz files (flow: token, prompt_token, prompt_feat,
embedding; hift: mel1, mel2, zero/cache_source_for_2, seeded/torch_seed and draws; ras: scores,
histories and ignore_eos; e2e: token, prompt, token_hop_len; llm: forced tokens, the silence
cap's sampled ids). Writes OUT_DIR files named and keyed like the golden ones, so `compare` can
diff them array by array. A CosyVoice3 directory (its kind is read from the directory) gets the
same stages with CosyVoice3's ids, system prompt and silence cap.
"""
from __future__ import annotations

import argparse
import ast
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..engine.base import length_limits
from ..engine.silence import SilenceCap
from ..frontend import audio as A
from ..frontend.model_input import SystemPrompt, build_model_input
from ..frontend.prompt import PromptEncoder
from ..frontend.spk2info import load_spk2info
from ..frontend.text import write_text_golden
from ..model_dir import ModelDir, Models, build_models, load_model_dir
from ..models.cosyvoice3.nsf_noise import FixedNSFNoise
from ..models.hift import NSFNoise
from ..request import Mode, Voice
from ..sampling import nucleus, ras_sample
from ..token2wav import ChunkRecord, ChunkSchedule, Token2WavRunner, Token2WavStream
from ..token2wav.offline import render_offline

PROMPT_WAVS = {"p24": "prompt_24k.wav", "p16": "prompt_16k.wav"}


@dataclass
class Context:
    model_dir: ModelDir
    golden: Path
    models: Models
    encoder: PromptEncoder
    inputs: dict

    def npz(self, name: str) -> np.lib.npyio.NpzFile:
        return np.load(self.golden / name)

    def t(self, a) -> torch.Tensor:
        return torch.from_numpy(np.array(a))


def _np(x) -> np.ndarray:
    return x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)


# -- frontend -----------------------------------------------------------------------------------

def frontend(ctx: Context) -> dict[str, np.ndarray]:
    tok = ctx.model_dir.tokenizer()
    out = {f"text_tokens/{name}": np.asarray(tok.encode(text), np.int32)[None]
           for name, text in ctx.inputs["texts"].items()}
    for key, wav in PROMPT_WAVS.items():
        audio = A.load_audio(ctx.golden / wav)
        x16k = A.audio_at_rate(audio, 16000)
        x24k = A.audio_at_rate(audio, ctx.model_dir.dims.feat.sampling_rate)
        fbank = A.kaldi_fbank(x16k)
        log_mel = A.whisper_log_mel(x16k)
        tokens = ctx.encoder.tokens_from_log_mel(log_mel)
        embedding = ctx.encoder.embedding_from_fbank(fbank)
        feat = ctx.encoder.speech_feat(x24k)
        out.update({
            f"{key}/speech_16k": x16k[None], f"{key}/speech_24k": x24k[None],
            f"{key}/fbank_raw": fbank, f"{key}/campplus_input": ctx.encoder.campplus_input(fbank),
            f"{key}/campplus_output": embedding[None], f"{key}/embedding": embedding[None],
            f"{key}/whisper_logmel": log_mel[None],
            f"{key}/whisper_feats_length": np.array([log_mel.shape[-1]], np.int32),
            f"{key}/tokenizer_indices_raw": tokens[None], f"{key}/speech_token_untrimmed": tokens[None],
            f"{key}/speech_feat_untrimmed": feat[None],
            f"{key}/trim_token_len": np.array([min(feat.shape[0] // 2, tokens.size)], np.int64),
        })
    return out


def _parse_call(call: str) -> tuple[str, list]:
    """'frontend_zero_shot(texts.tts_en, texts.prompt_text, 'golden/p.wav', 24000, '')' -> name, args."""
    node = ast.parse(call, mode="eval").body
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
        raise ValueError(f"unsupported model_input call {call!r}")
    args = []
    for a in node.args:
        if isinstance(a, ast.Attribute) and isinstance(a.value, ast.Name) and a.value.id == "texts":
            args.append(("text", a.attr))
        elif isinstance(a, ast.Constant):
            args.append(a.value)
        else:
            raise ValueError(f"unsupported argument in {call!r}")
    return node.func.id, args


def model_inputs(ctx: Context) -> dict[str, np.ndarray]:
    tok = ctx.model_dir.tokenizer()
    system = SystemPrompt.for_tokenizer(tok.encode, ctx.model_dir.kind)
    texts = ctx.inputs["texts"]
    speakers = load_spk2info(ctx.model_dir.spk2info_path, tok.encode) if ctx.model_dir.spk2info_path else {}

    def text(arg) -> str:
        return texts[arg[1]] if isinstance(arg, tuple) else arg

    def voice(wav: str, spk_id: str) -> Voice:
        if spk_id:
            return speakers[spk_id]
        return ctx.encoder.encode(A.load_audio(ctx.model_dir.path / wav))

    out = {}
    for name, call in ctx.inputs["model_input_calls"].items():
        fn, args = _parse_call(call)
        if fn == "frontend_zero_shot":
            tts, prompt, wav, _, spk = args
            mode = Mode.ZERO_SHOT_BY_SPK_ID if spk else Mode.ZERO_SHOT
            v = voice(wav, spk)
            if not spk:
                v = v.with_transcript(text(prompt), tok.encode(text(prompt)))
            mi = build_model_input(mode, v, text_tokens=tok.encode(text(tts)), system_prompt=system)
        elif fn == "frontend_cross_lingual":
            tts, wav, _, spk = args
            mi = build_model_input(Mode.CROSS_LINGUAL, voice(wav, spk), text_tokens=tok.encode(text(tts)),
                                   system_prompt=system)
        elif fn == "frontend_instruct2":
            tts, instruct, wav, _, spk = args
            mi = build_model_input(Mode.INSTRUCT2, voice(wav, spk), text_tokens=tok.encode(text(tts)),
                                   instruction_tokens=tok.encode(text(instruct)), system_prompt=system)
        elif fn == "frontend_sft":
            tts, spk = args
            mi = build_model_input(Mode.SFT, Voice.embedding_only(speakers[spk].embedding),
                                   text_tokens=tok.encode(text(tts)), system_prompt=system)
        else:
            raise ValueError(f"unsupported frontend call {fn} in {call!r}")
        out.update({f"{name}/{k}": v for k, v in mi.to_upstream_dict().items()})
    return out


# -- LLM ----------------------------------------------------------------------------------------

@torch.inference_mode()
def llm(ctx: Context, mi: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    golden = ctx.npz("llm.npz")
    lm = ctx.models.llm
    cases = sorted({k.split("/")[0] for k in golden.files} - {"silent_filter"})
    out = {}
    if "silent_filter/sampled" in golden.files:
        out.update(silent_filter(lm.ids, lm.dims.silent_tokens, golden["silent_filter/sampled"]))
    for case in cases:
        forced = [int(t) for t in golden[f"{case}/forced_tokens"]]
        prompt_text = mi.get(f"{case}/prompt_text", np.zeros((1, 0), np.int32))
        text = mi[f"{case}/text"]
        speech = mi.get(f"{case}/llm_prompt_speech_token", np.zeros((1, 0), np.int32))
        x = lm.embed_prompt(np.concatenate([prompt_text[0], text[0]]), speech[0])[None]
        min_len, max_len = length_limits(text.shape[1], lm.dims.min_token_text_ratio, lm.dims.max_token_text_ratio)
        L = x.shape[1]
        cache = lm.new_cache(1, L + len(forced))
        slots = torch.zeros(1, dtype=torch.long)
        step_in, positions = x, torch.arange(L)[None]
        hidden_rows, logits_rows = [], []
        for step, token in enumerate(forced):
            h = lm.backbone(step_in, positions, cache, slots)[0, -1]
            hidden_rows.append(h)
            logits_rows.append(lm.logits(h))
            step_in = lm.embed_speech(torch.tensor([[token]]))
            positions = torch.tensor([[L + step]])
        logits = torch.stack(logits_rows).float()
        logp = logits.log_softmax(-1)
        sampler_in = logp.clone()
        sampler_in[:min_len, lm.ids.min_len_masked] = -float("inf")
        masked_ids = [lm.ids.min_len_masked if step < min_len else -1 for step in range(len(forced))]
        full_in = torch.cat([x, lm.embed_speech(torch.tensor(forced[:-1]))[None]], dim=1)
        full_h = lm.backbone(full_in, torch.arange(full_in.shape[1])[None])
        full_logp = lm.logits(full_h[0, L - 1:]).float().log_softmax(-1)
        out.update({
            f"{case}/lm_input": _np(x), f"{case}/min_len": np.array([min_len], np.int64),
            f"{case}/max_len": np.array([max_len], np.int64), f"{case}/hidden_last": _np(torch.stack(hidden_rows)),
            f"{case}/logits": _np(logits), f"{case}/logp": _np(logp), f"{case}/sampler_in": _np(sampler_in),
            f"{case}/full_forward_logp": _np(full_logp), f"{case}/sampler_masked_ids": np.array(masked_ids, np.int64),
        })
    return out


def silent_filter(ids, silent_tokens, sampled) -> dict[str, np.ndarray]:
    """upstream llm_job fed by a sampler returning `sampled`: the LM emits up to the first stop id,
    the silence cap decides what reaches the flow, the LM's history holds every emitted token."""
    emitted = []
    for t in (int(x) for x in sampled):
        if ids.is_stop(t):
            break
        emitted.append(t)
    cap = SilenceCap(silent_tokens)
    return {"silent_filter/kept": np.array(cap.filter(emitted), np.int64),
            "silent_filter/decoded_history_last_step": np.array(emitted, np.int64)}


def ras(ctx: Context) -> dict[str, np.ndarray]:
    golden = ctx.npz("ras.npz")
    params = ctx.model_dir.dims.sampling
    masked_id = ctx.model_dir.dims.lm.ids.min_len_masked
    out = {}
    for case in sorted({k.split("/")[0] for k in golden.files}):
        scores = torch.from_numpy(golden[f"{case}/weighted_scores"]).clone()
        if f"{case}/ignore_eos" in golden.files and int(golden[f"{case}/ignore_eos"][0]):
            scores[masked_id] = -float("inf")  # upstream sampling_ids(ignore_eos=True)
        decoded = [int(t) for t in golden[f"{case}/decoded_tokens"]]
        ids, probs = nucleus(scores, params.top_p, params.top_k)
        out[f"{case}/nucleus_ids"] = _np(ids).astype(np.int64)
        out[f"{case}/nucleus_probs"] = _np(probs)
        seeds = sorted({int(k.split("/")[1][4:]) for k in golden.files if k.startswith(f"{case}/seed")})
        for seed in seeds:
            torch.manual_seed(seed)
            first = int(ids[probs.multinomial(1, replacement=True)])
            window = decoded[-params.win_size:]
            fallback = window.count(first) >= params.win_size * params.tau_r
            torch.manual_seed(seed)
            result = ras_sample(scores.clone(), decoded, params)
            out[f"{case}/seed{seed}/result"] = np.array([result], np.int64)
            out[f"{case}/seed{seed}/n_multinomial_calls"] = np.array([2 if fallback else 1], np.int64)
    return out


# -- flow and HiFT ------------------------------------------------------------------------------

def flow(ctx: Context) -> dict[str, np.ndarray]:
    g = ctx.npz("flow.npz")
    out = {}
    for prefix, streaming, finalize in (("nonstream", False, True), ("chunk", True, False)):
        trace: dict = {}
        ctx.models.flow.inference(ctx.t(g["token"]), ctx.t(g["prompt_token"]), ctx.t(g["prompt_feat"]),
                                  ctx.t(g["embedding"]), streaming=streaming, finalize=finalize, trace=trace)
        for key in ("mel", "encoder_out", "mu", "spks", "cond", "mask", "est_step1_out", "est_step10_out",
                    "est_t_per_step"):
            if key in trace:
                out[f"{prefix}/{key}"] = _np(trace[key]).astype(np.float32)
    return out


def hift(ctx: Context) -> dict[str, np.ndarray]:
    g = ctx.npz("hift.npz")
    h = ctx.models.hift
    out = {}
    t1, t2 = {}, {}
    s1, src1 = h.inference(ctx.t(g["mel1"]), None, NSFNoise.zero(), trace=t1)
    s2, src2 = h.inference(ctx.t(g["mel2"]), ctx.t(g["zero/cache_source_for_2"]), NSFNoise.zero(), trace=t2)
    out.update({"zero/speech1": _np(s1), "zero/source1": _np(src1), "zero/f0_1": _np(t1["f0"]),
                "zero/speech2": _np(s2), "zero/source2": _np(src2), "zero/f0_2": _np(t2["f0"])})
    noise = NSFNoise.given(ctx.t(g["seeded/draw_rand_ini"]), ctx.t(g["seeded/draw_sine_noise"]))
    s, src = h.inference(ctx.t(g["mel1"]), None, noise)
    out.update({"seeded/speech1": _np(s), "seeded/source1": _np(src)})
    return out


def e2e(ctx: Context, name: str) -> dict[str, np.ndarray]:
    g = ctx.npz(name)
    hop = int(g["token_hop_len"][0])
    records: list[ChunkRecord] = []
    # the production runner: streaming chunks go through the exact flow state cache, starting from
    # the prompt's speaker prefix as for a registered speaker
    runner = Token2WavRunner(ctx.models.flow, ctx.models.hift, recorder=records.append)
    streaming = "nonstream" not in name
    stream = Token2WavStream(ctx.t(g["prompt_token"]), ctx.t(g["prompt_feat"]), ctx.t(g["embedding"]),
                             stream=streaming, noise=NSFNoise.zero(),
                             schedule=ChunkSchedule(first_hop=hop, max_hop_multiple=4), prompt_key=name)
    if streaming:
        chunks = runner.render(stream, [int(t) for t in g["token"][0]])
    else:
        # the production non-streaming path: the offline renderer (token2wav/offline.py), in a
        # padded batch with a shorter utterance of the other prompt (its records are dropped)
        other = ctx.npz("e2e_stream_hop25_p16.npz")
        companion = Token2WavStream(ctx.t(other["prompt_token"]), ctx.t(other["prompt_feat"]),
                                    ctx.t(other["embedding"]), stream=False, noise=NSFNoise.zero())
        companion.append([int(t) for t in other["token"][0][:60]])
        stream.append([int(t) for t in g["token"][0]])
        chunks = render_offline(runner, [stream.next_job(llm_done=True), companion.next_job(llm_done=True)])[:1]
        del records[1:]
    if streaming and not (runner.stats.flow_cached_frames and len(runner.speaker_prefixes)):
        raise RuntimeError(f"{name}: the streaming chunks did not go through the flow state cache")
    out = {}
    for i, r in enumerate(records):
        out.update({
            f"call{i}/n_tokens": np.array([r.n_tokens], np.int64),
            f"call{i}/token_offset": np.array([r.token_offset], np.int64),
            f"call{i}/finalize": np.array([int(r.finalize)], np.int64),
            f"call{i}/flow_streaming": np.array([int(r.flow_streaming)], np.int64),
            f"call{i}/flow_mel": _np(r.flow_mel), f"call{i}/hift_in_mel": _np(r.hift_in_mel),
            f"call{i}/hift_in_cache_source": _np(r.hift_in_cache_source),
            f"call{i}/hift_speech": _np(r.hift_speech), f"call{i}/hift_source": _np(r.hift_source),
            f"call{i}/out": _np(r.out),
        })
    out["audio_zero_noise"] = _np(torch.cat(chunks))[None]
    out["chunk_lengths"] = np.array([c.numel() for c in chunks], np.int64)
    return out


# DiT internals of CFG step 1 the CosyVoice3 flow golden records (module outputs)
DIT_INTERNALS = {"est_step1_time_embed": "time_embed", "est_step1_input_embed": "input_embed",
                 "est_step1_block0_out": "transformer_blocks.0", "est_step1_norm_out": "norm_out"}


def flow_cosyvoice3(ctx: Context) -> dict[str, np.ndarray]:
    g = ctx.npz("flow.npz")
    flow = ctx.models.flow
    modules = dict(flow.decoder.estimator.named_modules())
    out = {}
    for prefix, streaming, finalize in (("nonstream", False, True), ("chunk", True, False)):
        trace: dict = {}
        def record(key: str):
            def hook(module, args, output) -> None:  # returns None: the output is not replaced
                trace.setdefault(key, output)  # CFG step 1 is the first call
            return hook
        hooks = [modules[m].register_forward_hook(record(key)) for key, m in DIT_INTERNALS.items()]
        try:
            flow.inference(ctx.t(g["token"]), ctx.t(g["prompt_token"]), ctx.t(g["prompt_feat"]), ctx.t(g["embedding"]),
                           streaming=streaming, finalize=finalize, trace=trace)
        finally:
            for h in hooks:
                h.remove()
        trace["spk_proj"] = trace["spks"]  # the affine layer on the normalized x-vector is the CFM's spks
        out.update({f"{prefix}/{k}": _np(v) for k, v in trace.items() if isinstance(v, torch.Tensor)})
    return out


def hift_cosyvoice3(ctx: Context) -> dict[str, np.ndarray]:
    g = ctx.npz("hift.npz")
    mel = ctx.t(g["mel"])
    hift = ctx.models.hift
    real = hift.nsf_noise
    out = {"nsf/rand_ini": _np(real.rand_ini), "nsf/sine_waves_prefix": _np(real.sine_noise(4800, "cpu"))}
    for kind, noise in (("real", real), ("zero", FixedNSFNoise.zeros(ctx.model_dir.dims.hift.nb_harmonics + 1))):
        hift.nsf_noise = noise
        for call in ("final", "nonfinal"):
            trace: dict = {}
            speech, source = hift.inference(mel, finalize=call == "final", trace=trace)
            out.update({f"{kind}/{call}/speech": _np(speech), f"{kind}/{call}/source": _np(source),
                        f"{kind}/{call}/f0": _np(trace["f0"])})
    hift.nsf_noise = real
    return out


@torch.inference_mode()
def seeded_speech_tokens(ctx: Context, mode: str, seed: int, mi: dict[str, np.ndarray]) -> list[int]:
    """The `e2e_llm_calls` entry point of `mode` after torch.manual_seed(seed): upstream's decode loop
    (`generate_reference`) with RAS on torch's CPU generator, then the silence cap."""
    tok, texts = ctx.model_dir.tokenizer(), ctx.inputs["texts"]
    call = ctx.inputs["e2e_llm_calls"][mode]
    fn, args = call.split("(", 1)
    names = [a.strip()[len("texts."):] for a in args.split(",") if a.strip().startswith("texts.")]
    text = tok.encode(texts[names[0]])
    prompt_text = tok.encode(texts[names[1]]) if len(names) > 1 else []
    speech = mi[f"{mode}/llm_prompt_speech_token"][0].tolist() if fn.endswith("zero_shot") else []
    lm = ctx.models.llm
    min_len, max_len = length_limits(len(text), lm.dims.min_token_text_ratio, lm.dims.max_token_text_ratio)
    torch.manual_seed(seed)
    out = lm.generate_reference(prompt_text + text, speech, min_len, max_len,
                                lambda logp, decoded: ras_sample(logp, decoded, ctx.model_dir.dims.sampling))
    return SilenceCap(lm.dims.silent_tokens).filter(out)


def e2e_cosyvoice3(ctx: Context, name: str, mi: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A CosyVoice3 end-to-end golden through the production streaming path: Token2WavStream (the
    schedule at the golden's hop, upstream's prompt-aligned first hop, the causal vocoder's carry)
    and Token2WavRunner (batched DiT flow through the exact flow state cache, CausalHiFT with
    upstream's NSF noise; the VC goldens' zero-noise audio with the noise-free source). The seeded
    LLM runs render the tokens `seeded_speech_tokens` draws."""
    g = ctx.npz(name)
    md, models = ctx.model_dir, ctx.models
    if "token" in g.files:  # VC: the fixed tokens with the golden's prompt
        tokens = [int(t) for t in g["token"][0]]
        prompt = [ctx.t(g[k]) for k in ("prompt_token", "prompt_feat", "embedding")]
        hop = int(g["token_hop_len"][0])
    else:  # seeded LLM: the frontend's prompt of the mode, upstream's hop 25
        mode = name[len("e2e_llm_"):-len(".npz")].rsplit("_", 1)[0]
        tokens = seeded_speech_tokens(ctx, mode, int(g["torch_seed"][0]), mi)
        prompt = [ctx.t(mi[f"{mode}/{k}"])
                  for k in ("flow_prompt_speech_token", "prompt_speech_feat", "flow_embedding")]
        hop = 25
    streaming = not name.endswith("nonstream.npz")
    zero_hift = build_models(md, with_llm=False).hift
    zero_hift.nsf_noise = FixedNSFNoise.zeros(md.dims.hift.nb_harmonics + 1)
    out: dict[str, np.ndarray] = {}
    for key, hift in (("audio", models.hift), ("audio_zero_noise", zero_hift)):
        records: list[ChunkRecord] = []
        runner = Token2WavRunner(models.flow, hift, recorder=records.append)
        stream = Token2WavStream(*prompt, stream=streaming, schedule=ChunkSchedule(first_hop=hop), causal_vocoder=True)
        chunks = runner.render(stream, tokens)
        out[key] = _np(torch.cat(chunks))[None]
        out["chunk_lengths"] = np.array([c.numel() for c in chunks], np.int64)
    for i, r in enumerate(records):  # upstream's flow output of each call, before the offset slice
        out[f"call{i}/flow_mel"] = _np(models.flow.inference(
            torch.tensor(tokens[:r.n_tokens])[None], *prompt, streaming=r.flow_streaming, finalize=r.finalize))
    out["hift_in_mel_final"] = _np(records[-1].hift_in_mel)
    out["speech_tokens"] = np.array(tokens, np.int64)[None]
    return out


# -- driver ---------------------------------------------------------------------------------------

def reproduce(model_dir: str | Path, out_dir: str | Path, threads: int | None = 1) -> list[Path]:
    """Write every reproducible golden file of `model_dir/golden` into `out_dir`; returns the paths."""
    if threads:
        torch.set_num_threads(threads)
    md = load_model_dir(model_dir)
    golden = md.path / "golden"
    if not (golden / "inputs.json").is_file():
        raise FileNotFoundError(f"{golden / 'inputs.json'} not found: {md.path} has no golden inputs")
    encoder = PromptEncoder.from_model_dir(md.path, mel=md.dims.feat, speech_tokenizer=md.speech_tokenizer_onnx.name)
    ctx = Context(md, golden, build_models(md), encoder,
                  json.loads((golden / "inputs.json").read_text(encoding="utf-8")))
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []

    def save(name: str, arrays: dict[str, np.ndarray]) -> None:
        np.savez(out_dir / name, **arrays)
        written.append(out_dir / name)

    save("frontend.npz", frontend(ctx))
    mi = model_inputs(ctx)
    save("model_inputs.npz", mi)
    if (golden / "llm.npz").is_file():
        save("llm.npz", llm(ctx, mi))
    if (golden / "ras.npz").is_file():
        save("ras.npz", ras(ctx))
    if md.kind == "cosyvoice3":
        save("flow.npz", flow_cosyvoice3(ctx))
        save("hift.npz", hift_cosyvoice3(ctx))
        for path in sorted(golden.glob("e2e_*.npz")):
            save(path.name, e2e_cosyvoice3(ctx, path.name, mi))
        return written
    if (golden / "flow.npz").is_file():
        save("flow.npz", flow(ctx))
    if (golden / "hift.npz").is_file():
        save("hift.npz", hift(ctx))
    for path in sorted(golden.glob("e2e_*.npz")):
        if "token" in np.load(path).files:
            save(path.name, e2e(ctx, path.name))
    text_golden = golden / "text_frontend.json"
    if text_golden.is_file():
        texts = [e["text"] for e in json.loads(text_golden.read_text(encoding="utf-8"))]
        write_text_golden(texts, md.tokenizer(), out_dir / "text_frontend.json")
        written.append(out_dir / "text_frontend.json")
    return written


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m async_cosyvoice.tools.reproduce_golden", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model_dir", type=Path)
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--compare", action="store_true", help="print the max errors against MODEL_DIR/golden")
    args = ap.parse_args(argv)
    written = reproduce(args.model_dir, args.out_dir)
    print(f"wrote {len(written)} files to {args.out_dir}")
    if args.compare:
        from .golden_compare import compare_dirs, format_table
        rows = compare_dirs(args.model_dir / "golden", args.out_dir)
        print(format_table(rows))
        return 0 if all(r.ok for r in rows) else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
