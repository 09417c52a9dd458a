"""CosyVoice2 text-to-speech-token LM: a Qwen2 backbone between speech-token embeddings and head.

Prompt layout (facts §2.4): [llm_embedding[sos]; embed_tokens(text); llm_embedding[task];
speech_embedding(prompt speech)]. The output head is `llm_decoder` on the post-norm hidden state;
the Qwen text head is never used (the official `llm.model.lm_head.weight` is dropped on load).
"""
from __future__ import annotations

from enum import Enum
from typing import Callable, Sequence

import numpy as np
import torch
from torch import Tensor, nn

from .dims import EOS_TOKEN, SOS_ROW, SPEECH_VOCAB, STOP_TOKENS, TASK_ROW, LMDims
from .qwen2 import KVCache, Qwen2Model

# (log-probs [V], tokens decoded so far) -> next token id
Sampler = Callable[[Tensor, Sequence[int]], int]


class Table(Enum):
    """The three input embedding tables; an LM input row is (table, id)."""
    LLM = "llm"        # llm_embedding: SOS_ROW, TASK_ROW
    TEXT = "text"      # the Qwen text embedding (backbone.embed_tokens)
    SPEECH = "speech"  # speech_embedding


Part = tuple[Table, tuple[int, ...]]  # consecutive input rows from one table
SOS: Part = (Table.LLM, (SOS_ROW,))
TASK: Part = (Table.LLM, (TASK_ROW,))


def prompt_parts(text_tokens: Sequence[int], prompt_speech_tokens: Sequence[int]) -> tuple[Part, ...]:
    """The unistream prompt (facts §2.4): [sos; text; task; prompt speech]."""
    return SOS, (Table.TEXT, tuple(text_tokens)), TASK, (Table.SPEECH, tuple(prompt_speech_tokens))


def input_rows(parts: Sequence[Part]) -> list[tuple[Table, int]]:
    """Parts flattened to one (table, id) per LM input row."""
    return [(table, i) for table, ids in parts for i in ids]


class CosyVoice2LM(nn.Module):
    def __init__(self, dims: LMDims):
        super().__init__()
        self.dims = dims
        hidden = dims.qwen.hidden_size
        self.backbone = Qwen2Model(dims.qwen)
        self.llm_embedding = nn.Embedding(2, hidden)
        self.speech_embedding = nn.Embedding(SPEECH_VOCAB, hidden)
        self.llm_decoder = nn.Linear(hidden, SPEECH_VOCAB, bias=True)

    def embed_prompt(self, text_tokens: Sequence[int] | Tensor, prompt_speech_tokens: Sequence[int] | Tensor) -> Tensor:
        """[L, H] prefill embeddings, L = len(text) + len(prompt speech) + 2."""
        text, speech = (_token_ids(t) for t in (text_tokens, prompt_speech_tokens))
        return self.embed_parts(prompt_parts(text, speech))

    def embed_parts(self, parts: Sequence[Part]) -> Tensor:
        """[L, H] embeddings of input rows given as parts, L = the total number of ids."""
        tables = {Table.LLM: self.llm_embedding, Table.TEXT: self.backbone.embed_tokens,
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

        At most `max_len` steps; EOS (6561) is masked while fewer than `min_len` tokens are out;
        any stop id ends the loop and is not returned. `sampler` sees float32 log-probs.
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
                logp[EOS_TOKEN] = -float("inf")
            token = sampler(logp, out)
            if token in STOP_TOKENS:
                break
            out.append(token)
            x = self.embed_speech(torch.tensor([[token]], device=x.device))
            positions = torch.tensor([[prompt_len + step]], device=x.device)
        return out


def _token_ids(tokens: Sequence[int] | Tensor) -> tuple[int, ...]:
    """Flat ids of a tensor, list or (read-only) numpy array."""
    return tuple(tokens.reshape(-1).tolist() if isinstance(tokens, Tensor) else np.asarray(tokens).reshape(-1).tolist())
