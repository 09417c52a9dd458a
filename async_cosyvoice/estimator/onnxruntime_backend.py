"""ONNX Runtime estimator: the exported graphs (onnx_export.py) in onnxruntime sessions.

Two sessions, full attention and chunked attention, behind base.RowSplitEstimator, so final and
streaming rows both get the PyTorch result (parity: tests/test_estimator_backends.py, within 1e-4
of eager; measured ~2e-6 on the tiny fixture). With `chunked=False` only the full-attention graph
is built, like upstream's export, and streaming rows run on the flow's PyTorch estimator.

On CUDA the sessions use the CUDA execution provider with I/O bound to torch tensors; they run
on onnxruntime's own stream, so each call synchronises torch's current stream before and the
outputs after. This backend is the parity reference for the graphs; TensorRT is the fast path.
"""
from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from .base import INPUT_NAMES, OUTPUT_NAME, MissingBackendError

log = logging.getLogger(__name__)


def _import_ort():
    try:
        import onnxruntime
    except ImportError as e:
        raise MissingBackendError(
            "the 'onnxruntime' flow estimator needs the onnxruntime package (pip install onnxruntime, or "
            "onnxruntime-gpu for CUDA)") from e
    return onnxruntime


class OnnxRuntimeGraph:
    """One estimator graph: (x, mask, mu, t, spks, cond) -> out, float32 inside."""

    def __init__(self, path: str | Path, device: torch.device | str = "cpu", threads: int | None = None):
        ort = _import_ort()
        self.path = Path(path)
        self.device = torch.device(device)
        opts = ort.SessionOptions()
        if threads is not None:
            opts.intra_op_num_threads = threads
            opts.inter_op_num_threads = 1
        providers = ["CPUExecutionProvider"]
        if self.device.type == "cuda":
            if "CUDAExecutionProvider" in ort.get_available_providers():
                providers = [("CUDAExecutionProvider", {"device_id": self.device.index or 0}), "CPUExecutionProvider"]
            else:
                log.warning("onnxruntime has no CUDAExecutionProvider (install onnxruntime-gpu): the estimator "
                            "graph runs on the CPU")
                self.device = torch.device("cpu")
        self.session = ort.InferenceSession(str(self.path), opts, providers=providers)
        names = [i.name for i in self.session.get_inputs()]
        if names != list(INPUT_NAMES):
            raise ValueError(f"{self.path}: graph inputs {names}, expected {list(INPUT_NAMES)}")

    def __call__(self, x: Tensor, mask: Tensor, mu: Tensor, t: Tensor, spks: Tensor, cond: Tensor) -> Tensor:
        args = [a.to(self.device, torch.float32).contiguous() for a in (x, mask, mu, t, spks, cond)]
        if self.device.type == "cuda":
            out = torch.empty(args[0].shape, dtype=torch.float32, device=self.device)
            binding = self.session.io_binding()
            index = self.device.index or 0
            for name, a in zip(INPUT_NAMES, args):
                binding.bind_input(name, "cuda", index, np.float32, tuple(a.shape), a.data_ptr())
            binding.bind_output(OUTPUT_NAME, "cuda", index, np.float32, tuple(out.shape), out.data_ptr())
            torch.cuda.current_stream(self.device).synchronize()  # inputs written on torch's stream
            self.session.run_with_iobinding(binding)
            binding.synchronize_outputs()
        else:
            feeds = {name: a.numpy() for name, a in zip(INPUT_NAMES, args)}
            out = torch.from_numpy(self.session.run([OUTPUT_NAME], feeds)[0])
        return out.to(x.device, x.dtype)
