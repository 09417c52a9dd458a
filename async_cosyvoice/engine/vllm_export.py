"""Export an official CosyVoice2 or CosyVoice3 LM (`llm.pt` + `CosyVoice-BlankEN/config.json`) into the
HF-style directory that vLLM loads with `CosyVoice2ForCausalLM` (vllm_model.py).

The export is automatic and cached: `export_for_vllm(model_dir)` returns
`<cache_dir>/<key>`, where the key hashes the source files' path, size and mtime, the dtype and
the export format version, so editing or replacing `llm.pt` produces a fresh export. Directories
are written under a temporary name and renamed into place (atomic on one filesystem); exports of
the same source with an older key are removed afterwards.

Layout written (facts §7.4, environment.md "Model directory and class"):
- `config.json`: the BlankEN Qwen2 config with `architectures: ["CosyVoice2ForCausalLM"]`,
  `vocab_size` = the speech vocabulary V (CosyVoice2 6564, CosyVoice3 6761), `cosyvoice_lm_head_bias`
  (CosyVoice3's head has none), `tie_word_embeddings` false and no bos/eos ids;
- `model.safetensors`: HF Qwen2 names; `model.embed_tokens.weight` = `speech_embedding`,
  `lm_head.weight` (and `.bias`) = `llm_decoder`, the backbone under `model.`; and `input_rows.weight` =
  the 2 `llm_embedding` rows (zeros for CosyVoice3, whose sos/task are speech rows) then the Qwen
  text embedding, for prompts given as ids (bistream chunks): input id i < V is speech id i, V + r
  is llm_embedding row r (sos, task) and V + 2 + t is text id t (`input_ids()` maps typed rows).
No `generation_config.json` (its eos ids would become extra stop ids in vLLM) and no tokenizer
(the engine runs with `skip_tokenizer_init`; unistream prompts go in as embeddings). The tied
text head stays out.
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
from ..model_dir import LLM_FILE, QWEN_CONFIG, load_state_dict_file, model_kind, normalize_llm_state_dict
from ..models.dims import SpeechIds
from ..models.llm import Part, Table

log = logging.getLogger(__name__)

EXPORT_VERSION = 3  # 3: CosyVoice3 (vocabulary from the kind, optional head bias)
LLM_ROWS = 2  # llm_embedding rows (sos, task) in input_rows, before the text rows
INPUT_ROWS_KEY = "input_rows.weight"
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
    h = hashlib.sha256(f"v{EXPORT_VERSION}|{dtype_name(dtype)}|{model_dir}|{model_kind(model_dir)}".encode())
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
    kind = model_kind(model_dir)
    ids = SpeechIds.of(kind)
    config = json.loads((model_dir / QWEN_CONFIG).read_text())
    state = normalize_llm_state_dict(load_state_dict_file(model_dir / LLM_FILE, LLM_FILE), kind=kind)
    tensors = convert_state_dict(state, dtype, ids.vocab)
    del state
    hidden = tensors["model.embed_tokens.weight"].shape[1]
    if tensors[INPUT_ROWS_KEY].shape[0] != LLM_ROWS + config.get("vocab_size", -1):
        raise ModelDirError(QWEN_CONFIG, f"vocab_size={config.get('vocab_size')} but llm.pt has "
                            f"{tensors[INPUT_ROWS_KEY].shape[0] - 2} text embedding rows")
    if config.get("hidden_size") != hidden:
        raise ModelDirError(QWEN_CONFIG, f"hidden_size={config.get('hidden_size')} but "
                            f"llm.pt has speech embeddings of width {hidden}")
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(
        export_config(config, dtype, ids.vocab, "lm_head.bias" in tensors), indent=2))


def convert_state_dict(state: dict[str, torch.Tensor], dtype: torch.dtype, vocab: int) -> dict[str, torch.Tensor]:
    """Normalized LM state dict (model_dir: `backbone.*`, `speech_embedding`, `llm_decoder`, …) ->
    HF Qwen2 names with the speech vocabulary (`vocab` rows) as the model vocabulary."""
    text = state["backbone.embed_tokens.weight"]
    llm_rows = state.get("llm_embedding.weight", text.new_zeros(LLM_ROWS, text.shape[1]))
    out: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": state["speech_embedding.weight"],
        "lm_head.weight": state["llm_decoder.weight"],
        INPUT_ROWS_KEY: torch.cat([llm_rows, text]),
    }
    if "llm_decoder.bias" in state:
        out["lm_head.bias"] = state["llm_decoder.bias"]
    for name, tensor in state.items():
        if name.startswith("backbone.") and not name.startswith("backbone.embed_tokens."):
            out["model." + name[len("backbone."):]] = tensor
    for name in ("model.embed_tokens.weight", "lm_head.weight", "lm_head.bias"):
        if name in out and out[name].shape[0] != vocab:
            raise ModelDirError(LLM_FILE, f"{name} has {out[name].shape[0]} rows, expected {vocab}")
    return {k: v.to(dtype=dtype, copy=True).contiguous() for k, v in out.items()}


def input_ids(parts: tuple[Part, ...] | list[Part], vocab: int) -> list[int]:
    """Typed LM input rows as the exported model's input ids, for a speech vocabulary of `vocab`
    rows (see the module docstring)."""
    base = {Table.SPEECH: 0, Table.LLM: vocab, Table.TEXT: vocab + LLM_ROWS}
    return [base[table] + i for table, ids in parts for i in ids]


def export_config(qwen_config: dict, dtype: torch.dtype, vocab: int, head_bias: bool = True) -> dict:
    """The BlankEN Qwen2 config turned into the speech LM's: own vocabulary, untied, no eos."""
    config = {k: v for k, v in qwen_config.items() if k not in ("bos_token_id", "eos_token_id", "pad_token_id")}
    name = str(dtype).removeprefix("torch.")
    config.update({
        "architectures": [ARCHITECTURE],
        "model_type": "qwen2",
        "vocab_size": vocab,
        "cosyvoice_input_rows": LLM_ROWS + qwen_config["vocab_size"],  # rows of input_rows.weight
        "cosyvoice_lm_head_bias": head_bias,
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
