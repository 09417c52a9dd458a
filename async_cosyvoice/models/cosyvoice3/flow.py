"""DiTFlow (CausalMaskedDiffWithDiT): CosyVoice3's speech tokens + prompt mel + x-vector -> mel frames.

There is no encoder: mu = the pre-lookahead layer (80 -> lookahead_channels -> 80, leaky-ReLU 0.01)
over the 80-dim token embeddings, each token repeated for its token_mel_ratio mel frames; the DiT
(dit.py) is the CFM's estimator. Batching, prompt conditioning, the streaming state cache and
upstream's one-request `inference` are CosyVoice2's (models/flow/base.py). Parameter names are
those of the official flow.pt, so `load_state_dict(strict=True)` takes it as is.
"""
from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from ..flow.base import MaskedDiffFlow
from ..flow.cfm import CausalConditionalCFM
from ..flow.lookahead import PreLookaheadLayer
from ..flow.masks import length_mask
from ..dims import DiTFlowDims
from .dit import DiT


class DiTFlow(MaskedDiffFlow):
    def __init__(self, dims: DiTFlowDims):
        super().__init__()
        self.dims = dims
        self.input_embedding = nn.Embedding(dims.vocab_size, dims.input_size)
        self.spk_embed_affine_layer = nn.Linear(dims.spk_embed_dim, dims.output_size)
        self.pre_lookahead_layer = PreLookaheadLayer(dims.input_size, dims.pre_lookahead_len, dims.lookahead_channels)
        self.decoder = CausalConditionalCFM(DiT(dims.estimator), dims.cfm)

    def encode(self, x: Tensor, token_lens: Tensor, context_lens: Tensor, streaming: bool | Tensor,
               n_tokens: int | None, trace: dict | None) -> tuple[Tensor, Tensor]:
        lookahead = self.dims.pre_lookahead_len
        T = int(token_lens.max()) if n_tokens is None else n_tokens
        # right padding past an item's tokens (+ context) is zeros: a final call's look-ahead
        x = F.pad(x, (0, 0, 0, max(0, T + lookahead - x.size(1))))[:, :T + lookahead]
        h = self.pre_lookahead_layer(x) * length_mask(token_lens, T).unsqueeze(-1).to(x.dtype)
        if trace is not None:
            trace["lookahead_out"] = h
        ratio = self.dims.token_mel_ratio
        return h.repeat_interleave(ratio, dim=1).transpose(1, 2), token_lens * ratio

    def encode_cached(self, x: Tensor, g, cursor, context_lens: Tensor | None) -> Tensor:
        lookahead = self.dims.pre_lookahead_len
        if context_lens is None:
            context_lens = g.new_lengths.new_full((g.B,), lookahead)
        seen = length_mask(g.new_lengths + context_lens, x.size(1)).unsqueeze(-1).to(x.dtype)
        x = F.pad(x * seen, (0, 0, 0, max(0, g.N + lookahead - x.size(1))))[:, :g.N + lookahead]
        h = self.pre_lookahead_layer(x, (cursor, g)) * g.valid().unsqueeze(-1).to(x.dtype)
        return h.repeat_interleave(self.dims.token_mel_ratio, dim=1).transpose(1, 2)
