"""Write a randomly initialised CosyVoice2 model directory in exactly the official format.

    python -m async_cosyvoice.tools.make_random_model --preset tiny --out DIR --seed 0

Files: cosyvoice2.yaml (official tag structure, the preset's dims), llm.pt / flow.pt / hift.pt (official
state-dict keys: tied `llm.model.lm_head.weight`, HiFT weight norm as `parametrizations.weight.original0/1`),
campplus.onnx and speech_tokenizer_v2.onnx stand-ins (official I/O names and shapes), spk2info.pt ({}),
configuration.json (provenance) and CosyVoice-BlankEN/ (Qwen2 config.json plus a byte-level BPE trained
offline on a small built-in corpus; no model.safetensors). The pieces live in `random_model/`: presets.py,
weights.py (state-dict layouts and random init), recipe.py (the yaml), tokenizer.py (BlankEN),
onnx_standins.py.

Presets: `tiny` has the dims of the shared `cosyvoice2-tiny` fixture; `cosyvoice2-0.5b` the official dims
(~2.5 GB of fp32 weights, written one file at a time). Weights come from `torch.Generator(seed)` on CPU:
linears/embeddings N(0, 0.02), norms ~1, snake alpha ~1, weight-norm g = ||v|| so that the folded weight
is v; HiFT's convs are fan-in scaled instead (ResBlock branches smaller). Four biases are set so a
demo behaves like a TTS model rather than pure chance: the LM's EOS logit is raised (generation ends
some tokens after min_len), the flow's mels sit near -5 (a natural log-mel level), the F0 predictor
outputs ~150 Hz (voiced source) and HiFT's log-magnitude channels start at log(0.05): the demo speaks
quiet noise (around -40 dBFS), finite and unclipped.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch

from async_cosyvoice.tools.random_model.onnx_standins import (
    ONNX_IR_VERSION, ONNX_OPSET, write_campplus_onnx, write_speech_tokenizer_onnx,
)
from async_cosyvoice.tools.random_model.presets import PRESETS, Preset
from async_cosyvoice.tools.random_model.recipe import recipe_yaml
from async_cosyvoice.tools.random_model.tokenizer import BASE_SPECIALS, train_bpe, write_blank_en
from async_cosyvoice.tools.random_model.weights import (
    HIFT_GAIN, HIFT_POST_GAIN, HIFT_RES_GAIN, STD, Spec, flow_specs, hift_specs, llm_specs, llm_state_dict,
    random_state_dict,
)

__all__ = [
    "make_random_model", "is_random_model", "main", "GENERATOR_VERSION", "PRESETS", "Preset",
    # re-exported from random_model/
    "BASE_SPECIALS", "HIFT_GAIN", "HIFT_POST_GAIN", "HIFT_RES_GAIN", "ONNX_IR_VERSION", "ONNX_OPSET", "STD", "Spec",
    "flow_specs", "hift_specs", "llm_specs", "llm_state_dict", "random_state_dict", "recipe_yaml", "train_bpe",
    "write_blank_en", "write_campplus_onnx", "write_speech_tokenizer_onnx",
]

GENERATOR_VERSION = 2


def _provenance(preset: Preset, seed: int) -> dict:
    return {"framework": "Pytorch", "task": "text-to-speech",
            "random_model": {"preset": preset.name, "seed": seed, "generator_version": GENERATOR_VERSION}}


def _written_by_us(out: Path) -> dict | None:
    try:
        info = json.loads((out / "configuration.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    rm = info.get("random_model") if isinstance(info, dict) else None
    return rm if isinstance(rm, dict) else None


def is_random_model(out: str | Path, preset: str, seed: int) -> bool:
    """True when `out` is a complete directory written by this version of the tool for (preset, seed)."""
    return _written_by_us(Path(out)) == _provenance(PRESETS[preset], seed)["random_model"]


def _write(tmp: Path, preset: Preset, seed: int) -> None:
    d = preset.dims
    gen = torch.Generator().manual_seed(seed)
    (tmp / "cosyvoice2.yaml").write_text(recipe_yaml(d), encoding="utf-8")
    write_blank_en(tmp / "CosyVoice-BlankEN", preset)
    sd = llm_state_dict(preset, gen)
    torch.save(sd, tmp / "llm.pt")
    del sd
    sd = random_state_dict(flow_specs(d.flow, preset.mel_mean), gen)
    torch.save(sd, tmp / "flow.pt")
    del sd
    torch.save(random_state_dict(hift_specs(d.hift, preset.f0_hz, preset.magnitude), gen), tmp / "hift.pt")
    write_campplus_onnx(tmp / "campplus.onnx", preset.campplus_hidden, gen)
    write_speech_tokenizer_onnx(tmp / "speech_tokenizer_v2.onnx", preset.s3tok_hidden, gen)
    torch.save({}, tmp / "spk2info.pt")
    (tmp / "configuration.json").write_text(json.dumps(_provenance(preset, seed), indent=2) + "\n", encoding="utf-8")


def make_random_model(preset: str, out: str | Path, seed: int = 0, overwrite: bool = False) -> Path:
    """Write a random official-format CosyVoice2 directory to `out` and return its path.

    The directory is built next to `out` and renamed into place, so a concurrent reader never sees a
    partial one. If `out` already holds this (preset, seed) it is reused unless `overwrite`; one written
    for the same (preset, seed) by an older version of this tool is regenerated; any other existing
    `out` raises FileExistsError unless `overwrite`."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {sorted(PRESETS)}")
    out = Path(out).expanduser().resolve()
    if out.exists() and not overwrite:
        if is_random_model(out, preset, seed):
            return out
        ours = _written_by_us(out)
        if not (ours and ours.get("preset") == preset and ours.get("seed") == seed):
            raise FileExistsError(f"{out} exists and is not a {preset}/seed {seed} random model (pass overwrite)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        _write(tmp, PRESETS[preset], seed)
        os.chmod(tmp, 0o755)
        if out.exists():
            if not overwrite and is_random_model(out, preset, seed):  # a concurrent writer finished first
                shutil.rmtree(tmp, ignore_errors=True)
                return out
            shutil.rmtree(out)
        try:
            tmp.rename(out)
        except OSError:
            if is_random_model(out, preset, seed) and not overwrite:  # a concurrent writer won the race
                shutil.rmtree(tmp, ignore_errors=True)
                return out
            raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m async_cosyvoice.tools.make_random_model",
                                 description="Write a randomly initialised CosyVoice2 model directory "
                                             "in the official format.")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    ap.add_argument("--out", required=True, type=Path, help="directory to create")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--overwrite", action="store_true", help="replace an existing directory")
    args = ap.parse_args(argv)
    try:
        path = make_random_model(args.preset, args.out, args.seed, overwrite=args.overwrite)
    except (FileExistsError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
