"""PyTorch estimator backends: eager, and compiled with CUDA-graph capture per shape bucket.

`CompiledEstimator` pads every call up to a (batch, length) bucket so that a handful of captured
graphs serve every request mix (nano-vllm's batch buckets, plus length buckets):

- batch buckets: `batch_buckets` (default 2, 4, 8, …, up to the largest estimator batch); a call
  takes the smallest bucket that holds it. Extra rows have an all-zero mask.
- length buckets: `length_bucket(T)`, T rounded up to a multiple of max(64, 2^(⌊log2 T⌋ − 3)),
  so at most 12.5 % of the frames (and at least 64 frames' worth) are padding and 3000 frames
  need about 30 buckets. Extra frames are masked.

Padding is exact: the estimator's convolutions are causal and multiply every input by the mask,
attention masks padded keys, and LayerNorm works per frame, so rows and frames past an item's
length never reach it (tests/test_estimator_backends.py checks this against eager within 1e-5;
the difference is float summation order).

Graphs are captured lazily the first time a bucket is used (`warmup()` captures chosen buckets
ahead of time), in `thread_local` capture mode so another thread's CUDA work (the LLM engine)
does not break a capture, and share one memory pool: each replay's output is cloned before the
next replay, the condition for sharing. On a device without CUDA, or with `cuda_graphs=False`,
the module is only compiled (or run eagerly with `compile=False`); a compile failure falls back
to eager with a warning.
"""
from __future__ import annotations

import logging
from typing import Sequence

import torch
from torch import Tensor, nn

from ..cuda_graph import CapturedCall
from .base import streaming_rows

log = logging.getLogger(__name__)

DEFAULT_BATCH_BUCKETS = (2, 4, 8, 16, 32, 64, 128)


def length_bucket(frames: int, min_step: int = 64) -> int:
    """Frames rounded up to the length bucket: a multiple of max(min_step, 2^(⌊log2 frames⌋ − 3))."""
    if frames < 1:
        raise ValueError(f"frames must be >= 1, got {frames}")
    step = max(min_step, 1 << max(0, frames.bit_length() - 4))
    return -(-frames // step) * step


def batch_bucket(batch: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket >= batch, or None if the batch is larger than every bucket."""
    for b in sorted(buckets):
        if b >= batch:
            return b
    return None


class TorchEstimator:
    """The flow's own module, called as is."""
    name = "torch"
    supports_streaming = True

    def __init__(self, module: nn.Module):
        self.module = module

    def __call__(self, x, mask, mu, t, spks, cond, streaming: bool | Tensor = False) -> Tensor:
        return self.module(x, mask, mu, t, spks, cond, streaming)

    capturable = __call__  # what a caller capturing a larger CUDA graph runs (flow_graphs.py)


def _capture(fn, batch: int, frames: int, channels: int, spk_channels: int, dtype: torch.dtype,
             device: torch.device, pool) -> CapturedCall:
    """One estimator call captured at a fixed (batch, length)."""
    def zeros(*shape, dt=dtype):
        return torch.zeros(*shape, dtype=dt, device=device)
    inputs = dict(x=zeros(batch, channels, frames), mask=zeros(batch, 1, frames), mu=zeros(batch, channels, frames),
                  t=zeros(batch), spks=zeros(batch, spk_channels), cond=zeros(batch, channels, frames),
                  streaming=zeros(batch, dt=torch.bool))
    return CapturedCall(fn, inputs, device, pool)


class CompiledEstimator:
    """torch.compile'd estimator with CUDA graphs per (batch, length) bucket. See the module docstring."""
    name = "compiled"
    supports_streaming = True

    def __init__(self, module: nn.Module, *, compile: bool = True, cuda_graphs: bool | None = None,
                 pad_to_buckets: bool | None = None, batch_buckets: Sequence[int] = DEFAULT_BATCH_BUCKETS,
                 min_length_step: int = 64, max_graphs: int = 256, compile_options: dict | None = None):
        param = next(module.parameters())
        self.module = module
        self.device, self.dtype = param.device, param.dtype
        if cuda_graphs is None:
            cuda_graphs = self.device.type == "cuda"
        if cuda_graphs and self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device; the estimator is on {self.device}")
        self.cuda_graphs = cuda_graphs
        self.pad_to_buckets = cuda_graphs if pad_to_buckets is None else pad_to_buckets
        self.batch_buckets = tuple(sorted(batch_buckets))
        self.min_length_step = min_length_step
        self.max_graphs = max_graphs
        self._graphs: dict[tuple[int, int], CapturedCall] = {}
        self._pool = None
        self._noted: set[str] = set()
        if compile:
            # dynamic shapes: one compiled program serves every bucket (no recompile per bucket)
            self._fn = torch.compile(module, dynamic=True, **(compile_options or {}))
        else:
            self._fn = module
        self._compiled = compile
        if not cuda_graphs:
            log.info("compiled estimator on %s: %s, no CUDA graphs%s", self.device,
                     "torch.compile" if compile else "eager", " (CUDA graphs need a CUDA device)"
                     if self.device.type != "cuda" else "")

    def _note(self, key: str, msg: str, *args) -> None:
        if key not in self._noted:
            self._noted.add(key)
            log.warning(msg, *args)

    def _run(self, **inputs: Tensor) -> Tensor:
        try:
            return self._fn(**inputs)
        except Exception as e:  # noqa: BLE001 — a compiler failure must not take the service down
            if not self._compiled:
                raise
            log.warning("torch.compile of the flow estimator failed (%s: %s); running it eagerly",
                        type(e).__name__, e)
            self._fn, self._compiled = self.module, False
            return self._fn(**inputs)

    def capturable(self, x: Tensor, mask: Tensor, mu: Tensor, t: Tensor, spks: Tensor, cond: Tensor,
                   streaming: bool | Tensor = False) -> Tensor:
        """The compiled module without this estimator's own graphs: what a caller capturing a larger
        CUDA graph runs (flow_graphs.py; graphs cannot nest)."""
        return self._run(x=x, mask=mask, mu=mu, t=t, spks=spks, cond=cond, streaming=streaming)

    @torch.inference_mode()
    def warmup(self, batches: Sequence[int], frames: Sequence[int]) -> None:
        """Capture (or compile) the buckets of these estimator batch sizes x frame counts now."""
        C = self.module.dims.out_channels
        for b in batches:
            for t in frames:
                z = torch.zeros(b, C, t, dtype=self.dtype, device=self.device)
                self(z, torch.ones(b, 1, t, dtype=self.dtype, device=self.device), z,
                     torch.zeros(b, dtype=self.dtype, device=self.device), z[:, :, 0], z, False)

    @torch.inference_mode()
    def __call__(self, x: Tensor, mask: Tensor, mu: Tensor, t: Tensor, spks: Tensor, cond: Tensor,
                 streaming: bool | Tensor = False) -> Tensor:
        B, C, T = x.shape
        rows = streaming_rows(streaming, B, x.device)
        inputs = dict(x=x, mask=mask, mu=mu, t=t, spks=spks, cond=cond, streaming=rows)
        if not self.pad_to_buckets:
            return self._run(**inputs)
        Bb, Tb = batch_bucket(B, self.batch_buckets), length_bucket(T, self.min_length_step)
        if Bb is None:
            self._note("batch", "estimator batch %d is larger than the largest bucket %d: running it without a "
                       "CUDA graph", B, self.batch_buckets[-1])
            return self._run(**inputs)
        if self.cuda_graphs:
            graph = self._graphs.get((Bb, Tb))
            if graph is None and len(self._graphs) < self.max_graphs:
                if self._pool is None:
                    self._pool = torch.cuda.graph_pool_handle()
                log.info("capturing the flow estimator CUDA graph for batch %d x %d frames", Bb, Tb)
                graph = self._graphs[(Bb, Tb)] = _capture(self._run, Bb, Tb, C, spks.shape[1], self.dtype,
                                                          self.device, self._pool)
            if graph is not None:
                # clone: the next replay (of any graph in the pool) overwrites the output
                return graph(**inputs)[:B, :, :T].clone().to(x.dtype)
            self._note("graphs", "%d estimator CUDA graphs captured (max_graphs): new shapes run without a graph",
                       len(self._graphs))
        # pad without a graph (CPU, or past max_graphs): the same numbers a graph would see
        def pad(a: Tensor) -> Tensor:
            out = a.new_zeros((Bb,) + tuple(a.shape[1:-1]) + ((Tb,) if a.dim() == 3 else a.shape[-1:]))
            out[(slice(0, B),) + tuple(slice(0, n) for n in a.shape[1:])] = a
            return out
        padded = {k: (pad(v) if v.dim() > 1 else torch.cat([v, v.new_zeros(Bb - B)])) for k, v in inputs.items()}
        return self._run(**padded)[:B, :, :T]
