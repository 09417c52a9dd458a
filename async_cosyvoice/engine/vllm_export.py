"""Export an official CosyVoice2 LM (`llm.pt` + `CosyVoice-BlankEN/config.json`) into the HF-style
directory that vLLM loads with `CosyVoice2ForCausalLM` (vllm_model.py).

The export is automatic and cached: `export_for_vllm(model_dir)` returns
`<cache_dir>/<key>`, where the key hashes the source files' path, size and mtime, the dtype and
the export format version, so editing or replacing `llm.pt` produces a fresh export. Directories
are written under a temporary name and renamed into place (atomic on one filesystem); exports of
the same source with an older key are removed afterwards.

Layout written (facts §7.4, environment.md "Model directory and class"):
- `config.json`: the BlankEN Qwen2 config with `architectures: ["CosyVoice2ForCausalLM"]`,
  `vocab_size` 6564, `tie_word_embeddings` false and no bos/eos ids;
- `model.safetensors`: HF Qwen2 names; `model.embed_tokens.weight` = `speech_embedding`,
  `lm_head.{weight,bias}` = `llm_decoder`, the backbone under `model.`.
No `generation_config.json` (its eos ids would become extra stop ids in vLLM) and no tokenizer
(the engine runs with `skip_tokenizer_init` and embeddings as prompts). The Qwen text embedding,
the tied text head and `llm_embedding` stay out: the engine builds prompts itself.
"""
from __future__ import annotations

import hashlib
import json
import logging
import shutil
from pathlib import Path

import torch

from ..errors import ModelDirError
from ..files import atomic_directory, cache_root
from ..model_dir import LLM_FILE, QWEN_CONFIG, load_state_dict_file, normalize_llm_state_dict
from ..models.dims import SPEECH_VOCAB

log = logging.getLogger(__name__)

EXPORT_VERSION = 1
ARCHITECTURE = "CosyVoice2ForCausalLM"
SOURCE_RECORD = "export_source.json"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"unsupported export dtype {dtype}; use one of {sorted(_DTYPES)}")
        return dtype
    try:
        return _DTYPES[str(dtype).removeprefix("torch.")]
    except KeyError:
        raise ValueError(f"unsupported export dtype {dtype!r}; use one of {sorted(_DTYPES)}") from None


def dtype_name(dtype: str | torch.dtype) -> str:
    return str(resolve_dtype(dtype)).removeprefix("torch.")


def export_key(model_dir: str | Path, dtype: str | torch.dtype = "bfloat16") -> str:
    """Cache key of an export: source path, size and mtime of both inputs, dtype, format version."""
    model_dir = Path(model_dir).resolve()
    h = hashlib.sha256(f"v{EXPORT_VERSION}|{dtype_name(dtype)}|{model_dir}".encode())
    for rel in (LLM_FILE, QWEN_CONFIG):
        path = model_dir / rel
        try:
            st = path.stat()
        except FileNotFoundError:
            raise ModelDirError(str(rel), f"missing in {model_dir} (needed for the vLLM export)") from None
        h.update(f"|{rel}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:20]


def export_for_vllm(model_dir: str | Path, dtype: str | torch.dtype = "bfloat16",
                    cache_dir: str | Path | None = None) -> Path:
    """Return a vLLM-loadable directory for `model_dir`, exporting it first if the cache lacks it."""
    model_dir = Path(model_dir).resolve()
    cache_dir = Path(cache_dir) if cache_dir is not None else cache_root() / "vllm"
    key = export_key(model_dir, dtype)
    target = cache_dir / key
    if _complete(target):
        return target

    log.info("exporting %s (%s) for vLLM into %s", model_dir / LLM_FILE, dtype_name(dtype), target)
    # a damaged earlier export is replaced; a concurrent exporter's finished copy is kept
    with atomic_directory(target, finished=_complete) as tmp:
        write_export(model_dir, tmp, dtype)
        (tmp / SOURCE_RECORD).write_text(json.dumps(
            {"model_dir": str(model_dir), "dtype": dtype_name(dtype), "version": EXPORT_VERSION}))
    _prune_stale(cache_dir, model_dir, dtype_name(dtype), keep=key)
    return target


def _complete(export: Path) -> bool:
    return (export / "config.json").is_file() and (export / "model.safetensors").is_file()


def write_export(model_dir: Path, out_dir: Path, dtype: str | torch.dtype) -> None:
    """Write config.json and model.safetensors for vLLM into out_dir (no caching, no atomicity)."""
    from safetensors.torch import save_file

    dtype = resolve_dtype(dtype)
    config = json.loads((model_dir / QWEN_CONFIG).read_text())
    state = normalize_llm_state_dict(load_state_dict_file(model_dir / LLM_FILE, LLM_FILE))
    tensors = convert_state_dict(state, dtype)
    del state
    hidden = tensors["model.embed_tokens.weight"].shape[1]
    if config.get("hidden_size") != hidden:
        raise ModelDirError(QWEN_CONFIG, f"hidden_size={config.get('hidden_size')} but "
                            f"llm.pt has speech embeddings of width {hidden}")
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(export_config(config, dtype), indent=2))


def convert_state_dict(state: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Normalized LM state dict (model_dir: `backbone.*`, `speech_embedding`, `llm_decoder`, …) ->
    HF Qwen2 names with the speech vocabulary as the model vocabulary."""
    out: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": state["speech_embedding.weight"],
        "lm_head.weight": state["llm_decoder.weight"],
        "lm_head.bias": state["llm_decoder.bias"],
    }
    for name, tensor in state.items():
        if name.startswith("backbone.") and not name.startswith("backbone.embed_tokens."):
            out["model." + name[len("backbone."):]] = tensor
    for name in ("model.embed_tokens.weight", "lm_head.weight", "lm_head.bias"):
        if out[name].shape[0] != SPEECH_VOCAB:
            raise ModelDirError(LLM_FILE, f"{name} has {out[name].shape[0]} rows, expected {SPEECH_VOCAB}")
    return {k: v.to(dtype=dtype, copy=True).contiguous() for k, v in out.items()}


def export_config(qwen_config: dict, dtype: torch.dtype) -> dict:
    """The BlankEN Qwen2 config turned into the speech LM's: own vocabulary, untied, no eos."""
    config = {k: v for k, v in qwen_config.items() if k not in ("bos_token_id", "eos_token_id", "pad_token_id")}
    name = str(dtype).removeprefix("torch.")
    config.update({
        "architectures": [ARCHITECTURE],
        "model_type": "qwen2",
        "vocab_size": SPEECH_VOCAB,
        "tie_word_embeddings": False,
        "torch_dtype": name,
        "dtype": name,
    })
    return config


def _prune_stale(cache_dir: Path, model_dir: Path, dtype: str, keep: str) -> None:
    """Remove older exports of the same source and dtype (a changed llm.pt leaves one behind)."""
    for entry in cache_dir.iterdir():
        if entry.name == keep or entry.name.startswith(".") or not entry.is_dir():
            continue
        try:
            record = json.loads((entry / SOURCE_RECORD).read_text())
        except (OSError, ValueError):
            continue
        if record.get("model_dir") == str(model_dir) and record.get("dtype") == dtype:
            log.info("removing stale vLLM export %s", entry)
            shutil.rmtree(entry, ignore_errors=True)
