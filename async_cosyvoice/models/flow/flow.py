"""Flow (CausalMaskedDiffWithXvec): speech tokens + prompt mel + x-vector -> mel frames.

Token embeddings -> conformer encoder (25 Hz -> 50 Hz) -> a linear projection to 80 channels = mu;
the rest is shared with CosyVoice3 (base.py). Parameter names are those of the official flow.pt, so
`load_state_dict(strict=True)` takes it as is.
"""
from __future__ import annotations

from torch import Tensor, nn

from ..dims import FlowDims
from .base import MaskedDiffFlow
from .cfm import CausalConditionalCFM
from .encoder import UpsampleConformerEncoder
from .estimator import CausalConditionalDecoder


class Flow(MaskedDiffFlow):
    def __init__(self, dims: FlowDims):
        super().__init__()
        self.dims = dims
        self.input_embedding = nn.Embedding(dims.vocab_size, dims.input_size)
        self.spk_embed_affine_layer = nn.Linear(dims.spk_embed_dim, dims.output_size)
        self.encoder = UpsampleConformerEncoder(dims.encoder)
        self.encoder_proj = nn.Linear(dims.encoder.output_size, dims.output_size)
        self.decoder = CausalConditionalCFM(CausalConditionalDecoder(dims.estimator), dims.cfm)

    def encode(self, x: Tensor, token_lens: Tensor, context_lens: Tensor, streaming: bool | Tensor,
               n_tokens: int | None, trace: dict | None) -> tuple[Tensor, Tensor]:
        h, mel_lens = self.encoder(x, token_lens, context_lens, streaming, n_tokens)
        if trace is not None:
            trace["encoder_out"] = h
        return self.encoder_proj(h).transpose(1, 2), mel_lens

    def encode_cached(self, x: Tensor, g, cursor, context_lens: Tensor | None) -> Tensor:
        return self.encoder_proj(self.encoder.forward_cached(x, g, cursor, context_lens)).transpose(1, 2)
