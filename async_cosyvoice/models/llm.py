"""CosyVoice2 text-to-speech-token LM: a Qwen2 backbone between speech-token embeddings and head.

Prompt layout (facts §2.4): [llm_embedding[sos]; embed_tokens(text); llm_embedding[task];
speech_embedding(prompt speech)]. The output head is `llm_decoder` on the post-norm hidden state;
the Qwen text head is never used (the official `llm.model.lm_head.weight` is dropped on load).
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import Tensor, nn

from .dims import EOS_TOKEN, SOS_ROW, SPEECH_VOCAB, STOP_TOKENS, TASK_ROW, LMDims
from .qwen2 import KVCache, Qwen2Model

# (log-probs [V], tokens decoded so far) -> next token id
Sampler = Callable[[Tensor, Sequence[int]], int]


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
        device = self.speech_embedding.weight.device
        text = torch.as_tensor(text_tokens, dtype=torch.long, device=device).reshape(-1)
        speech = torch.as_tensor(prompt_speech_tokens, dtype=torch.long, device=device).reshape(-1)
        rows = self.llm_embedding.weight
        return torch.cat([rows[SOS_ROW:SOS_ROW + 1], self.backbone.embed_tokens(text),
                          rows[TASK_ROW:TASK_ROW + 1], self.speech_embedding(speech)])

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
