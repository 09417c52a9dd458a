"""Import and export of `spk2info.pt` speaker files (facts sheet §6.8).

Three entry layouts are recognised; anything else is refused with a message naming the entry:

- upstream zero-shot (`CosyVoice2.add_zero_shot_spk`): `prompt_text` (1, L) int, `prompt_text_len`,
  `llm_prompt_speech_token` / `flow_prompt_speech_token` (1, P) int and their `_len`,
  `prompt_speech_feat` (1, 2P, 80) float and `_len`, `llm_embedding` / `flow_embedding` (1, 192);
- upstream sft: only `embedding` (1, 192);
- the peer layout (qi-hua/async_cosyvoice, used by the Triton runtime): `prompt_text` (str),
  `speech_token`, `speech_feat`, `embedding`, optionally `prompt_text_token`, `name`, `spk_id`.

Files are read with `torch.load(weights_only=True)`, so no pickled code is ever executed.
"""
from __future__ import annotations

import dataclasses
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Literal, Mapping, Sequence

import numpy as np
import torch

from ..errors import InvalidRequest
from ..models.dims import SPEECH_TOKEN_SIZE
from .prompt import EMBEDDING_DIM, PromptFeatures

N_MELS = 80

UPSTREAM_ZERO_SHOT_KEYS = frozenset({
    "prompt_text", "prompt_text_len",
    "llm_prompt_speech_token", "llm_prompt_speech_token_len",
    "flow_prompt_speech_token", "flow_prompt_speech_token_len",
    "prompt_speech_feat", "prompt_speech_feat_len",
    "llm_embedding", "flow_embedding",
})
UPSTREAM_SFT_KEYS = frozenset({"embedding"})
PEER_KEYS = frozenset({"prompt_text", "speech_token", "speech_feat", "embedding"})
PEER_OPTIONAL_KEYS = frozenset({"prompt_text_token", "name", "spk_id"})


class Spk2InfoError(InvalidRequest):
    """A speaker file or entry that is not one of the recognised layouts, or is inconsistent."""


Layout = Literal["upstream_zero_shot", "upstream_sft", "peer"]
Kind = Literal["zero_shot", "sft"]


@dataclass(frozen=True, eq=False)
class Spk2InfoEntry:
    """One imported speaker. The field names match `speakers.SpeakerRecord`, so a record of the
    store converts field by field (and `save_spk2info` accepts either).

    zero_shot: aligned prompt tokens int32 [P] and mel float32 [2P, 80], the embedding float32
    [192], and the prompt transcript as token ids (`prompt_text_tokens`, upstream layout) and/or
    text (`prompt_text`, peer layout; "" when unknown). sft: the embedding only.
    """
    speaker_id: str
    kind: Kind
    layout: Layout
    prompt_text: str
    prompt_text_tokens: np.ndarray | None  # None only for peer entries stored without token ids
    speech_tokens: np.ndarray
    speech_feat: np.ndarray
    embedding: np.ndarray

    @property
    def prompt(self) -> PromptFeatures:
        """The voice for `build_model_input` (embedding only for sft speakers)."""
        return PromptFeatures(self.speech_tokens, self.speech_feat, self.embedding)

    def text_tokens(self, tokenize: Callable[[str], Sequence[int]] | None = None) -> np.ndarray:
        """The prompt transcript as int32 ids; tokenizes `prompt_text` when only the text is stored."""
        return _text_tokens(self, tokenize)

    def replace_id(self, speaker_id: str) -> "Spk2InfoEntry":
        return dataclasses.replace(self, speaker_id=speaker_id)


def _zero_shot(spk_id: str, layout: Layout, prompt: PromptFeatures, text_tokens: np.ndarray | None,
               text: str) -> Spk2InfoEntry:
    return Spk2InfoEntry(spk_id, "zero_shot", layout, text, text_tokens,
                         prompt.speech_tokens, prompt.speech_feat, prompt.embedding)


def _sft(spk_id: str, embedding: Any) -> Spk2InfoEntry:
    return Spk2InfoEntry(spk_id, "sft", "upstream_sft", "", np.zeros(0, np.int32), np.zeros(0, np.int32),
                         np.zeros((0, N_MELS), np.float32), _embedding(embedding, spk_id, "embedding"))


def _text_tokens(record: Any, tokenize: Callable[[str], Sequence[int]] | None) -> np.ndarray:
    tokens = getattr(record, "prompt_text_tokens", None)
    if tokens is not None:
        return np.asarray(tokens, dtype=np.int32).reshape(-1)
    if tokenize is None:
        raise Spk2InfoError(f"speaker {record.speaker_id!r} stores its prompt text only as a string; "
                            "a text tokenizer is needed to use it")
    return np.asarray(list(tokenize(record.prompt_text)), dtype=np.int32)


# ---------------------------------------------------------------------------------------------
# Import


def load_spk2info(path: str | Path) -> list[Spk2InfoEntry]:
    """Read an upstream/peer `spk2info.pt` (weights-only unpickling) into records, in file order."""
    path = Path(path)
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise
    except Exception as e:  # torch wraps unpickling failures in several exception types
        raise Spk2InfoError(f"{path}: not a loadable spk2info file (torch.load weights_only=True): "
                            f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
    return parse_spk2info(obj, source=str(path))


def parse_spk2info(obj: Any, source: str = "spk2info") -> list[Spk2InfoEntry]:
    """A loaded spk2info dict (speaker id -> entry) -> records, in dict order."""
    if not isinstance(obj, Mapping):
        raise Spk2InfoError(f"{source}: expected a dict speaker id -> entry, got {type(obj).__name__}")
    records = []
    for spk_id, entry in obj.items():
        if not isinstance(spk_id, str):
            raise Spk2InfoError(f"{source}: speaker ids must be strings, got {spk_id!r}")
        records.append(parse_entry(spk_id, entry))
    return records


def parse_entry(spk_id: str, entry: Any) -> Spk2InfoEntry:
    """One spk2info entry -> a record; `Spk2InfoError` naming the entry for any other layout."""
    if not isinstance(entry, Mapping):
        raise Spk2InfoError(f"speaker {spk_id!r}: expected a dict entry, got {type(entry).__name__}")
    keys = frozenset(entry)
    if keys == UPSTREAM_ZERO_SHOT_KEYS:
        return _parse_upstream_zero_shot(spk_id, entry)
    if keys == UPSTREAM_SFT_KEYS:
        return _sft(spk_id, entry["embedding"])
    if PEER_KEYS <= keys <= PEER_KEYS | PEER_OPTIONAL_KEYS and isinstance(entry["prompt_text"], str):
        return _parse_peer(spk_id, entry)
    raise Spk2InfoError(
        f"speaker {spk_id!r}: unrecognised entry with keys {sorted(map(str, keys))}; expected the upstream zero-shot "
        f"layout {sorted(UPSTREAM_ZERO_SHOT_KEYS)}, the upstream sft layout ['embedding'], or the peer layout "
        f"{sorted(PEER_KEYS)} (prompt_text a string)")


def _parse_upstream_zero_shot(spk_id: str, e: Mapping) -> Spk2InfoEntry:
    text = _tokens(e["prompt_text"], spk_id, "prompt_text", vocab=None)
    llm_tok = _tokens(e["llm_prompt_speech_token"], spk_id, "llm_prompt_speech_token")
    flow_tok = _tokens(e["flow_prompt_speech_token"], spk_id, "flow_prompt_speech_token")
    feat = _feat(e["prompt_speech_feat"], spk_id, "prompt_speech_feat")
    llm_emb = _embedding(e["llm_embedding"], spk_id, "llm_embedding")
    flow_emb = _embedding(e["flow_embedding"], spk_id, "flow_embedding")
    for name, n in (("prompt_text", len(text)), ("llm_prompt_speech_token", len(llm_tok)),
                    ("flow_prompt_speech_token", len(flow_tok)), ("prompt_speech_feat", feat.shape[0])):
        stored = _length(e[name + "_len"], spk_id, name + "_len")
        if stored != n:
            raise Spk2InfoError(f"speaker {spk_id!r}: {name}_len is {stored} but {name} has {n}")
    if not np.array_equal(llm_tok, flow_tok):
        raise Spk2InfoError(f"speaker {spk_id!r}: llm_prompt_speech_token and flow_prompt_speech_token differ; "
                            "a stored speaker has one prompt token sequence")
    if not np.array_equal(llm_emb, flow_emb):
        raise Spk2InfoError(f"speaker {spk_id!r}: llm_embedding and flow_embedding differ; "
                            "a stored speaker has one embedding")
    if feat.shape[0] != 2 * len(flow_tok):
        raise Spk2InfoError(f"speaker {spk_id!r}: prompt_speech_feat has {feat.shape[0]} frames for "
                            f"{len(flow_tok)} tokens; CosyVoice2 entries hold exactly 2 frames per token")
    return _zero_shot(spk_id, "upstream_zero_shot", PromptFeatures(flow_tok, feat, flow_emb), text, "")


def _parse_peer(spk_id: str, e: Mapping) -> Spk2InfoEntry:
    tokens = _tokens(e["speech_token"], spk_id, "speech_token")
    feat = _feat(e["speech_feat"], spk_id, "speech_feat")
    text_tokens = None
    if e.get("prompt_text_token") is not None:
        text_tokens = _tokens(e["prompt_text_token"], spk_id, "prompt_text_token", vocab=None)
    prompt = PromptFeatures(tokens, feat, _embedding(e["embedding"], spk_id, "embedding")).aligned()
    if prompt.n_tokens == 0:
        raise Spk2InfoError(f"speaker {spk_id!r}: no prompt speech tokens")
    return _zero_shot(spk_id, "peer", prompt, text_tokens, e["prompt_text"])


def _array(value: Any, spk_id: str, name: str) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu()
        return (value.float() if value.dtype == torch.bfloat16 else value).numpy()
    if isinstance(value, np.ndarray):
        return value
    if isinstance(value, (list, tuple)):
        try:
            return np.asarray(value)
        except ValueError:
            pass
    raise Spk2InfoError(f"speaker {spk_id!r}: {name} must be a tensor or a list of numbers, "
                        f"got {type(value).__name__}")


def _tokens(value: Any, spk_id: str, name: str, vocab: int | None = SPEECH_TOKEN_SIZE) -> np.ndarray:
    a = _array(value, spk_id, name)
    if a.ndim == 2 and a.shape[0] == 1:
        a = a[0]
    if a.ndim != 1 or (a.size and not np.issubdtype(a.dtype, np.integer)):
        raise Spk2InfoError(f"speaker {spk_id!r}: {name} must be integer ids of shape (1, N) or (N,), "
                            f"got {a.dtype} {a.shape}")
    if a.size and (a.min() < 0 or (vocab is not None and a.max() >= vocab)):
        limit = f"0..{vocab - 1}" if vocab is not None else ">= 0"
        raise Spk2InfoError(f"speaker {spk_id!r}: {name} has ids outside {limit}")
    return a.astype(np.int32)


def _feat(value: Any, spk_id: str, name: str) -> np.ndarray:
    a = _array(value, spk_id, name)
    if a.ndim == 3 and a.shape[0] == 1:
        a = a[0]
    if a.ndim != 2 or a.shape[1] != N_MELS or not np.issubdtype(a.dtype, np.floating):
        raise Spk2InfoError(f"speaker {spk_id!r}: {name} must be float of shape (1, T, {N_MELS}) or "
                            f"(T, {N_MELS}), got {a.dtype} {a.shape}")
    a = a.astype(np.float32)
    if not np.isfinite(a).all():
        raise Spk2InfoError(f"speaker {spk_id!r}: {name} contains NaN or infinite values")
    return a


def _embedding(value: Any, spk_id: str, name: str) -> np.ndarray:
    a = _array(value, spk_id, name)
    if a.size != EMBEDDING_DIM or a.ndim > 2 or not np.issubdtype(a.dtype, np.floating):
        raise Spk2InfoError(f"speaker {spk_id!r}: {name} must be float of shape (1, {EMBEDDING_DIM}), "
                            f"got {a.dtype} {a.shape}")
    a = a.reshape(-1).astype(np.float32)
    if not np.isfinite(a).all():
        raise Spk2InfoError(f"speaker {spk_id!r}: {name} contains NaN or infinite values")
    return a


def _length(value: Any, spk_id: str, name: str) -> int:
    a = np.asarray([value]) if isinstance(value, int) else _array(value, spk_id, name)
    if a.size != 1 or not np.issubdtype(a.dtype, np.integer):
        raise Spk2InfoError(f"speaker {spk_id!r}: {name} must be one integer, got {a.dtype} {a.shape}")
    return int(a.reshape(-1)[0])


# ---------------------------------------------------------------------------------------------
# Export


def to_upstream_entry(record: Any,
                      tokenize: Callable[[str], Sequence[int]] | None = None) -> dict[str, torch.Tensor]:
    """The upstream dict for one record (an `Spk2InfoEntry` or anything with the same fields, e.g.
    `speakers.SpeakerRecord`): the `add_zero_shot_spk` layout for zero-shot speakers,
    `{"embedding": (1, 192)}` for sft speakers."""
    embedding = _embedding(record.embedding, record.speaker_id, "embedding")
    emb = torch.from_numpy(embedding.copy())[None]
    if record.kind == "sft":
        return {"embedding": emb}
    if record.kind != "zero_shot":
        raise Spk2InfoError(f"speaker {record.speaker_id!r}: unknown kind {record.kind!r}")
    prompt = PromptFeatures(record.speech_tokens, record.speech_feat, embedding)
    if prompt.speech_feat.shape[0] != 2 * prompt.n_tokens:
        raise Spk2InfoError(f"speaker {record.speaker_id!r}: {prompt.speech_feat.shape[0]} mel frames for "
                            f"{prompt.n_tokens} tokens; upstream entries hold exactly 2 frames per token")

    def ids(a: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.from_numpy(np.asarray(a, np.int32).copy())[None], torch.tensor([len(a)], dtype=torch.int32)

    prompt_text, prompt_text_len = ids(_text_tokens(record, tokenize))
    llm_tok, llm_tok_len = ids(prompt.speech_tokens)
    flow_tok, flow_tok_len = ids(prompt.speech_tokens)
    return {
        "prompt_text": prompt_text, "prompt_text_len": prompt_text_len,
        "llm_prompt_speech_token": llm_tok, "llm_prompt_speech_token_len": llm_tok_len,
        "flow_prompt_speech_token": flow_tok, "flow_prompt_speech_token_len": flow_tok_len,
        "prompt_speech_feat": torch.from_numpy(prompt.speech_feat.copy())[None],
        "prompt_speech_feat_len": torch.tensor([prompt.speech_feat.shape[0]], dtype=torch.int32),
        "llm_embedding": emb, "flow_embedding": emb.clone(),
    }


def export_spk2info(records: Iterable[Any],
                    tokenize: Callable[[str], Sequence[int]] | None = None) -> dict[str, dict[str, torch.Tensor]]:
    """Records -> the upstream spk2info dict (speaker id -> entry)."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for r in records:
        if r.speaker_id in out:
            raise Spk2InfoError(f"speaker {r.speaker_id!r} appears twice")
        out[r.speaker_id] = to_upstream_entry(r, tokenize)
    return out


def save_spk2info(records: Iterable[Any], path: str | Path,
                  tokenize: Callable[[str], Sequence[int]] | None = None) -> None:
    """Write records as an upstream-loadable `spk2info.pt`, atomically (temp file + rename)."""
    path = Path(path)
    data = export_spk2info(records, tokenize)
    fd, tmp = tempfile.mkstemp(prefix="." + path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(data, f)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
