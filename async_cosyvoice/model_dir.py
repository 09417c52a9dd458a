"""Read an official CosyVoice2 or CosyVoice3 model directory (`iic/CosyVoice2-0.5B`,
`FunAudioLLM/Fun-CosyVoice3-0.5B-2512` layouts) without upstream code.

- The model kind comes from the directory, as upstream's `AutoModel` decides it: the first of
  `cosyvoice.yaml` (CosyVoice v1: refused), `cosyvoice2.yaml`, `cosyvoice3.yaml` that exists.
- The yaml is parsed by the tag-aware loader of `recipe.py` (`!new:` / `!name:` / `!apply:` kept as
  `Tagged` data, `!ref` resolved); the typed `ModelDims` come from it plus `CosyVoice-BlankEN/config.json`
  (backbone shape) through the tables of `dims_map.py`.
- State dicts are loaded with `torch.load(weights_only=True, mmap=True)` and normalized to the key names our
  modules use: the Qwen2 backbone moves to `backbone.*`, HiFT weight norm is folded into plain weights.
- Modules are built on the meta device (no random init) and the file's tensors assigned to them
  (`load_strict`, `build_models`): a weight is read from the file once, by its move to the dtype and
  device; one that nothing converted is copied off the file's pages (`own_memory`).
- Every problem raises `ModelDirError` naming the file and what was expected.
"""
from __future__ import annotations

import json
import zipfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch

from async_cosyvoice.dims_map import read_dims, read_qwen_dims
from async_cosyvoice.errors import ModelDirError, Unsupported
from async_cosyvoice.frontend.tokenizer import TextTokenizer
from async_cosyvoice.models.cosyvoice3.flow import DiTFlow
from async_cosyvoice.models.cosyvoice3.hift import F0_PREDICTOR_PREFIX, CausalHiFT
from async_cosyvoice.models.cosyvoice3.nsf_noise import FixedNSFNoise
from async_cosyvoice.models.dims import DiTFlowDims, HiFTDims, ModelDims, Qwen2Dims
from async_cosyvoice.models.empty_init import empty_init, finish_empty_init
from async_cosyvoice.models.flow.flow import Flow
from async_cosyvoice.models.hift import HiFT
from async_cosyvoice.models.llm import LM_CLASSES
from async_cosyvoice.recipe import YAML_FILE, YAML_FILES, load_recipe

BLANK_EN_DIR = "CosyVoice-BlankEN"
QWEN_CONFIG = f"{BLANK_EN_DIR}/config.json"
LLM_FILE, FLOW_FILE, HIFT_FILE = "llm.pt", "flow.pt", "hift.pt"
CAMPPLUS_FILE = "campplus.onnx"
SPEECH_TOKENIZER_FILE = "speech_tokenizer_v2.onnx"
SPEECH_TOKENIZER_FILES = {"cosyvoice2": SPEECH_TOKENIZER_FILE, "cosyvoice3": "speech_tokenizer_v3.onnx"}
YAML_FILE_OF = {kind: name for name, kind in YAML_FILES.items()}
SPK2INFO_FILE = "spk2info.pt"
REQUIRED_FILES = (YAML_FILE, QWEN_CONFIG, LLM_FILE, FLOW_FILE, HIFT_FILE, CAMPPLUS_FILE,
                  SPEECH_TOKENIZER_FILE)


def required_files(kind: str) -> tuple[str, ...]:
    return (YAML_FILE_OF[kind], QWEN_CONFIG, LLM_FILE, FLOW_FILE, HIFT_FILE, CAMPPLUS_FILE,
            SPEECH_TOKENIZER_FILES[kind])


LLM_BACKBONE_PREFIX = "llm.model.model."
LLM_TIED_HEAD = "llm.model.lm_head.weight"
LLM_OWN_KEYS = ("llm_embedding.weight", "speech_embedding.weight", "llm_decoder.weight", "llm_decoder.bias")
# CosyVoice3LM: sos/task are speech_embedding rows (no llm_embedding) and llm_decoder has no bias
LLM_OWN_KEYS_BY_KIND = {"cosyvoice2": LLM_OWN_KEYS, "cosyvoice3": ("speech_embedding.weight", "llm_decoder.weight")}


# ---------------------------------------------------------------------------------------------------
# Typed dims
# ---------------------------------------------------------------------------------------------------

def qwen2_dims_from_config(config: Mapping[str, Any], file: str = QWEN_CONFIG) -> Qwen2Dims:
    d = read_qwen_dims(config, file)
    if d.hidden_size % d.num_heads or d.num_heads % d.num_kv_heads:
        raise ModelDirError(file, f"hidden_size {d.hidden_size}, num_attention_heads {d.num_heads} and "
                                  f"num_key_value_heads {d.num_kv_heads} are not divisible")
    return d


def model_dims_from_recipe(recipe: Mapping[str, Any], qwen: Qwen2Dims, file: str = YAML_FILE,
                           kind: str = "cosyvoice2") -> ModelDims:
    """Typed `ModelDims` from a resolved recipe of `kind` and the backbone shape (`dims_map.py`)."""
    dims = read_dims(recipe, qwen, file, kind)
    _check_consistency(dims, file)
    return dims


def _check_consistency(d: ModelDims, file: str) -> None:
    problems = []
    if d.lm.llm_input_size != d.lm.qwen.hidden_size or d.lm.llm_output_size != d.lm.qwen.hidden_size:
        problems.append(f"llm_input_size/llm_output_size {d.lm.llm_input_size}/{d.lm.llm_output_size} "
                        f"!= {QWEN_CONFIG} hidden_size {d.lm.qwen.hidden_size}")
    if d.kind == "cosyvoice3":
        e = d.flow.estimator
        if not (e.mel_dim == e.mu_dim == e.out_channels == d.flow.output_size == d.flow.input_size):
            problems.append(f"flow.decoder.estimator mel_dim/mu_dim/out_channels {e.mel_dim}/{e.mu_dim}/"
                            f"{e.out_channels} and flow input_size/output_size {d.flow.input_size}/"
                            f"{d.flow.output_size} differ (CosyVoice3's mu is the look-ahead output)")
    else:
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


def fold_weight_norm(state_dict: Mapping[str, torch.Tensor], file: str = HIFT_FILE,
                     float64_under: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """Replace weight-norm pairs by plain `<layer>.weight = g * v / ||v||` (norm over all dims but 0),
    for both `<layer>.parametrizations.weight.original0/1` and legacy `<layer>.weight_g/_v` keys.
    Order is kept: the folded weight takes the place of the pair's first key. Layers under a prefix
    of `float64_under` are folded in float64 and kept float64 (CosyVoice3's F0 predictor, which
    upstream runs in float64), the others in float32."""
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
        if layer.startswith(float64_under):
            out[f"{layer}.weight"] = torch._weight_norm(v.double(), g.double(), 0)
        else:
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


def normalize_llm_state_dict(sd: Mapping[str, torch.Tensor], file: str = LLM_FILE,
                             kind: str = "cosyvoice2") -> dict[str, torch.Tensor]:
    """`llm.model.model.X` -> `backbone.X`; the tied, unused `llm.model.lm_head.weight` is dropped."""
    missing = [k for k in (LLM_TIED_HEAD, *LLM_OWN_KEYS_BY_KIND[kind]) if k not in sd]
    if not any(k.startswith(LLM_BACKBONE_PREFIX) for k in sd):
        missing.insert(0, f"{LLM_BACKBONE_PREFIX}*")
    if missing:
        raise ModelDirError(file, f"missing keys {_short_list(missing)}")
    return {("backbone." + k[len(LLM_BACKBONE_PREFIX):] if k.startswith(LLM_BACKBONE_PREFIX) else k): v
            for k, v in sd.items() if k != LLM_TIED_HEAD}


def normalize_hift_state_dict(sd: Mapping[str, torch.Tensor], file: str = HIFT_FILE,
                              float64_under: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """Strip an optional leading `generator.` and fold weight norm (`fold_weight_norm`)."""
    stripped: dict[str, torch.Tensor] = {}
    for k, v in sd.items():
        name = k[len("generator."):] if k.startswith("generator.") else k
        if name in stripped:
            raise ModelDirError(file, f"{name} appears both with and without the generator. prefix")
        stripped[name] = v
    return fold_weight_norm(stripped, file, float64_under)


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
    def kind(self) -> str:
        """"cosyvoice2" or "cosyvoice3": which yaml the directory holds."""
        return self.dims.kind

    @property
    def yaml_file(self) -> str:
        return YAML_FILE_OF[self.kind]

    @property
    def blank_en_dir(self) -> Path:
        return self.path / BLANK_EN_DIR

    @property
    def campplus_onnx(self) -> Path:
        return self.path / CAMPPLUS_FILE

    @property
    def speech_tokenizer_onnx(self) -> Path:
        return self.path / SPEECH_TOKENIZER_FILES[self.kind]

    @property
    def spk2info_path(self) -> Path | None:
        p = self.path / SPK2INFO_FILE
        return p if p.is_file() else None

    def llm_state_dict(self) -> dict[str, torch.Tensor]:
        return normalize_llm_state_dict(load_state_dict_file(self.path / LLM_FILE, LLM_FILE), kind=self.kind)

    def flow_state_dict(self) -> dict[str, torch.Tensor]:
        return load_state_dict_file(self.path / FLOW_FILE, FLOW_FILE)

    def hift_state_dict(self) -> dict[str, torch.Tensor]:
        # CosyVoice3's F0 predictor runs in float64 upstream, its weight norm folded in float64 too
        float64 = (F0_PREDICTOR_PREFIX,) if self.kind == "cosyvoice3" else ()
        return normalize_hift_state_dict(load_state_dict_file(self.path / HIFT_FILE, HIFT_FILE), float64_under=float64)

    def tokenizer(self):
        """The `TextTokenizer` of this directory's kind (cached per directory)."""
        try:
            return TextTokenizer.from_dir(self.blank_en_dir, kind=self.kind)
        except ModelDirError as e:
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


def model_kind(root: Path) -> str:
    """The kind of model directory `root`, by upstream `AutoModel`'s rule: the first of
    `cosyvoice.yaml`, `cosyvoice2.yaml`, `cosyvoice3.yaml` present decides."""
    for name, kind in YAML_FILES.items():
        if (root / name).is_file():
            if kind == "cosyvoice1":
                raise ModelDirError(name, f"{root} is a CosyVoice (v1) model directory, which this server does "
                                          "not serve; use CosyVoice2-0.5B (cosyvoice2.yaml) or "
                                          "Fun-CosyVoice3-0.5B (cosyvoice3.yaml)")
            return kind
    raise ModelDirError(YAML_FILE, f"missing in {root}: a model directory holds cosyvoice2.yaml (CosyVoice2) or "
                                   "cosyvoice3.yaml (CosyVoice3)")


def load_model_dir(path: str | Path) -> ModelDir:
    """Parse and check an official-format CosyVoice2 or CosyVoice3 model directory (weights are loaded
    lazily); the kind is the directory's (`model_kind`)."""
    root = Path(path).expanduser().resolve()
    if not root.is_dir():
        raise ModelDirError(str(path), "not a directory (expected a CosyVoice2 or CosyVoice3 model directory)")
    kind = model_kind(root)
    yaml_file = YAML_FILE_OF[kind]
    try:
        text = (root / yaml_file).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ModelDirError(yaml_file, f"unreadable ({e})") from e
    recipe = load_recipe(text, overrides={"qwen_pretrain_path": str(root / BLANK_EN_DIR)}, file=yaml_file)
    dims = model_dims_from_recipe(recipe, qwen2_dims_from_config(_read_qwen_config(root)), yaml_file, kind)
    for name in required_files(kind):
        if not (root / name).is_file():
            raise ModelDirError(name, f"missing in {root}")
    return ModelDir(root, dims, recipe)


# ---------------------------------------------------------------------------------------------------
# Strict module loading
# ---------------------------------------------------------------------------------------------------

def load_strict(module: torch.nn.Module, state_dict: Mapping[str, torch.Tensor], source_file: str) -> None:
    """`module.load_state_dict(strict=True)`, but a mismatch raises `ModelDirError` naming the file,
    the missing and unexpected keys and the shape mismatches. The file's tensors become the module's
    (`assign=True`: no copy), each in the dtype of the tensor it replaces and on its device (the
    file's for a module built in `empty_init()`, which has no data of its own)."""
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
    module.load_state_dict({k: _like(state_dict[k], v) for k, v in expected.items()}, strict=True, assign=True)


def own_memory(module: torch.nn.Module, state_dict: Mapping[str, torch.Tensor]) -> torch.nn.Module:
    """The tensors of `module` that are still `state_dict`'s (assigned, and already in the dtype and on
    the device asked for: the CPU in the file's dtype) copied into memory of their own. A state dict
    read with mmap is the file's pages: a model file rewritten in place under a running server would
    change its weights, or fault it (SIGBUS) if it got shorter."""
    mapped = {t.untyped_storage().data_ptr() for t in state_dict.values()}
    for sub in module.modules():
        for name, param in sub._parameters.items():
            if param is not None and param.untyped_storage().data_ptr() in mapped:
                param.data = param.data.clone()
        for name, buffer in sub._buffers.items():
            if buffer is not None and buffer.untyped_storage().data_ptr() in mapped:
                sub._buffers[name] = buffer.clone()
    return module


def _like(value: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """`value` as `load_state_dict`'s copy into `target` would leave it: target's dtype (and device,
    unless target is on the meta device), contiguous. No copy when it already is."""
    device = value.device if target.is_meta else target.device
    return value.to(device=device, dtype=target.dtype).contiguous()


def _cosyvoice3_hift(dims: HiFTDims, flow: DiTFlowDims) -> CausalHiFT:
    """CausalHiFT with upstream's NSF noise, which the yaml draws at construction (not in hift.pt)."""
    return CausalHiFT(dims, FixedNSFNoise.replay(flow, dims))


# the flow and vocoder of each kind: (flow class, vocoder factory(hift dims, flow dims))
TOKEN2WAV_CLASSES: dict[str, tuple[Callable, Callable]] = {
    "cosyvoice2": (Flow, lambda dims, flow: HiFT(dims)),
    "cosyvoice3": (DiTFlow, _cosyvoice3_hift),
}


class Models(NamedTuple):
    llm: torch.nn.Module | None
    flow: torch.nn.Module | None
    hift: torch.nn.Module | None


def build_models(model_dir: ModelDir | str | Path, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32, llm_dtype: torch.dtype | None = None,
                 with_llm: bool = True, with_token2wav: bool = True) -> Models:
    """Build the directory kind's LM, flow and HiFT from the dims (`CosyVoice2LM`, `Flow`, `HiFT` or
    their CosyVoice3 counterparts) without initialising them (`models/empty_init.py`), load the weights
    strictly, move them to `device` (flow in `dtype`,
    the LM in `llm_dtype` (default `dtype`), HiFT always float32) and put them in eval mode.
    `with_llm=False` leaves `Models.llm` None (an engine that loads the LM itself);
    `with_token2wav=False` leaves `flow` and `hift` None (a device that runs only the LM)."""
    md = model_dir if isinstance(model_dir, ModelDir) else load_model_dir(model_dir)
    if with_token2wav and md.kind not in TOKEN2WAV_CLASSES:
        raise Unsupported(f"{md.yaml_file}: this build has no {md.kind} flow and vocoder; only its LM loads")
    flow_cls, hift_cls = TOKEN2WAV_CLASSES.get(md.kind, (None, None))

    def load(make, dims, state_dict, file: str, mod_dtype: torch.dtype) -> torch.nn.Module:
        with empty_init():  # every weight comes from the file: no random init to throw away
            module = make(dims)
        sd = state_dict()
        load_strict(module, sd, file)
        module = finish_empty_init(module).to(device=device, dtype=mod_dtype)
        return own_memory(module, sd).eval()

    return Models(
        llm=load(LM_CLASSES[md.kind], md.dims.lm, md.llm_state_dict, LLM_FILE, llm_dtype or dtype)
        if with_llm else None,
        flow=load(flow_cls, md.dims.flow, md.flow_state_dict, FLOW_FILE, dtype) if with_token2wav else None,
        hift=load(lambda d: hift_cls(d, md.dims.flow), md.dims.hift, md.hift_state_dict, HIFT_FILE, torch.float32)
        if with_token2wav else None)
