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

from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch

from ..errors import InvalidRequest
from ..models.dims import SPEECH_TOKEN_SIZE
from ..files import atomic_writer
from ..request import Voice
from .prompt import EMBEDDING_DIM

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


Tokenize = Callable[[str], Sequence[int]]


def _zero_shot(spk_id: str, tokens: np.ndarray, feat: np.ndarray, embedding: np.ndarray, text: str,
               text_tokens: np.ndarray | None, tokenize: Tokenize | None) -> Voice:
    if text_tokens is None:
        if tokenize is None:
            raise Spk2InfoError(f"speaker {spk_id!r} stores its prompt text only as a string; "
                                "importing it needs the model's text tokenizer")
        text_tokens = np.asarray(list(tokenize(text)), dtype=np.int32)
    return Voice(tokens, feat, embedding, text, text_tokens)


# ---------------------------------------------------------------------------------------------
# Import


def load_spk2info(path: str | Path, tokenize: Tokenize | None = None) -> dict[str, Voice]:
    """Read an upstream/peer `spk2info.pt` (weights-only unpickling): speaker id -> Voice, in file
    order. Peer entries that store their transcript only as text need `tokenize`."""
    path = Path(path)
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise
    except Exception as e:  # torch wraps unpickling failures in several exception types
        raise Spk2InfoError(f"{path}: not a loadable spk2info file (torch.load weights_only=True): "
                            f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
    return parse_spk2info(obj, source=str(path), tokenize=tokenize)


def parse_spk2info(obj: Any, source: str = "spk2info", tokenize: Tokenize | None = None) -> dict[str, Voice]:
    """A loaded spk2info dict (speaker id -> entry) -> speaker id -> Voice, in dict order."""
    if not isinstance(obj, Mapping):
        raise Spk2InfoError(f"{source}: expected a dict speaker id -> entry, got {type(obj).__name__}")
    voices = {}
    for spk_id, entry in obj.items():
        if not isinstance(spk_id, str):
            raise Spk2InfoError(f"{source}: speaker ids must be strings, got {spk_id!r}")
        voices[spk_id] = parse_entry(spk_id, entry, tokenize)
    return voices


def parse_entry(spk_id: str, entry: Any, tokenize: Tokenize | None = None) -> Voice:
    """One spk2info entry -> its Voice; `Spk2InfoError` naming the entry for any other layout."""
    if not isinstance(entry, Mapping):
        raise Spk2InfoError(f"speaker {spk_id!r}: expected a dict entry, got {type(entry).__name__}")
    keys = frozenset(entry)
    if keys == UPSTREAM_ZERO_SHOT_KEYS:
        return _parse_upstream_zero_shot(spk_id, entry)
    if keys == UPSTREAM_SFT_KEYS:
        return Voice.embedding_only(_embedding(entry["embedding"], spk_id, "embedding"))
    if PEER_KEYS <= keys <= PEER_KEYS | PEER_OPTIONAL_KEYS and isinstance(entry["prompt_text"], str):
        return _parse_peer(spk_id, entry, tokenize)
    raise Spk2InfoError(
        f"speaker {spk_id!r}: unrecognised entry with keys {sorted(map(str, keys))}; expected the upstream zero-shot "
        f"layout {sorted(UPSTREAM_ZERO_SHOT_KEYS)}, the upstream sft layout ['embedding'], or the peer layout "
        f"{sorted(PEER_KEYS)} (prompt_text a string)")


def _parse_upstream_zero_shot(spk_id: str, e: Mapping) -> Voice:
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
    return Voice(flow_tok, feat, flow_emb, "", text)


def _parse_peer(spk_id: str, e: Mapping, tokenize: Tokenize | None) -> Voice:
    tokens = _tokens(e["speech_token"], spk_id, "speech_token")
    feat = _feat(e["speech_feat"], spk_id, "speech_feat")
    text_tokens = None
    if e.get("prompt_text_token") is not None:
        text_tokens = _tokens(e["prompt_text_token"], spk_id, "prompt_text_token", vocab=None)
    n = min(feat.shape[0] // 2, len(tokens))  # aligned to 2 frames per token, like upstream's frontend
    if n == 0:
        raise Spk2InfoError(f"speaker {spk_id!r}: no prompt speech tokens")
    return _zero_shot(spk_id, tokens[:n], feat[:2 * n], _embedding(e["embedding"], spk_id, "embedding"),
                      e["prompt_text"], text_tokens, tokenize)


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


def to_upstream_entry(spk_id: str, voice: Voice) -> dict[str, torch.Tensor]:
    """The upstream dict for one voice: the `add_zero_shot_spk` layout for zero-shot voices,
    `{"embedding": (1, 192)}` for sft voices."""
    emb = torch.from_numpy(voice.embedding.copy())[None]
    if voice.kind == "sft":
        return {"embedding": emb}
    if not voice.is_aligned:
        raise Spk2InfoError(f"speaker {spk_id!r}: {voice.speech_feat.shape[0]} mel frames for "
                            f"{voice.n_tokens} tokens; upstream entries hold exactly 2 frames per token")

    def ids(a: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.from_numpy(np.asarray(a, np.int32).copy())[None], torch.tensor([len(a)], dtype=torch.int32)

    prompt_text, prompt_text_len = ids(voice.prompt_text_tokens)
    llm_tok, llm_tok_len = ids(voice.speech_tokens)
    flow_tok, flow_tok_len = ids(voice.speech_tokens)
    return {
        "prompt_text": prompt_text, "prompt_text_len": prompt_text_len,
        "llm_prompt_speech_token": llm_tok, "llm_prompt_speech_token_len": llm_tok_len,
        "flow_prompt_speech_token": flow_tok, "flow_prompt_speech_token_len": flow_tok_len,
        "prompt_speech_feat": torch.from_numpy(voice.speech_feat.copy())[None],
        "prompt_speech_feat_len": torch.tensor([voice.speech_feat.shape[0]], dtype=torch.int32),
        "llm_embedding": emb, "flow_embedding": emb.clone(),
    }


def export_spk2info(voices: Mapping[str, Voice]) -> dict[str, dict[str, torch.Tensor]]:
    """speaker id -> Voice  ->  the upstream spk2info dict (speaker id -> entry)."""
    return {spk_id: to_upstream_entry(spk_id, voice) for spk_id, voice in voices.items()}


def save_spk2info(voices: Mapping[str, Voice], path: str | Path) -> None:
    """Write voices (speaker id -> Voice) as an upstream-loadable `spk2info.pt`, atomically (temp file + rename)."""
    data = export_spk2info(voices)
    with atomic_writer(path) as tmp:
        torch.save(data, tmp)
