"""Write a random model directory for a (preset, seed), reusing one already written by this version."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from async_cosyvoice.files import atomic_directory

from .onnx_standins import write_campplus_onnx, write_speech_tokenizer_onnx
from .presets import PRESETS, Preset
from .recipe import recipe_yaml
from .tokenizer import write_blank_en
from .weights import dit_flow_specs, flow_specs, hift_specs, llm_state_dict, random_state_dict

log = logging.getLogger(__name__)

GENERATOR_VERSION = 4  # 3: the LM's 6562 logit pushed down (bistream); 4: CosyVoice3 presets


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
    v3 = d.kind == "cosyvoice3"
    gen = torch.Generator().manual_seed(seed)
    (tmp / ("cosyvoice3.yaml" if v3 else "cosyvoice2.yaml")).write_text(recipe_yaml(d), encoding="utf-8")
    write_blank_en(tmp / "CosyVoice-BlankEN", preset)
    sd = llm_state_dict(preset, gen)
    torch.save(sd, tmp / "llm.pt")
    del sd
    sd = random_state_dict((dit_flow_specs if v3 else flow_specs)(d.flow, preset.mel_mean), gen)
    torch.save(sd, tmp / "flow.pt")
    del sd
    torch.save(random_state_dict(hift_specs(d.hift, preset.f0_hz, preset.magnitude), gen), tmp / "hift.pt")
    write_campplus_onnx(tmp / "campplus.onnx", preset.campplus_hidden, gen)
    write_speech_tokenizer_onnx(tmp / ("speech_tokenizer_v3.onnx" if v3 else "speech_tokenizer_v2.onnx"),
                                preset.s3tok_hidden, gen)
    torch.save({}, tmp / "spk2info.pt")
    (tmp / "configuration.json").write_text(json.dumps(_provenance(preset, seed), indent=2) + "\n", encoding="utf-8")


def make_random_model(preset: str, out: str | Path, seed: int = 0, overwrite: bool = False) -> Path:
    """Write a random official-format CosyVoice2 or CosyVoice3 directory (as the preset's kind) to `out`
    and return its path.

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
    # a concurrent writer's finished copy is kept, unless we were asked to overwrite
    with atomic_directory(out, finished=lambda p: not overwrite and is_random_model(p, preset, seed)) as tmp:
        _write(tmp, PRESETS[preset], seed)
    return out


def ensure_random_model(preset: str, out: str | Path, seed: int = 0) -> Path:
    """`out` holding this (preset, seed): reused when it already does, else written over whatever
    is there (a scratch folder the benchmarks keep between runs)."""
    if is_random_model(out, preset, seed):
        return Path(out).expanduser().resolve()
    log.warning("writing a random %s model (seed %d) to %s", preset, seed, out)
    return make_random_model(preset, out, seed=seed, overwrite=True)
