"""The text-to-speech-token LMs: a Qwen2 backbone between speech-token embeddings and a head.

Prompt layout (facts §2.4): [sos; embed_tokens(text); task; speech_embedding(prompt speech)]. The
output head is `llm_decoder` on the post-norm hidden state; the Qwen text head is never used (the
official `llm.model.lm_head.weight` is dropped on load).

CosyVoice2 (`Qwen2LM` upstream): sos and task are rows 0 and 1 of `llm_embedding`; 6561 + 3 speech
rows, `llm_decoder` with bias. CosyVoice3 (`CosyVoice3LM`): no `llm_embedding` (sos and task are
speech rows 6561 and 6563), 6561 + 200 speech rows, `llm_decoder` without bias; everything else is
shared. `SpeechIds` (dims.py) says each kind's special ids.
"""
from __future__ import annotations

from enum import Enum
from typing import Callable, Sequence

import numpy as np
import torch
from torch import Tensor, nn

from .dims import SOS_ROW, TASK_ROW, LMDims, SpeechIds
from .qwen2 import KVCache, Qwen2Model

# (log-probs [V], tokens decoded so far) -> next token id
Sampler = Callable[[Tensor, Sequence[int]], int]


class Table(Enum):
    """The three input embedding tables; an LM input row is (table, id)."""
    LLM = "llm"        # llm_embedding: SOS_ROW, TASK_ROW (CosyVoice2 only)
    TEXT = "text"      # the Qwen text embedding (backbone.embed_tokens)
    SPEECH = "speech"  # speech_embedding


Part = tuple[Table, tuple[int, ...]]  # consecutive input rows from one table
SOS: Part = (Table.LLM, (SOS_ROW,))  # CosyVoice2's
TASK: Part = (Table.LLM, (TASK_ROW,))


def sos_part(ids: SpeechIds) -> Part:
    return SOS if ids.sos is None else (Table.SPEECH, (ids.sos,))


def task_part(ids: SpeechIds) -> Part:
    return TASK if ids.task is None else (Table.SPEECH, (ids.task,))


def prompt_parts(text_tokens: Sequence[int], prompt_speech_tokens: Sequence[int],
                 ids: SpeechIds = SpeechIds.of("cosyvoice2")) -> tuple[Part, ...]:
    """The unistream prompt (facts §2.4): [sos; text; task; prompt speech]."""
    return (sos_part(ids), (Table.TEXT, tuple(text_tokens)), task_part(ids),
            (Table.SPEECH, tuple(prompt_speech_tokens)))


def input_rows(parts: Sequence[Part]) -> list[tuple[Table, int]]:
    """Parts flattened to one (table, id) per LM input row."""
    return [(table, i) for table, ids in parts for i in ids]


class CosyVoice2LM(nn.Module):
    """CosyVoice2's LM; `CosyVoice3LM` changes only its tables (see the module docstring)."""

    def __init__(self, dims: LMDims):
        super().__init__()
        self.dims = dims
        self.ids = dims.ids
        hidden = dims.qwen.hidden_size
        self.backbone = Qwen2Model(dims.qwen)
        if self.ids.sos is None:
            self.llm_embedding = nn.Embedding(2, hidden)
        self.speech_embedding = nn.Embedding(self.ids.vocab, hidden)
        self.llm_decoder = nn.Linear(hidden, self.ids.vocab, bias=dims.kind == "cosyvoice2")

    def embed_prompt(self, text_tokens: Sequence[int] | Tensor, prompt_speech_tokens: Sequence[int] | Tensor) -> Tensor:
        """[L, H] prefill embeddings, L = len(text) + len(prompt speech) + 2."""
        text, speech = (_token_ids(t) for t in (text_tokens, prompt_speech_tokens))
        return self.embed_parts(prompt_parts(text, speech, self.ids))

    def embed_parts(self, parts: Sequence[Part]) -> Tensor:
        """[L, H] embeddings of input rows given as parts, L = the total number of ids."""
        tables = {Table.LLM: getattr(self, "llm_embedding", None), Table.TEXT: self.backbone.embed_tokens,
                  Table.SPEECH: self.speech_embedding}
        device = self.speech_embedding.weight.device
        return torch.cat([tables[table](torch.tensor(ids, dtype=torch.long, device=device)) for table, ids in parts])

    def embed_speech(self, ids: Tensor) -> Tensor:
        return self.speech_embedding(ids)

    def logits(self, hidden: Tensor) -> Tensor:
        return self.llm_decoder(hidden)

    def new_cache(self, num_slots: int, max_len: int, dtype: torch.dtype | None = None,
                  device: torch.device | str | None = None) -> KVCache:
        w = self.llm_decoder.weight
        return KVCache.for_model(self.dims.qwen, num_slots, max_len, dtype or w.dtype, device or w.device)

    @torch.inference_mode()
    def generate_reference(self, text_tokens: Sequence[int], prompt_speech_tokens: Sequence[int],
                           min_len: int, max_len: int, sampler: Sampler) -> list[int]:
        """Upstream's unistream decode loop for one request, kept plain as the engines' oracle.

        At most `max_len` steps; id 6561 (`ids.min_len_masked`) is masked while fewer than `min_len`
        tokens are out; any stop id ends the loop and is not returned. `sampler` sees float32 log-probs.
        """
        x = self.embed_prompt(text_tokens, prompt_speech_tokens)[None]
        prompt_len = x.shape[1]
        cache = self.new_cache(1, prompt_len + max_len)
        slots = torch.zeros(1, dtype=torch.long, device=x.device)
        positions = torch.arange(prompt_len, device=x.device)[None]
        out: list[int] = []
        for step in range(max_len):
            hidden = self.backbone(x, positions, cache, slots)
            logp = self.logits(hidden[0, -1]).float().log_softmax(-1)
            if step < min_len:
                logp[self.ids.min_len_masked] = -float("inf")
            token = sampler(logp, out)
            if self.ids.is_stop(token):
                break
            out.append(token)
            x = self.embed_speech(torch.tensor([[token]], device=x.device))
            positions = torch.tensor([[prompt_len + step]], device=x.device)
        return out


class CosyVoice3LM(CosyVoice2LM):
    """Fun-CosyVoice3's LM (`dims.kind` "cosyvoice3"): the same module with CosyVoice3's tables."""

    def __init__(self, dims: LMDims):
        if dims.kind != "cosyvoice3":
            raise ValueError(f"CosyVoice3LM needs LMDims(kind='cosyvoice3'), got kind {dims.kind!r}")
        super().__init__(dims)


LM_CLASSES: dict[str, type[CosyVoice2LM]] = {"cosyvoice2": CosyVoice2LM, "cosyvoice3": CosyVoice3LM}


def _token_ids(tokens: Sequence[int] | Tensor) -> tuple[int, ...]:
    """Flat ids of a tensor, list or (read-only) numpy array."""
    return tuple(tokens.reshape(-1).tolist() if isinstance(tokens, Tensor) else np.asarray(tokens).reshape(-1).tolist())
