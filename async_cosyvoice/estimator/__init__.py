"""Flow-estimator backends behind one interface (base.Estimator), chosen by config:

- "torch": the flow's own module, eager.
- "compiled": torch.compile + CUDA-graph capture per (batch, length) bucket (torch_backend.py).
- "onnxruntime": the exported graphs in onnxruntime (onnx_export.py, onnxruntime_backend.py).
- "tensorrt": TensorRT engines built from the same graphs (tensorrt_backend.py; imported lazily).

Build one with `make_estimator(kind, flow, ...)`, or `estimator_from_config(config.token2wav, ...)`,
and hand it to `Token2WavRunner(flow, hift, estimator=...)`; the runner passes it to
`Flow.forward`, which calls it once per CFM step for every stream in the batch.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..models.flow.attention import ATTENTIONS
from .base import INPUT_NAMES, OUTPUT_NAME, Estimator, MissingBackendError, RowSplitEstimator
from .torch_backend import DEFAULT_BATCH_BUCKETS, CompiledEstimator, TorchEstimator, compile_estimator

if TYPE_CHECKING:
    from ..config import Token2WavConfig
    from ..models.flow.flow import Flow

log = logging.getLogger(__name__)

__all__ = ["KINDS", "Estimator", "MissingBackendError", "RowSplitEstimator", "TorchEstimator", "CompiledEstimator",
           "compile_estimator", "make_estimator", "estimator_from_config", "INPUT_NAMES", "OUTPUT_NAME"]

KINDS = ("torch", "compiled", "onnxruntime", "tensorrt")


def make_estimator(kind: str, flow: "Flow", device: torch.device | str | None = None,
                   dtype: torch.dtype | None = None, *, max_batch: int = 64, opt_batch: int | None = None,
                   max_frames: int = 3000, opt_frames: int = 500, cache_dir: str | Path | None = None,
                   flow_pt: str | Path | None = None, chunked: bool = True, threads: int | None = None,
                   exporter: str = "legacy", compile: bool = True, cuda_graphs: bool | None = None,
                   compile_regions: bool = False, attention: str = "sdpa") -> Estimator:
    """An estimator backend for `flow` (already on its device and in its dtype).

    max_batch / opt_batch: estimator rows (2 per stream: conditional + unconditional) that graph
    backends are built for (compiled: the largest CUDA-graph batch bucket; tensorrt: the profile;
    larger calls are split or run uncaptured). max_frames / opt_frames: prompt + target mel frames
    (tensorrt profile; longer calls run on PyTorch). cache_dir: where ONNX files and TensorRT
    plans are kept (default files.cache_root()). flow_pt: the flow.pt path, hashed
    for the cache key (else the estimator's tensors are). chunked: also build the chunked-attention
    graph (onnxruntime / tensorrt), else streaming rows run on PyTorch. threads: onnxruntime
    intra-op threads. compile / cuda_graphs / compile_regions: for "compiled" (cuda_graphs None:
    on CUDA devices; compile_regions: compile the repeated blocks, not the whole module).
    attention: the recomputing calls' attention, "sdpa" or "flex" (models/flow/attention.py), for
    "torch" and "compiled"; the graph backends' graphs and their PyTorch fallback keep SDPA.
    """
    if kind not in KINDS:
        raise ValueError(f"unknown estimator backend {kind!r}; choose one of {', '.join(KINDS)}")
    if attention not in ATTENTIONS:
        raise ValueError(f"unknown flow attention {attention!r}; choose one of {', '.join(ATTENTIONS)}")
    module = flow.decoder.estimator
    param = next(module.parameters())
    device = param.device if device is None else torch.device(device)
    dtype = param.dtype if dtype is None else dtype
    if (param.device, param.dtype) != (device, dtype):
        raise ValueError(f"the flow is on {param.device} in {param.dtype}; move it to {device} / {dtype} first")
    if kind in ("torch", "compiled") and attention == "flex" and device.type == "cuda" and not (
            kind == "compiled" and compile):
        log.warning("flow attention flex on an eager %s estimator: outside torch.compile flex_attention runs "
                    "unfused (it materialises every score); use estimator: compiled", kind)
    if kind == "torch":
        return TorchEstimator(module, attention)
    if kind == "compiled":
        buckets = tuple(b for b in DEFAULT_BATCH_BUCKETS if b < max_batch) + (max(max_batch, 2),)
        return CompiledEstimator(module, compile=compile, cuda_graphs=cuda_graphs, batch_buckets=buckets,
                                 compile_regions=compile_regions, attention=attention)
    eager = TorchEstimator(module)

    from .onnx_export import cached_export

    def fixed(streaming: bool):
        return lambda x, mask, mu, t, spks, cond: module(x, mask, mu, t, spks, cond, streaming)

    if kind == "onnxruntime":
        from .onnxruntime_backend import OnnxRuntimeGraph, _import_ort
        _import_ort()
        graphs = [OnnxRuntimeGraph(cached_export(module, streaming=s, cache_dir=cache_dir, flow_pt=flow_pt,
                                                 exporter=exporter), device, threads)
                  for s in ((False, True) if chunked else (False,))]
        return RowSplitEstimator("onnxruntime", graphs[0], graphs[1] if chunked else None, eager)

    from .tensorrt_backend import import_tensorrt, profile_shapes, tensorrt_graph
    import_tensorrt()  # before anything else: the missing package is the error to report
    if device.type != "cuda":
        raise ValueError(f"the 'tensorrt' estimator needs a CUDA device, got {device}")
    shapes = profile_shapes(max_batch, opt_batch or max_batch, max_frames, min(opt_frames, max_frames),
                            mel=module.dims.out_channels)
    graphs = [tensorrt_graph(cached_export(module, streaming=s, cache_dir=cache_dir, flow_pt=flow_pt,
                                           exporter=exporter), device, dtype, shapes, fallback=fixed(s))
              for s in ((False, True) if chunked else (False,))]
    return RowSplitEstimator("tensorrt", graphs[0], graphs[1] if chunked else None, eager)


def estimator_from_config(cfg: "Token2WavConfig", flow: "Flow", flow_pt: str | Path | None = None) -> Estimator:
    """`make_estimator` with the token2wav config's choices (the flow already on its device / dtype)."""
    return make_estimator(cfg.estimator, flow, max_batch=2 * cfg.max_batch, max_frames=cfg.estimator_max_frames,
                          opt_frames=cfg.estimator_opt_frames, cache_dir=cfg.estimator_cache_dir, flow_pt=flow_pt,
                          chunked=cfg.estimator_chunked_graph, compile_regions=cfg.compile_regions,
                          attention=cfg.flow_attention)
