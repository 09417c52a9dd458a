"""TensorRT estimator: engines built from the exported ONNX graphs (TensorRT 10 Python API).

`tensorrt` is imported only when this backend is built; without it, `make_estimator("tensorrt")`
raises MissingBackendError naming the package, and nothing else in the service needs it.

Build (as upstream's `convert_onnx_to_trt`, facts sheet §7.2, with a dynamic batch):
- one optimization profile: batch min 1 / opt `opt_batch` / max `max_batch` (estimator rows =
  2 × streams: conditional and unconditional halves), frames min 4 / opt `opt_frames` / max
  `max_frames` (upstream: 4 / 500 / 3000) for x, mask, mu, cond; t (batch,), spks (batch, 80);
- precision from the flow dtype: float16 sets the FP16 builder flag, bfloat16 the BF16 flag, and
  then x, mask, mu, spks, cond and the output are HALF / BF16 tensors like upstream's (`t` stays
  float32: 1000·t feeds the sinusoidal embedding, where a half-precision t is off by up to 0.25);
- workspace 4 GiB (upstream's 1 << 32).
Plans are cached next to the ONNX files as `estimator.<full|chunked>.<precision>.<key>.plan`,
key = hash of the ONNX file name (itself keyed by the weights), the GPU name and compute
capability, the TensorRT version, the profile shapes and the precision; they are built on first
use (minutes for the full model) and written atomically.

Execution: one execution context per graph on the caller's CUDA stream (torch's current stream,
so torch's allocator orders the buffers correctly): `set_input_shape` and `set_tensor_address`
for the six inputs and the output, then `execute_async_v3`. Full and chunked rows go to their
own engine (base.RowSplitEstimator), so streaming chunks keep their chunk mask, which upstream's
TensorRT path drops.
"""
from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import torch
from torch import Tensor

from ..files import atomic_write_bytes
from .base import INPUT_NAMES, OUTPUT_NAME, MissingBackendError

log = logging.getLogger(__name__)

WORKSPACE_BYTES = 1 << 32


def import_tensorrt():
    try:
        import tensorrt
    except ImportError as e:
        raise MissingBackendError(
            "the 'tensorrt' flow estimator needs NVIDIA TensorRT 10 and its Python package 'tensorrt' "
            "(pip install tensorrt-cu12, matching your CUDA), which is not installed; choose estimator "
            "'compiled' or 'torch' instead") from e
    return tensorrt


def _precision(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]


def profile_shapes(max_batch: int, opt_batch: int, max_frames: int, opt_frames: int, min_frames: int = 4,
                   mel: int = 80) -> dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]:
    """(min, opt, max) shape per input name."""
    if not 1 <= opt_batch <= max_batch or not min_frames <= opt_frames <= max_frames:
        raise ValueError(f"need 1 <= opt_batch {opt_batch} <= max_batch {max_batch} and "
                         f"{min_frames} <= opt_frames {opt_frames} <= max_frames {max_frames}")
    b = (1, opt_batch, max_batch)
    f = (min_frames, opt_frames, max_frames)
    seq = lambda c: tuple((b[i], c, f[i]) for i in range(3))  # noqa: E731
    return dict(x=seq(mel), mask=seq(1), mu=seq(mel), t=tuple((b[i],) for i in range(3)),
                spks=tuple((b[i], mel) for i in range(3)), cond=seq(mel))


def plan_path(onnx_path: Path, device: torch.device, dtype: torch.dtype, shapes: dict) -> Path:
    trt = import_tensorrt()
    props = torch.cuda.get_device_properties(device)
    payload = json.dumps(dict(onnx=onnx_path.name, gpu=props.name, cc=f"{props.major}.{props.minor}",
                              trt=trt.__version__, shapes=shapes, precision=_precision(dtype)), sort_keys=True)
    key = hashlib.sha256(payload.encode()).hexdigest()[:20]
    kind = onnx_path.name.split(".")[1]  # estimator.<kind>.<key>.onnx
    return onnx_path.with_name(f"estimator.{kind}.{_precision(dtype)}.{key}.plan")


def build_engine(onnx_path: Path, out_path: Path, dtype: torch.dtype, shapes: dict,
                 workspace: int = WORKSPACE_BYTES) -> Path:
    """Build a serialized engine from the ONNX graph and write it atomically to out_path."""
    trt = import_tensorrt()
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    explicit = getattr(trt.NetworkDefinitionCreationFlag, "EXPLICIT_BATCH", None)  # implied (and deprecated) in 10
    network = builder.create_network(0 if explicit is None else 1 << int(explicit))
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise RuntimeError(f"TensorRT could not parse {onnx_path}: {errors}")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, workspace)
    io_type = None
    if dtype == torch.float16:
        config.set_flag(trt.BuilderFlag.FP16)
        io_type = trt.DataType.HALF
    elif dtype == torch.bfloat16:
        config.set_flag(trt.BuilderFlag.BF16)
        io_type = trt.DataType.BF16
    if io_type is not None:
        for i in range(network.num_inputs):
            if network.get_input(i).name != "t":
                network.get_input(i).dtype = io_type
        for i in range(network.num_outputs):
            network.get_output(i).dtype = io_type
    profile = builder.create_optimization_profile()
    for name, (lo, opt, hi) in shapes.items():
        profile.set_shape(name, lo, opt, hi)
    config.add_optimization_profile(profile)
    log.info("building the TensorRT estimator engine %s (%s; this takes a while)", out_path.name, _precision(dtype))
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise RuntimeError(f"TensorRT failed to build an engine from {onnx_path} (see the TensorRT log above)")
    return atomic_write_bytes(out_path, bytes(serialized), fsync=False)


class TensorRTGraph:
    """One engine: (x, mask, mu, t, spks, cond) -> out on torch's current CUDA stream."""

    def __init__(self, plan: Path, device: torch.device, shapes: dict, fallback=None):
        """shapes: the profile the plan was built with; calls with more rows are split, calls with
        frames outside it go to `fallback` ((x, mask, mu, t, spks, cond) -> out; None: an error)."""
        trt = import_tensorrt()
        (_, _, (self.max_batch, _, self.max_frames)) = shapes["x"]
        self.min_frames = shapes["x"][0][2]
        self.fallback = fallback
        self._warned = False
        self.trt = trt
        self.device = device
        self.runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
        self.engine = self.runtime.deserialize_cuda_engine(Path(plan).read_bytes())
        if self.engine is None:
            raise RuntimeError(f"TensorRT could not load {plan} (delete it to rebuild)")
        self.context = self.engine.create_execution_context()
        names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        inputs = [n for n in names if self.engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        if sorted(inputs) != sorted(INPUT_NAMES) or OUTPUT_NAME not in names:
            raise ValueError(f"{plan}: engine tensors {names}, expected inputs {list(INPUT_NAMES)} and {OUTPUT_NAME}")
        to_torch = {trt.DataType.FLOAT: torch.float32, trt.DataType.HALF: torch.float16}
        if hasattr(trt.DataType, "BF16"):
            to_torch[trt.DataType.BF16] = torch.bfloat16
        self.dtypes = {n: to_torch[self.engine.get_tensor_dtype(n)] for n in names}

    def __call__(self, x: Tensor, mask: Tensor, mu: Tensor, t: Tensor, spks: Tensor, cond: Tensor) -> Tensor:
        B, _, T = x.shape
        if not self.min_frames <= T <= self.max_frames:
            if self.fallback is None:
                raise ValueError(f"{T} frames are outside the TensorRT profile [{self.min_frames}, {self.max_frames}]")
            if not self._warned:
                log.warning("%d frames are outside the TensorRT estimator profile [%d, %d]: such calls run on "
                            "PyTorch (raise token2wav.estimator_max_frames to cover them)", T, self.min_frames,
                            self.max_frames)
                self._warned = True
            return self.fallback(x, mask, mu, t, spks, cond)
        if B > self.max_batch:  # rows are independent: split
            parts = [self(*(a[i:i + self.max_batch] for a in (x, mask, mu, t, spks, cond)))
                     for i in range(0, B, self.max_batch)]
            return torch.cat(parts)
        return self._run(x, mask, mu, t, spks, cond)

    def _run(self, x: Tensor, mask: Tensor, mu: Tensor, t: Tensor, spks: Tensor, cond: Tensor) -> Tensor:
        ctx = self.context
        args = {}
        for name, a in zip(INPUT_NAMES, (x, mask, mu, t, spks, cond)):
            a = a.to(self.device, self.dtypes[name]).contiguous()
            args[name] = a  # keep the (possibly converted) tensors alive until the call is enqueued
            if not ctx.set_input_shape(name, tuple(a.shape)):
                raise ValueError(f"TensorRT estimator: input {name} shape {tuple(a.shape)} is outside the profile")
            ctx.set_tensor_address(name, a.data_ptr())
        out = torch.empty(tuple(x.shape), dtype=self.dtypes[OUTPUT_NAME], device=self.device)
        ctx.set_tensor_address(OUTPUT_NAME, out.data_ptr())
        # torch's caching allocator reuses freed blocks only in stream order, so the inputs may be freed
        # after enqueueing on this stream
        with torch.cuda.device(self.device):  # TensorRT runs on the calling thread's current device
            if not ctx.execute_async_v3(torch.cuda.current_stream(self.device).cuda_stream):
                raise RuntimeError("TensorRT estimator execution failed")
        return out.to(x.dtype)


def tensorrt_graph(onnx_path: Path, device: torch.device, dtype: torch.dtype, shapes: dict,
                   fallback=None) -> TensorRTGraph:
    """The engine for this ONNX graph, from the plan cache or built now."""
    plan = plan_path(onnx_path, device, dtype, shapes)
    with torch.cuda.device(device):  # build and load on the estimator's GPU
        if not (plan.is_file() and plan.stat().st_size > 0):
            build_engine(onnx_path, plan, dtype, shapes)
        return TensorRTGraph(plan, device, shapes, fallback)
