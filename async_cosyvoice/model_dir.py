"""Read an official CosyVoice2 model directory (`iic/CosyVoice2-0.5B` layout) without upstream code.

- `cosyvoice2.yaml` is parsed by the tag-aware loader of `recipe.py` (`!new:` / `!name:` / `!apply:` kept as
  `Tagged` data, `!ref` resolved); the typed `ModelDims` come from it plus `CosyVoice-BlankEN/config.json`
  (backbone shape).
- State dicts are loaded with `torch.load(weights_only=True)` and normalized to the key names our modules
  use: the Qwen2 backbone moves to `backbone.*`, HiFT weight norm is folded into plain weights.
- Every problem raises `ModelDirError` naming the file and what was expected.
"""
from __future__ import annotations

import functools
import json
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch

from async_cosyvoice.model_dir_error import ModelDirError
from async_cosyvoice.models.dims import (
    CFMParams, EncoderDims, EstimatorDims, FlowDims, HiFTDims, LMDims, MelDims, ModelDims,
    Qwen2Dims, RASParams,
)
from async_cosyvoice.recipe import YAML_FILE, RecipeLoader as RecipeLoader, Tagged, child, load_recipe

BLANK_EN_DIR = "CosyVoice-BlankEN"
QWEN_CONFIG = f"{BLANK_EN_DIR}/config.json"
LLM_FILE, FLOW_FILE, HIFT_FILE = "llm.pt", "flow.pt", "hift.pt"
CAMPPLUS_FILE = "campplus.onnx"
SPEECH_TOKENIZER_FILE = "speech_tokenizer_v2.onnx"
SPK2INFO_FILE = "spk2info.pt"
REQUIRED_FILES = (YAML_FILE, QWEN_CONFIG, LLM_FILE, FLOW_FILE, HIFT_FILE, CAMPPLUS_FILE,
                  SPEECH_TOKENIZER_FILE)

LLM_BACKBONE_PREFIX = "llm.model.model."
LLM_TIED_HEAD = "llm.model.lm_head.weight"
LLM_OWN_KEYS = ("llm_embedding.weight", "speech_embedding.weight", "llm_decoder.weight", "llm_decoder.bias")


# ---------------------------------------------------------------------------------------------------
# Typed dims
# ---------------------------------------------------------------------------------------------------

_MISSING = object()


class _Cfg:
    """Typed access into a resolved recipe / JSON config with precise errors."""

    def __init__(self, data, file: str, prefix: str = ""):
        self.data, self.file, self.prefix = data, file, prefix

    def _path(self, key: str) -> str:
        return f"{self.prefix}.{key}" if self.prefix else key

    def get(self, key: str, default=_MISSING):
        node = self.data
        for part in key.split("."):
            try:
                node = child(node, part)
            except KeyError:
                if default is _MISSING:
                    raise ModelDirError(self.file, f"missing key {self._path(key)}") from None
                return default
        return node

    def sub(self, key: str, expect_class: str | None = None) -> "_Cfg":
        node = self.get(key)
        if expect_class is not None:
            name = node.class_name if isinstance(node, Tagged) else type(node).__name__
            if name != expect_class:
                got = node.target if isinstance(node, Tagged) else repr(node)
                raise ModelDirError(self.file, f"{self._path(key)} is {got}, expected {expect_class} (CosyVoice2)")
        args = node.args if isinstance(node, Tagged) else node
        if not isinstance(args, Mapping):
            raise ModelDirError(self.file, f"{self._path(key)}: expected keyword arguments, got {args!r}")
        return _Cfg(args, self.file, self._path(key))

    def int(self, key: str, default=_MISSING) -> int:
        v = self.get(key, default)
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        if not isinstance(v, int) or isinstance(v, bool):
            raise ModelDirError(self.file, f"{self._path(key)} must be an integer, got {v!r}")
        return v

    def float(self, key: str, default=_MISSING) -> float:
        v = self.get(key, default)
        if not isinstance(v, (int, float)) or isinstance(v, bool):
            raise ModelDirError(self.file, f"{self._path(key)} must be a number, got {v!r}")
        return float(v)

    def opt_float(self, key: str, default=_MISSING) -> float | None:
        return None if self.get(key, default) is None else self.float(key, default)

    def str(self, key: str, default=_MISSING) -> str:
        v = self.get(key, default)
        if not isinstance(v, str):
            raise ModelDirError(self.file, f"{self._path(key)} must be a string, got {v!r}")
        return v

    def bool(self, key: str, default=_MISSING) -> bool:
        v = self.get(key, default)
        if not isinstance(v, bool):
            raise ModelDirError(self.file, f"{self._path(key)} must be true/false, got {v!r}")
        return v

    def ints(self, key: str, default=_MISSING) -> tuple[int, ...]:
        v = self.get(key, default)
        if not isinstance(v, (list, tuple)) or not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
            raise ModelDirError(self.file, f"{self._path(key)} must be a list of integers, got {v!r}")
        return tuple(v)

    def int_lists(self, key: str, default=_MISSING) -> tuple[tuple[int, ...], ...]:
        v = self.get(key, default)
        ok = isinstance(v, (list, tuple)) and all(
            isinstance(x, (list, tuple)) and all(isinstance(y, int) and not isinstance(y, bool) for y in x)
            for x in v)
        if not ok:
            raise ModelDirError(self.file, f"{self._path(key)} must be a list of integer lists, got {v!r}")
        return tuple(tuple(x) for x in v)


def qwen2_dims_from_config(config: Mapping[str, Any], file: str = QWEN_CONFIG) -> Qwen2Dims:
    c = _Cfg(config, file)
    rope = config.get("rope_parameters") or {}
    rope_theta = c.float("rope_theta") if "rope_theta" in config or "rope_theta" not in rope \
        else _Cfg(rope, file, "rope_parameters").float("rope_theta")
    d = Qwen2Dims(
        hidden_size=c.int("hidden_size"),
        intermediate_size=c.int("intermediate_size"),
        num_layers=c.int("num_hidden_layers"),
        num_heads=c.int("num_attention_heads"),
        num_kv_heads=c.int("num_key_value_heads", config.get("num_attention_heads", _MISSING)),
        rms_norm_eps=c.float("rms_norm_eps"),
        rope_theta=rope_theta,
        vocab_size=c.int("vocab_size"),
        max_position_embeddings=c.int("max_position_embeddings"),
    )
    if d.hidden_size % d.num_heads or d.num_heads % d.num_kv_heads:
        raise ModelDirError(file, f"hidden_size {d.hidden_size}, num_attention_heads {d.num_heads} and "
                                  f"num_key_value_heads {d.num_kv_heads} are not divisible")
    return d


def model_dims_from_recipe(recipe: Mapping[str, Any], qwen: Qwen2Dims, file: str = YAML_FILE) -> ModelDims:
    """Typed `ModelDims` from a resolved `cosyvoice2.yaml` recipe and the backbone shape."""
    top = _Cfg(recipe, file)
    llm = top.sub("llm", "Qwen2LM")
    sampling = llm.sub("sampling")
    flow = top.sub("flow", "CausalMaskedDiffWithXvec")
    enc = flow.sub("encoder", "UpsampleConformerEncoder")
    dec = flow.sub("decoder", "CausalConditionalCFM")
    est = dec.sub("estimator", "CausalConditionalDecoder")
    cfm = dec.sub("cfm_params")
    if "content" in cfm.data:  # !new:omegaconf.DictConfig {content: {...}}
        cfm = cfm.sub("content")
    hift = top.sub("hift", "HiFTGenerator")
    f0 = hift.sub("f0_predictor", "ConvRNNF0Predictor")
    istft = hift.sub("istft_params")
    feat = top.sub("feat_extractor")

    lm_defaults, enc_defaults, cfm_defaults = LMDims(), EncoderDims(), CFMParams()
    flow_pre = flow.int("pre_lookahead_len")
    dims = ModelDims(
        sample_rate=top.int("sample_rate"),
        token_frame_rate=top.int("token_frame_rate"),
        token_mel_ratio=top.int("token_mel_ratio"),
        chunk_size=top.int("chunk_size"),
        lm=LMDims(
            qwen=qwen,
            llm_input_size=llm.int("llm_input_size"),
            llm_output_size=llm.int("llm_output_size"),
            speech_token_size=llm.int("speech_token_size"),
            mix_ratio=llm.ints("mix_ratio", list(lm_defaults.mix_ratio)),
            min_token_text_ratio=llm.float("min_token_text_ratio", lm_defaults.min_token_text_ratio),
            max_token_text_ratio=llm.float("max_token_text_ratio", lm_defaults.max_token_text_ratio),
        ),
        sampling=RASParams(
            top_p=sampling.float("top_p"), top_k=sampling.int("top_k"),
            win_size=sampling.int("win_size"), tau_r=sampling.float("tau_r"),
        ),
        flow=FlowDims(
            input_size=flow.int("input_size"),
            output_size=flow.int("output_size"),
            spk_embed_dim=flow.int("spk_embed_dim"),
            vocab_size=flow.int("vocab_size"),
            token_mel_ratio=flow.int("token_mel_ratio"),
            pre_lookahead_len=flow_pre,
            input_frame_rate=flow.int("input_frame_rate"),
            encoder=EncoderDims(
                input_size=enc.int("input_size"),
                output_size=enc.int("output_size"),
                attention_heads=enc.int("attention_heads"),
                linear_units=enc.int("linear_units"),
                num_blocks=enc.int("num_blocks"),
                num_up_blocks=enc.int("num_up_blocks", enc_defaults.num_up_blocks),
                static_chunk_size=enc.int("static_chunk_size"),
                pre_lookahead_len=enc.int("pre_lookahead_len", flow_pre),
                upsample_stride=enc.int("upsample_stride", enc_defaults.upsample_stride),
            ),
            estimator=EstimatorDims(
                in_channels=est.int("in_channels"),
                out_channels=est.int("out_channels"),
                channels=est.ints("channels"),
                attention_head_dim=est.int("attention_head_dim"),
                n_blocks=est.int("n_blocks"),
                num_mid_blocks=est.int("num_mid_blocks"),
                num_heads=est.int("num_heads"),
                act_fn=est.str("act_fn"),
                static_chunk_size=est.int("static_chunk_size"),
            ),
            cfm=CFMParams(
                sigma_min=cfm.float("sigma_min"),
                t_scheduler=cfm.str("t_scheduler"),
                inference_cfg_rate=cfm.float("inference_cfg_rate"),
                n_timesteps=cfm.int("n_timesteps", cfm_defaults.n_timesteps),
                noise_frames=cfm.int("noise_frames", cfm_defaults.noise_frames),
            ),
        ),
        hift=HiFTDims(
            in_channels=hift.int("in_channels"),
            base_channels=hift.int("base_channels"),
            nb_harmonics=hift.int("nb_harmonics"),
            sampling_rate=hift.int("sampling_rate"),
            nsf_alpha=hift.float("nsf_alpha"),
            nsf_sigma=hift.float("nsf_sigma"),
            nsf_voiced_threshold=hift.float("nsf_voiced_threshold"),
            upsample_rates=hift.ints("upsample_rates"),
            upsample_kernel_sizes=hift.ints("upsample_kernel_sizes"),
            istft_n_fft=istft.int("n_fft"),
            istft_hop_len=istft.int("hop_len"),
            resblock_kernel_sizes=hift.ints("resblock_kernel_sizes"),
            resblock_dilation_sizes=hift.int_lists("resblock_dilation_sizes"),
            source_resblock_kernel_sizes=hift.ints("source_resblock_kernel_sizes"),
            source_resblock_dilation_sizes=hift.int_lists("source_resblock_dilation_sizes"),
            lrelu_slope=hift.float("lrelu_slope"),
            audio_limit=hift.float("audio_limit"),
            f0_num_class=f0.int("num_class"),
            f0_in_channels=f0.int("in_channels"),
            f0_cond_channels=f0.int("cond_channels"),
        ),
        feat=MelDims(
            n_fft=feat.int("n_fft"),
            num_mels=feat.int("num_mels"),
            sampling_rate=feat.int("sampling_rate"),
            hop_size=feat.int("hop_size"),
            win_size=feat.int("win_size"),
            fmin=feat.float("fmin"),
            fmax=feat.opt_float("fmax"),
            center=feat.bool("center"),
        ),
    )
    _check_consistency(dims, file)
    return dims


def _check_consistency(d: ModelDims, file: str) -> None:
    problems = []
    if d.lm.llm_input_size != d.lm.qwen.hidden_size or d.lm.llm_output_size != d.lm.qwen.hidden_size:
        problems.append(f"llm_input_size/llm_output_size {d.lm.llm_input_size}/{d.lm.llm_output_size} "
                        f"!= {QWEN_CONFIG} hidden_size {d.lm.qwen.hidden_size}")
    if d.flow.estimator.in_channels != 4 * d.flow.output_size:
        problems.append(f"flow.decoder.estimator.in_channels {d.flow.estimator.in_channels} != 4 * "
                        f"flow.output_size {d.flow.output_size} ([x, mu, spks, cond])")
    if d.flow.encoder.output_size % d.flow.encoder.attention_heads:
        problems.append(f"flow.encoder.output_size {d.flow.encoder.output_size} is not divisible by "
                        f"attention_heads {d.flow.encoder.attention_heads}")
    h = d.hift
    if not (len(h.upsample_rates) == len(h.upsample_kernel_sizes) == len(h.source_resblock_kernel_sizes)
            == len(h.source_resblock_dilation_sizes)):
        problems.append("hift: upsample_rates, upsample_kernel_sizes and source_resblock_* differ in length")
    if len(h.resblock_kernel_sizes) != len(h.resblock_dilation_sizes):
        problems.append("hift: resblock_kernel_sizes and resblock_dilation_sizes differ in length")
    if problems:
        raise ModelDirError(file, "; ".join(problems))


# ---------------------------------------------------------------------------------------------------
# State dicts
# ---------------------------------------------------------------------------------------------------

_WN_SUFFIXES = {
    ".parametrizations.weight.original0": ("g", "parametrizations"),
    ".parametrizations.weight.original1": ("v", "parametrizations"),
    ".weight_g": ("g", "weight_g/weight_v"),
    ".weight_v": ("v", "weight_g/weight_v"),
}


def _short_list(items: list[str], limit: int = 12) -> str:
    shown = ", ".join(items[:limit])
    return f"[{shown}{f', ... and {len(items) - limit} more' if len(items) > limit else ''}]"


def fold_weight_norm(state_dict: Mapping[str, torch.Tensor], file: str = HIFT_FILE) -> dict[str, torch.Tensor]:
    """Replace weight-norm pairs by plain `<layer>.weight = g * v / ||v||` (norm over all dims but 0),
    for both `<layer>.parametrizations.weight.original0/1` and legacy `<layer>.weight_g/_v` keys.
    Order is kept: the folded weight takes the place of the pair's first key."""
    pairs: dict[str, dict[str, Any]] = {}
    out: dict[str, Any] = {}
    for key, value in state_dict.items():
        for suffix, (part, convention) in _WN_SUFFIXES.items():
            if key.endswith(suffix):
                layer = key[: -len(suffix)]
                if layer not in pairs:
                    if f"{layer}.weight" in out:
                        raise ModelDirError(file, f"{layer}.weight is present both plain and weight-normed")
                    out[f"{layer}.weight"] = None  # placeholder keeps the position
                entry = pairs.setdefault(layer, {"convention": convention})
                if entry["convention"] != convention or part in entry:
                    raise ModelDirError(file, f"{layer}: weight norm stored twice ({key})")
                entry[part] = value
                break
        else:
            if key in out:
                raise ModelDirError(file, f"{key} is present both plain and weight-normed")
            out[key] = value
    for layer, entry in pairs.items():
        missing = [p for p in ("g", "v") if p not in entry]
        if missing:
            names = {"g": "original0 (g)", "v": "original1 (v)"} if entry["convention"] == "parametrizations" \
                else {"g": "weight_g", "v": "weight_v"}
            raise ModelDirError(file, f"{layer}: incomplete weight norm, missing {names[missing[0]]}")
        g, v = entry["g"], entry["v"]
        if g.numel() != v.shape[0] or g.shape[0] != v.shape[0]:
            raise ModelDirError(file, f"{layer}: weight-norm g {tuple(g.shape)} does not match v {tuple(v.shape)}")
        out[f"{layer}.weight"] = torch._weight_norm(v.float(), g.float(), 0).to(v.dtype)
    return out


def load_state_dict_file(path: Path, file: str) -> dict[str, torch.Tensor]:
    """`torch.load(weights_only=True, map_location='cpu')` with checks; mmap when the file allows it."""
    if not path.is_file():
        raise ModelDirError(file, f"missing (expected a torch state dict at {path})")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(path))
    except Exception as e:  # noqa: BLE001 - torch raises many types for a bad file
        first_line = (str(e).splitlines() or [""])[0]
        raise ModelDirError(file, f"not a torch state dict ({type(e).__name__}: {first_line})") from e
    if not isinstance(obj, Mapping):
        raise ModelDirError(file, f"not a torch state dict (got {type(obj).__name__})")
    bad = [str(k) for k, v in obj.items() if not isinstance(k, str) or not isinstance(v, torch.Tensor)]
    if bad:
        raise ModelDirError(file, f"not a torch state dict (non-tensor entries {_short_list(bad)})")
    return dict(obj)


def normalize_llm_state_dict(sd: Mapping[str, torch.Tensor], file: str = LLM_FILE) -> dict[str, torch.Tensor]:
    """`llm.model.model.X` -> `backbone.X`; the tied, unused `llm.model.lm_head.weight` is dropped."""
    missing = [k for k in (LLM_TIED_HEAD, *LLM_OWN_KEYS) if k not in sd]
    if not any(k.startswith(LLM_BACKBONE_PREFIX) for k in sd):
        missing.insert(0, f"{LLM_BACKBONE_PREFIX}*")
    if missing:
        raise ModelDirError(file, f"missing keys {_short_list(missing)}")
    return {("backbone." + k[len(LLM_BACKBONE_PREFIX):] if k.startswith(LLM_BACKBONE_PREFIX) else k): v
            for k, v in sd.items() if k != LLM_TIED_HEAD}


def normalize_hift_state_dict(sd: Mapping[str, torch.Tensor], file: str = HIFT_FILE) -> dict[str, torch.Tensor]:
    """Strip an optional leading `generator.` and fold weight norm."""
    stripped: dict[str, torch.Tensor] = {}
    for k, v in sd.items():
        name = k[len("generator."):] if k.startswith("generator.") else k
        if name in stripped:
            raise ModelDirError(file, f"{name} appears both with and without the generator. prefix")
        stripped[name] = v
    return fold_weight_norm(stripped, file)


# ---------------------------------------------------------------------------------------------------
# The model directory
# ---------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ModelDir:
    path: Path
    dims: ModelDims
    recipe: dict = field(repr=False, compare=False, hash=False)

    def file(self, name: str) -> Path:
        return self.path / name

    @property
    def blank_en_dir(self) -> Path:
        return self.path / BLANK_EN_DIR

    @property
    def campplus_onnx(self) -> Path:
        return self.path / CAMPPLUS_FILE

    @property
    def speech_tokenizer_onnx(self) -> Path:
        return self.path / SPEECH_TOKENIZER_FILE

    @property
    def spk2info_path(self) -> Path | None:
        p = self.path / SPK2INFO_FILE
        return p if p.is_file() else None

    def llm_state_dict(self) -> dict[str, torch.Tensor]:
        return normalize_llm_state_dict(load_state_dict_file(self.path / LLM_FILE, LLM_FILE))

    def flow_state_dict(self) -> dict[str, torch.Tensor]:
        return load_state_dict_file(self.path / FLOW_FILE, FLOW_FILE)

    def hift_state_dict(self) -> dict[str, torch.Tensor]:
        return normalize_hift_state_dict(load_state_dict_file(self.path / HIFT_FILE, HIFT_FILE))

    def tokenizer(self):
        """The CosyVoice2 `TextTokenizer` of this directory (cached per directory)."""
        from async_cosyvoice.frontend.tokenizer import TextTokenizer, TokenizerError
        try:
            return TextTokenizer.from_dir(self.blank_en_dir)
        except TokenizerError as e:
            file = BLANK_EN_DIR if e.file == BLANK_EN_DIR else f"{BLANK_EN_DIR}/{e.file}"
            raise ModelDirError(file, e.message) from e


def _read_qwen_config(root: Path) -> dict:
    p = root / QWEN_CONFIG
    if not p.is_file():
        raise ModelDirError(QWEN_CONFIG, f"missing (expected the Qwen2 backbone config at {p})")
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelDirError(QWEN_CONFIG, f"not valid JSON ({e})") from e
    if not isinstance(data, dict):
        raise ModelDirError(QWEN_CONFIG, f"expected a JSON object, got {type(data).__name__}")
    return data


def load_model_dir(path: str | Path) -> ModelDir:
    """Parse and check an official-format CosyVoice2 model directory (weights are loaded lazily)."""
    root = Path(path).expanduser().resolve()
    if not root.is_dir():
        raise ModelDirError(str(path), "not a directory (expected a CosyVoice2 model directory)")
    yaml_path = root / YAML_FILE
    if not yaml_path.is_file():
        other = [n for n in ("cosyvoice3.yaml", "cosyvoice.yaml") if (root / n).is_file()]
        hint = f"; found {other[0]}: only CosyVoice2 directories are supported" if other else ""
        raise ModelDirError(YAML_FILE, f"missing in {root}{hint}")
    try:
        text = yaml_path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ModelDirError(YAML_FILE, f"unreadable ({e})") from e
    recipe = load_recipe(text, overrides={"qwen_pretrain_path": str(root / BLANK_EN_DIR)})
    dims = model_dims_from_recipe(recipe, qwen2_dims_from_config(_read_qwen_config(root)))
    for name in REQUIRED_FILES:
        if not (root / name).is_file():
            raise ModelDirError(name, f"missing in {root}")
    return ModelDir(root, dims, recipe)


# ---------------------------------------------------------------------------------------------------
# Strict module loading
# ---------------------------------------------------------------------------------------------------

def load_strict(module: torch.nn.Module, state_dict: Mapping[str, torch.Tensor], source_file: str) -> None:
    """`module.load_state_dict(strict=True)`, but a mismatch raises `ModelDirError` naming the file,
    the missing and unexpected keys and the shape mismatches."""
    expected = module.state_dict()
    missing = [k for k in expected if k not in state_dict]
    unexpected = [k for k in state_dict if k not in expected]
    mismatched = [f"{k} (file {tuple(state_dict[k].shape)}, model {tuple(v.shape)})"
                  for k, v in expected.items() if k in state_dict and state_dict[k].shape != v.shape]
    problems = []
    if missing:
        problems.append(f"missing keys {_short_list(missing)}")
    if unexpected:
        problems.append(f"unexpected keys {_short_list(unexpected)}")
    if mismatched:
        problems.append(f"shape mismatches {_short_list(mismatched)}")
    if problems:
        raise ModelDirError(source_file, "; ".join(problems) + f" (module {type(module).__name__})")
    module.load_state_dict(dict(state_dict), strict=True)


class Models(NamedTuple):
    llm: torch.nn.Module | None
    flow: torch.nn.Module
    hift: torch.nn.Module


def build_models(model_dir: ModelDir | str | Path, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32, llm_dtype: torch.dtype | None = None,
                 with_llm: bool = True) -> Models:
    """Build `CosyVoice2LM`, `Flow` and `HiFT` from the dims, load the weights strictly, move them to
    `device` (flow in `dtype`, the LM in `llm_dtype` (default `dtype`), HiFT always float32) and put
    them in eval mode. `with_llm=False` leaves `Models.llm` None (an engine that loads the LM itself)."""
    from async_cosyvoice.models.flow.flow import Flow
    from async_cosyvoice.models.hift import HiFT
    from async_cosyvoice.models.llm import CosyVoice2LM

    md = model_dir if isinstance(model_dir, ModelDir) else load_model_dir(model_dir)
    parts = [
        (Flow, md.dims.flow, md.flow_state_dict, FLOW_FILE, dtype),
        (HiFT, md.dims.hift, md.hift_state_dict, HIFT_FILE, torch.float32),
    ]
    if with_llm:
        parts.insert(0, (CosyVoice2LM, md.dims.lm, md.llm_state_dict, LLM_FILE, llm_dtype or dtype))
    built = [] if with_llm else [None]
    for cls, dims, loader, file, mod_dtype in parts:
        module = cls(dims)
        sd = loader()
        load_strict(module, sd, file)
        del sd
        built.append(module.to(device=device, dtype=mod_dtype).eval())
    return Models(*built)


@functools.lru_cache(maxsize=4)
def _cached_model_dir(resolved: str) -> ModelDir:
    return load_model_dir(resolved)


def cached_model_dir(path: str | Path) -> ModelDir:
    """`load_model_dir` memoized per resolved path (the directory is treated as immutable)."""
    return _cached_model_dir(str(Path(path).expanduser().resolve()))
