"""ONNX export of the flow estimator, as upstream's `cosyvoice/bin/export_onnx.py` does it, plus a cache.

The graph has upstream's six inputs `x, mask, mu, t, spks, cond` and the output `estimator_out`,
opset 18, float32. Unlike upstream (batch fixed at 2), the batch is dynamic too:
x, mask, mu, cond and the output are (batch, C, seq_len); t is (batch,), spks (batch, 80).

Upstream traces `streaming=False` and its TensorRT path therefore uses full attention even for
streaming chunks, which does not match the PyTorch chunked result. Here the `streaming` flag is
not an input: `FixedAttention` wraps the module with the flag fixed, and `streaming=True` gives
a second graph, with the same six inputs, that has the chunk mask (chunks of static_chunk_size
frames counted from frame 0) baked in. Backends run each row on the graph that is exact for it
(base.RowSplitEstimator).

Exports are cached as `<cache_dir>/estimator.<full|chunked>.<key>.onnx`, key = hash of the
weights (the flow.pt file when its path is given, else the estimator's tensors), the estimator
dims, the attention pattern, the opset and EXPORT_VERSION. The default cache dir is `files.cache_root()`:
$ASYNC_COSYVOICE_CACHE, else $XDG_CACHE_HOME/async_cosyvoice, else ~/.cache/async_cosyvoice.
"""
from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import logging
import warnings
from pathlib import Path

import torch
from torch import Tensor, nn

from ..files import atomic_writer, cache_root
from .base import INPUT_NAMES, OUTPUT_NAME

log = logging.getLogger(__name__)

OPSET = 18
EXPORT_VERSION = 1  # bump when the exported graph changes for the same weights
_DUMMY_BATCH, _DUMMY_FRAMES = 2, 256  # upstream's dummy shapes


class FixedAttention(nn.Module):
    """The estimator with the streaming flag fixed: exactly the six graph inputs."""

    def __init__(self, estimator: nn.Module, streaming: bool):
        super().__init__()
        self.estimator = estimator
        self.streaming = bool(streaming)

    def forward(self, x: Tensor, mask: Tensor, mu: Tensor, t: Tensor, spks: Tensor, cond: Tensor) -> Tensor:
        return self.estimator(x, mask, mu, t, spks, cond, streaming=self.streaming)


def _file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            h.update(block)
    return h.hexdigest()


def weights_digest(estimator: nn.Module, flow_pt: str | Path | None = None) -> str:
    """sha256 of flow.pt if its path is given (plus the module dtype, which a cast changes), else of the
    estimator's own tensors (names, shapes, dtypes, bytes)."""
    h = hashlib.sha256()
    if flow_pt is not None:
        h.update(_file_digest(Path(flow_pt)).encode())
        h.update(str(next(estimator.parameters()).dtype).encode())
        return h.hexdigest()
    for name, tensor in sorted(estimator.state_dict().items()):
        t = tensor.detach().cpu().contiguous()
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype};".encode())
        h.update(t.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def export_key(estimator: nn.Module, streaming: bool, flow_pt: str | Path | None = None, opset: int = OPSET) -> str:
    dims = getattr(estimator, "dims", None)
    dims = dataclasses.asdict(dims) if dataclasses.is_dataclass(dims) else repr(dims)
    payload = json.dumps(dict(weights=weights_digest(estimator, flow_pt), dims=dims, streaming=bool(streaming),
                              opset=opset, version=EXPORT_VERSION), sort_keys=True, default=str)
    return hashlib.sha256(payload.encode()).hexdigest()[:20]


def dummy_inputs(estimator: nn.Module, batch: int = _DUMMY_BATCH, frames: int = _DUMMY_FRAMES,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> tuple[Tensor, ...]:
    dims = estimator.dims
    C = dims.out_channels
    # spks: the DiT's spk_dim; the U-Net's is the mel channel count (its in = [x, mu, spks, cond])
    S = dims.spk_dim if hasattr(dims, "spk_dim") else dims.in_channels // 4
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g).to(device, dtype)  # noqa: E731
    return (r(batch, C, frames), torch.ones(batch, 1, frames, dtype=dtype, device=device), r(batch, C, frames),
            torch.rand(batch, generator=g).to(device, dtype), r(batch, S), r(batch, C, frames))


def export_estimator(estimator: nn.Module, path: str | Path, *, streaming: bool = False, opset: int = OPSET,
                     exporter: str = "legacy") -> Path:
    """Export a float32 CPU copy of `estimator` with the flag fixed to `path` (written atomically).

    exporter: "legacy" (TorchScript-based, like upstream; a few seconds) or "dynamo"
    (torch.export-based, needs onnxscript; slower). Both give dynamic batch and seq_len.
    """
    if exporter not in ("legacy", "dynamo"):
        raise ValueError(f"exporter must be 'legacy' or 'dynamo', got {exporter!r}")
    path = Path(path)
    module = FixedAttention(copy.deepcopy(estimator).to("cpu", torch.float32), streaming).eval()
    args = dummy_inputs(estimator)
    with atomic_writer(path) as tmp, torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if exporter == "legacy":
            axes = {n: {0: "batch", 2: "seq_len"} for n in ("x", "mask", "mu", "cond", OUTPUT_NAME)}
            axes.update(t={0: "batch"}, spks={0: "batch"})
            torch.onnx.export(module, args, str(tmp), input_names=list(INPUT_NAMES), output_names=[OUTPUT_NAME],
                              opset_version=opset, do_constant_folding=True, dynamic_axes=axes, dynamo=False)
        else:
            batch = torch.export.Dim("batch", min=1, max=4096)
            seq = torch.export.Dim("seq_len", min=4, max=15000)  # the flow noise covers 15000 frames
            # in input order: the exporter renames the axes by position
            shapes = {n: ({0: batch, 2: seq} if n in ("x", "mask", "mu", "cond") else {0: batch})
                      for n in INPUT_NAMES}
            torch.onnx.export(module, args, str(tmp), input_names=list(INPUT_NAMES), output_names=[OUTPUT_NAME],
                              opset_version=opset, dynamo=True, dynamic_shapes=shapes, external_data=False,
                              verbose=False)
    return path


def cached_export(estimator: nn.Module, *, streaming: bool, cache_dir: str | Path | None = None,
                  flow_pt: str | Path | None = None, exporter: str = "legacy") -> Path:
    """The cached ONNX file for this estimator and attention pattern, exported on first use."""
    cache_dir = Path(cache_dir) if cache_dir is not None else cache_root()
    kind = "chunked" if streaming else "full"
    path = cache_dir / f"estimator.{kind}.{export_key(estimator, streaming, flow_pt)}.onnx"
    if path.is_file() and path.stat().st_size > 0:
        return path
    log.info("exporting the flow estimator (%s attention) to %s", kind, path)
    return export_estimator(estimator, path, streaming=streaming, exporter=exporter)
