"""The whole flow call (token embedding, conformer encoder, every CFM step with guidance) as one
CUDA graph per (streams, tokens) bucket.

Without it a chunk's flow call launches hundreds of kernels from Python even with the compiled
estimator's per-step graphs (the encoder, the CFM glue): on a GPU that host work, not the GPU's,
sets a small batch's time, and it competes for the GIL with the LLM thread and the server. With
it, one `graph.replay()` runs the call.

Buckets: a call of B streams rendering at most T tokens (prompt + target, the look-ahead after
them extra) takes the smallest batch bucket >= B and T rounded up like the estimator's lengths
(`length_bucket`, steps of >= `min_token_step` tokens: <= 12.5 % padding). Padding is exact: the
extra token positions are what a longer item in the same batch would add (`Flow.forward`'s
`n_tokens`: masked keys, causal convolutions, per-frame norms), and extra rows render one token of
their own. Only buckets of at most `max_bucket_tokens` (streams x tokens) are captured: larger
calls are compute-bound, gain little from a graph and would hold much memory, so they run the
flow as before (with the estimator's own graphs). Graphs are captured on a bucket's first use
(`warmup` captures chosen ones ahead) and share one memory pool.

Off CUDA (`cuda_graphs=False`) the same padded call runs without a graph: the tests use it to check
that padding to the buckets changes nothing.
"""
from __future__ import annotations

import logging
from typing import Callable, Sequence

import torch
from torch import Tensor

from .cuda_graph import CapturedCall, padded
from .estimator.torch_backend import batch_bucket, length_bucket
from .models.flow.flow import Flow

log = logging.getLogger(__name__)

DEFAULT_STREAM_BUCKETS = (1, 2, 4, 8, 16, 32, 64)


class FlowGraphs:
    """`Flow.forward`'s signature (without `estimator`): runs a call in its bucket's graph, or, past
    the buckets, as `flow(..., estimator=fallback)`."""

    def __init__(self, flow: Flow, capturable: Callable[..., Tensor], fallback: Callable[..., Tensor] | None = None, *,
                 cuda_graphs: bool | None = None, stream_buckets: Sequence[int] = DEFAULT_STREAM_BUCKETS,
                 min_token_step: int = 32, max_bucket_tokens: int = 8192, max_graphs: int = 128):
        """capturable: the estimator to run inside the graph (no graphs of its own: they cannot nest);
        fallback: the estimator for calls past the buckets (None: the flow's own module)."""
        param = next(flow.parameters())
        self.flow, self.capturable, self.fallback = flow, capturable, fallback
        self.device = param.device
        self.cuda_graphs = self.device.type == "cuda" if cuda_graphs is None else cuda_graphs
        if self.cuda_graphs and self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device; the flow is on {self.device}")
        self.stream_buckets = tuple(sorted(stream_buckets))
        self.min_token_step = min_token_step
        self.max_bucket_tokens = max_bucket_tokens
        self.max_graphs = max_graphs
        self.graphs: dict[tuple[int, int], CapturedCall] = {}
        self._pool = None
        self.replays = 0    # calls that ran in a graph (or, off CUDA, padded to a bucket)
        self.fallbacks = 0  # calls past the buckets

    def bucket(self, streams: int, tokens: int) -> tuple[int, int] | None:
        """(streams, tokens) of the bucket a call falls in, or None: it runs without a graph."""
        B, T = batch_bucket(streams, self.stream_buckets), length_bucket(tokens, self.min_token_step)
        if B is None or B * T > self.max_bucket_tokens:
            return None
        if self.cuda_graphs and (B, T) not in self.graphs and len(self.graphs) >= self.max_graphs:
            return None
        return B, T

    @torch.inference_mode()
    def __call__(self, tokens: Tensor, token_lens: Tensor, context_lens: Tensor, prompt_feat: Tensor,
                 prompt_feat_lens: Tensor, embedding: Tensor, streaming: bool | Tensor = False) -> tuple[Tensor, Tensor]:
        """Flow.forward of B items -> mel (B, 80, ratio·T') float32 with T' >= max(token_lens), and the
        per-item frame counts (as Flow.forward; frames past an item's count are padding)."""
        B = tokens.shape[0]
        lens = token_lens.tolist()
        bucket = self.bucket(B, max(lens))
        if bucket is None:
            self.fallbacks += 1
            return self.flow(tokens, token_lens, context_lens, prompt_feat, prompt_feat_lens, embedding, streaming,
                             estimator=self.fallback)
        Bb, Tb = bucket
        dev = self.device
        flags = streaming.reshape(-1).expand(B) if isinstance(streaming, Tensor) else torch.full((B,), bool(streaming))
        pad_rows = Bb - B  # extra rows render one token (a fully masked row would be NaN)
        inputs = dict(tokens=tokens.to(dev, torch.int32),
                      token_lens=torch.tensor(lens + [1] * pad_rows, device=dev),
                      context_lens=torch.cat([context_lens.to(dev), context_lens.new_zeros(pad_rows).to(dev)]),
                      prompt_feat=prompt_feat.to(dev), prompt_feat_lens=prompt_feat_lens.to(dev),
                      embedding=embedding.to(dev), streaming=flags.to(dev, torch.bool))
        self.replays += 1
        if not self.cuda_graphs:
            mel, mel_lens = self._forward(Tb)(**{name: padded(v, self._buffer_shape(name, Bb, Tb, v))
                                                 for name, v in inputs.items()})
        else:
            graph = self.graphs.get((Bb, Tb))
            if graph is None:
                graph = self._capture(Bb, Tb, inputs)
            mel, mel_lens = graph(**inputs)
            mel = mel.clone()  # the next replay (of any graph in the pool) overwrites it
        return mel[:B], mel_lens[:B].clone()

    def warmup(self, streams: Sequence[int], tokens: Sequence[int]) -> int:
        """Capture the buckets of these stream counts x token counts now (those past the buckets
        are skipped). Returns how many graphs were new."""
        new = 0
        if not self.cuda_graphs:
            return new
        dims = self.flow.dims
        for b in streams:
            for t in tokens:
                bucket = self.bucket(b, t)
                if bucket is None or bucket in self.graphs:
                    continue
                Bb, Tb = bucket
                example = dict(tokens=torch.zeros(Bb, Tb + dims.pre_lookahead_len, dtype=torch.int32),
                               token_lens=torch.full((Bb,), Tb), context_lens=torch.zeros(Bb, dtype=torch.long),
                               prompt_feat=torch.zeros(Bb, 0, dims.output_size), prompt_feat_lens=torch.zeros(Bb),
                               embedding=torch.zeros(Bb, dims.spk_embed_dim), streaming=torch.zeros(Bb, dtype=torch.bool))
                with torch.inference_mode():
                    self._capture(Bb, Tb, {k: v.to(self.device) for k, v in example.items()})
                new += 1
        return new

    # -- internals

    def _forward(self, n_tokens: int):
        def forward(tokens, token_lens, context_lens, prompt_feat, prompt_feat_lens, embedding, streaming):
            return self.flow(tokens, token_lens, context_lens, prompt_feat, prompt_feat_lens, embedding, streaming,
                             estimator=self.capturable, n_tokens=n_tokens)
        return forward

    def _buffer_shape(self, name: str, Bb: int, Tb: int, example: Tensor) -> tuple[int, ...]:
        """The static shape of input `name` in bucket (Bb, Tb)."""
        dims = self.flow.dims
        if name == "tokens":
            return Bb, Tb + dims.pre_lookahead_len
        if name == "prompt_feat":
            return Bb, dims.token_mel_ratio * Tb, example.shape[2]
        return (Bb,) + tuple(example.shape[1:])

    def _capture(self, Bb: int, Tb: int, inputs: dict[str, Tensor]) -> CapturedCall:
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        log.info("capturing the flow CUDA graph for %d streams x %d tokens", Bb, Tb)
        buffers = {name: torch.zeros(self._buffer_shape(name, Bb, Tb, v), dtype=v.dtype, device=self.device)
                   for name, v in inputs.items()}
        buffers["token_lens"].fill_(1)
        graph = self.graphs[(Bb, Tb)] = CapturedCall(self._forward(Tb), buffers, self.device, self._pool)
        return graph

