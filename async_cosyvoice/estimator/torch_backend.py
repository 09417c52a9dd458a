"""PyTorch estimator backends: eager, and compiled with CUDA-graph capture per shape bucket.

`CompiledEstimator` pads every call up to a (batch, length) bucket so that a handful of captured
graphs serve every request mix (nano-vllm's batch buckets, plus length buckets; the bucket rule,
pool and capture are graph_buckets.GraphBuckets', shared with the flow's and HiFT's graphs):

- batch buckets: `batch_buckets` (default 2, 4, 8, …, up to the largest estimator batch); a call
  takes the smallest bucket that holds it. Extra rows have an all-zero mask.
- length buckets: `length_bucket(T)`, T rounded up to a multiple of max(64, 2^(⌊log2 T⌋ − 3)),
  so at most 12.5 % of the frames (and at least 64 frames' worth) are padding and 3000 frames
  need about 30 buckets. Extra frames are masked.

Padding is exact: the estimator's convolutions are causal and multiply every input by the mask,
attention masks padded keys, and LayerNorm works per frame, so rows and frames past an item's
length never reach it (tests/test_estimator_backends.py checks this against eager within 1e-5;
the difference is float summation order).

A bucket's first call runs the padded call without a graph and leaves the bucket wanted; its graph
is captured later, off the request path (graph_buckets.GraphBuckets.capture_wanted, called by the
token2wav stage's capture thread, beside its batches; `warmup()` captures chosen buckets ahead). A call past the buckets (a larger batch, or `max_graphs` captured) runs the compiled module
without a graph. On a device without CUDA, or with `cuda_graphs=False`, the module is only
compiled (or run eagerly with `compile=False`), padded to the buckets if `pad_to_buckets`; a
compile failure falls back to eager with a warning. `compile_regions` compiles the estimator's
repeated blocks instead of the whole module (`compile_estimator`); the graphs still wrap the
whole call.
"""
from __future__ import annotations

import logging
from typing import Sequence

import torch
from torch import Tensor, nn

from ..graph_buckets import Bucket, GraphBuckets
from .base import attention_options, streaming_rows
from .regions import regional, repeated_blocks

log = logging.getLogger(__name__)

DEFAULT_BATCH_BUCKETS = (2, 4, 8, 16, 32, 64, 128)


class TorchEstimator:
    """The flow's own module, called as is (attention: token2wav.flow_attention, base.attention_options)."""
    name = "torch"
    supports_streaming = True

    def __init__(self, module: nn.Module, attention: str = "sdpa"):
        self.module = module
        self._attention = attention_options(module, attention)

    def __call__(self, x, mask, mu, t, spks, cond, streaming: bool | Tensor = False) -> Tensor:
        return self.module(x, mask, mu, t, spks, cond, streaming, **self._attention)

    capturable = __call__  # what a caller capturing a larger CUDA graph runs (token2wav/flow_graphs.py)


def compile_estimator(module: nn.Module, *, regions: bool = False, options: dict | None = None) -> nn.Module:
    """torch.compile of an estimator with dynamic shapes (one program serves every bucket, no
    recompile per bucket).

    Whole (default): one program over the module; Dynamo traces every block instance, so the
    trace grows with the block count (the full CosyVoice2 estimator: 56 transformer blocks and
    14 resnets). `regions`: each instance of the module's `repeated_blocks` classes compiled on
    its own, the glue between them eager (PyTorch's regional compilation recipe, regions.py): the block's
    weights are inputs of its program, so Dynamo traces a block class once and every instance of
    it reuses that program (a class seen with differently shaped weights or inputs, like the
    resnets' input channels, gets one program per shape). The module is left as it is: the
    regional one is a shallow copy sharing its weights, so eager callers of the module stay eager.
    Whether the whole-module program's kernels are faster on a GPU is not measured yet."""
    options = options or {}
    if not regions:
        return torch.compile(module, dynamic=True, **options)
    compiled = regional(module, lambda block: torch.compile(block, dynamic=True, **options))
    blocks = repeated_blocks(module)
    count = sum(isinstance(m, blocks) for m in module.modules())
    log.info("flow estimator: torch.compile of its %d repeated blocks (%s), the rest eager", count,
             ", ".join(b.__name__ for b in blocks))
    return compiled


class CompiledEstimator(GraphBuckets):
    """torch.compile'd estimator with CUDA graphs per (batch, length) bucket. See the module docstring."""
    name = "compiled"
    supports_streaming = True
    what, unit = "flow estimator", "frames"

    def __init__(self, module: nn.Module, *, compile: bool = True, cuda_graphs: bool | None = None,
                 pad_to_buckets: bool | None = None, batch_buckets: Sequence[int] = DEFAULT_BATCH_BUCKETS,
                 min_length_step: int = 64, max_graphs: int = 256, compile_options: dict | None = None,
                 compile_regions: bool = False, max_cover_frames: int = 8192, attention: str = "sdpa"):
        """max_cover_frames: the most rows x frames a larger bucket's graph may add to a call whose
        bucket waits for its capture (GraphBuckets.cover; these graphs run the flow's large calls,
        past its whole-call graphs: 8192 is a quarter of 16 streams x 512 tokens). attention: the
        module's attention (token2wav.flow_attention; "flex" is fused only where compiled)."""
        param = next(module.parameters())
        super().__init__(param.device, cuda_graphs=cuda_graphs, batch_buckets=batch_buckets, min_step=min_length_step,
                         max_bucket_size=None, max_graphs=max_graphs, max_cover_extra=max_cover_frames)
        self.module, self.dtype = module, param.dtype
        self._attention = attention_options(module, attention)
        self.pad_to_buckets = self.cuda_graphs if pad_to_buckets is None else pad_to_buckets
        self._warned_batch = False
        self._module_fn = compile_estimator(module, regions=compile_regions, options=compile_options) \
            if compile else module
        self._compiled = compile
        if not self.cuda_graphs:
            log.info("compiled estimator on %s: %s, no CUDA graphs%s", self.device,
                     ("torch.compile of its blocks" if compile_regions else "torch.compile") if compile else "eager",
                     " (CUDA graphs need a CUDA device)"
                     if self.device.type != "cuda" else "")

    @property
    def compiled(self) -> bool:
        """Whether the module runs compiled (False: asked not to, or its compile failed)."""
        return self._compiled

    def _call_module(self, **inputs: Tensor) -> Tensor:
        try:
            return self._module_fn(**inputs, **self._attention)
        except Exception as e:  # noqa: BLE001 — a compiler failure must not take the service down
            if not self._compiled:
                raise
            log.warning("torch.compile of the flow estimator failed (%s: %s); running it eagerly",
                        type(e).__name__, e)
            self._module_fn, self._compiled = self.module, False
            return self._module_fn(**inputs, **self._attention)

    def capturable(self, x: Tensor, mask: Tensor, mu: Tensor, t: Tensor, spks: Tensor, cond: Tensor,
                   streaming: bool | Tensor = False) -> Tensor:
        """The compiled module without this estimator's own graphs: what a caller capturing a larger
        CUDA graph runs (token2wav/flow_graphs.py; graphs cannot nest)."""
        return self._call_module(x=x, mask=mask, mu=mu, t=t, spks=spks, cond=cond, streaming=streaming)

    @torch.inference_mode()
    def __call__(self, x: Tensor, mask: Tensor, mu: Tensor, t: Tensor, spks: Tensor, cond: Tensor,
                 streaming: bool | Tensor = False) -> Tensor:
        B, C, T = x.shape
        inputs = dict(x=x, mask=mask, mu=mu, t=t, spks=spks, cond=cond, streaming=streaming_rows(streaming, B, x.device))
        if not self.pad_to_buckets:
            return self._call_module(**inputs)
        bucket = self.bucket(B, T)
        if bucket is None:
            self.fallbacks += 1
            if B > self.batch_buckets[-1] and not self._warned_batch:
                self._warned_batch = True
                log.warning("estimator batch %d is larger than the largest bucket %d: running it without a "
                            "CUDA graph", B, self.batch_buckets[-1])
            return self._call_module(**inputs)
        # clone: the next replay (of any graph in the pool) overwrites the output
        return self._run(bucket, inputs)[:B, :, :T].clone().to(x.dtype)

    # -- GraphBuckets

    def _fn(self, bucket: Bucket):
        return self._call_module

    def _buffer_shape(self, name: str, bucket: Bucket, example: Tensor) -> tuple[int, ...]:
        Bb, Tb = bucket
        if example.dim() == 3:  # x, mask, mu, cond: (B, channels, frames)
            return Bb, example.shape[1], Tb
        return (Bb,) + tuple(example.shape[1:])  # t, streaming (B,); spks (B, channels)

    def _example(self, bucket: Bucket) -> dict[str, Tensor]:
        """A call of the bucket's shapes and dtypes to capture it with (`warmup`, `capture_wanted`).
        Only shapes and dtypes reach the capture (GraphBuckets._capture records on zero buffers of
        them: nothing in the graph branches on values); the values are a finite call of the bucket
        (a mask of ones, chunked attention), which the CPU test runs."""
        Bb, Tb = bucket
        C = self.module.dims.out_channels
        z = torch.zeros(Bb, C, Tb, dtype=self.dtype, device=self.device)
        return dict(x=z, mask=torch.ones(Bb, 1, Tb, dtype=self.dtype, device=self.device), mu=z,
                    t=torch.zeros(Bb, dtype=self.dtype, device=self.device), spks=z[:, :, 0], cond=z,
                    streaming=torch.ones(Bb, dtype=torch.bool, device=self.device))

    def _buffers(self, bucket: Bucket, inputs: dict[str, Tensor]) -> dict[str, Tensor]:
        """Zeros in the estimator's dtype (the streaming flags stay bool): a caller's float32 mask
        or time step is cast on its way into the graph, as the module would see it."""
        return {name: torch.zeros(self._buffer_shape(name, bucket, v), device=self.device,
                                  dtype=self.dtype if v.is_floating_point() else v.dtype)
                for name, v in inputs.items()}
