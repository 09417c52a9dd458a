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
flow as before (with the estimator's own graphs). A bucket's first call runs the padded call
without a graph and leaves the bucket wanted; its graph is captured by the token2wav stage's
capture thread (graph_buckets.GraphBuckets.capture_wanted; `warmup` captures chosen ones ahead). Graphs
share one memory pool (graph_buckets.py, as HiFT's).

Off CUDA (`cuda_graphs=False`) the same padded call runs without a graph: the tests use it to check
that padding to the buckets changes nothing.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import Tensor

from ..graph_buckets import DEFAULT_STREAM_BUCKETS, Bucket, GraphBuckets
from ..models.flow.flow import Flow


# A call whose bucket has no graph yet may run in a larger bucket's graph that adds at most this many
# streams x tokens (GraphBuckets.cover). On the H200 a graph of the estimator at 64 rows x 336 frames took
# 26.1 ms a step, ~1.2 us a row-frame: a flow token of one stream (2 frames, 2 rows with CFG, 10 steps) ~50 us,
# so 2048 extra tokens ~100 ms, about what a small call loses without its graph (2 rows x 336 frames: 18.9 ms a
# step eager against 4.2 in a graph). Not measured as such.
DEFAULT_COVER_TOKENS = 2048


class FlowGraphs(GraphBuckets):
    """`Flow.forward`'s signature (without `estimator`): runs a call in its bucket's graph, or, past
    the buckets, as `flow(..., estimator=fallback)`."""
    what, unit = "flow", "tokens"

    def __init__(self, flow: Flow, capturable: Callable[..., Tensor], fallback: Callable[..., Tensor] | None = None, *,
                 cuda_graphs: bool | None = None, stream_buckets: Sequence[int] = DEFAULT_STREAM_BUCKETS,
                 min_token_step: int = 32, max_bucket_tokens: int = 8192, max_graphs: int = 128,
                 max_cover_tokens: int = DEFAULT_COVER_TOKENS, compiled: bool = False):
        """capturable: the estimator to run inside the graph (no graphs of its own: they cannot nest);
        fallback: the estimator for calls past the buckets (None: the flow's own module); compiled:
        whether capturable runs torch.compile'd code (GraphBuckets.compile_shapes); max_cover_tokens:
        the most streams x tokens a larger bucket's graph may add to a call whose bucket waits for its
        capture (GraphBuckets.cover)."""
        super().__init__(next(flow.parameters()).device, cuda_graphs=cuda_graphs, batch_buckets=stream_buckets,
                         min_step=min_token_step, max_bucket_size=max_bucket_tokens, max_graphs=max_graphs,
                         max_cover_extra=max_cover_tokens)
        self.flow, self.capturable, self.fallback = flow, capturable, fallback
        self.compiled = compiled

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
        dev = self.device
        flags = streaming.reshape(-1).expand(B) if isinstance(streaming, Tensor) else torch.full((B,), bool(streaming))
        pad_rows = bucket[0] - B  # extra rows render one token (a fully masked row would be NaN)
        inputs = dict(tokens=tokens.to(dev, torch.int32),
                      token_lens=torch.tensor(lens + [1] * pad_rows, device=dev),
                      context_lens=torch.cat([context_lens.to(dev), context_lens.new_zeros(pad_rows).to(dev)]),
                      prompt_feat=prompt_feat.to(dev), prompt_feat_lens=prompt_feat_lens.to(dev),
                      embedding=embedding.to(dev), streaming=flags.to(dev, torch.bool))
        mel, mel_lens = self._run(bucket, inputs)
        return mel[:B].clone(), mel_lens[:B].clone()  # clones: the next replay overwrites the outputs

    # -- GraphBuckets

    def _fn(self, bucket: Bucket):
        n_tokens = bucket[1]

        def forward(tokens, token_lens, context_lens, prompt_feat, prompt_feat_lens, embedding, streaming):
            return self.flow(tokens, token_lens, context_lens, prompt_feat, prompt_feat_lens, embedding, streaming,
                             estimator=self.capturable, n_tokens=n_tokens)
        return forward

    def _buffer_shape(self, name: str, bucket: Bucket, example: Tensor) -> tuple[int, ...]:
        Bb, Tb = bucket
        dims = self.flow.dims
        if name == "tokens":
            return Bb, Tb + dims.pre_lookahead_len
        if name == "prompt_feat":
            return Bb, dims.token_mel_ratio * Tb, example.shape[2]
        return (Bb,) + tuple(example.shape[1:])

    def _buffers(self, bucket: Bucket, inputs: dict[str, Tensor]) -> dict[str, Tensor]:
        buffers = super()._buffers(bucket, inputs)
        buffers["token_lens"].fill_(1)  # rows past a call's items render one token
        return buffers

    def _example(self, bucket: Bucket) -> dict[str, Tensor]:
        Bb, Tb = bucket
        dims = self.flow.dims
        example = dict(tokens=torch.zeros(Bb, Tb + dims.pre_lookahead_len, dtype=torch.int32),
                       token_lens=torch.full((Bb,), Tb), context_lens=torch.zeros(Bb, dtype=torch.long),
                       prompt_feat=torch.zeros(Bb, 0, dims.output_size), prompt_feat_lens=torch.zeros(Bb),
                       embedding=torch.zeros(Bb, dims.spk_embed_dim), streaming=torch.zeros(Bb, dtype=torch.bool))
        return {k: v.to(self.device) for k, v in example.items()}
