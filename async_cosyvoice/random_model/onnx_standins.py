"""campplus.onnx and speech_tokenizer_v2.onnx stand-ins: the official I/O names and shapes, tiny graphs."""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

ONNX_OPSET = 17
ONNX_IR_VERSION = 8  # loadable by onnxruntime >= 1.14


def _np(shape, std: float, gen: torch.Generator) -> np.ndarray:
    return torch.empty(shape).normal_(0.0, std, generator=gen).numpy().astype(np.float32)


def _save_onnx(graph, path: Path) -> None:
    import onnx
    from onnx import helper
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", ONNX_OPSET)],
                              producer_name="async_cosyvoice.make_random_model")
    model.ir_version = ONNX_IR_VERSION
    onnx.checker.check_model(model)
    onnx.save(model, str(path))


def write_campplus_onnx(path: Path, hidden: int, gen: torch.Generator, n_mels: int = 80, emb: int = 192) -> None:
    """`input` (B, T, 80) float -> `output` (B, 192): frame MLP + mean/std pooling + projection."""
    from onnx import TensorProto, helper, numpy_helper as nh
    w1, b1 = _np((n_mels, hidden), 1.0 / math.sqrt(n_mels), gen), _np((hidden,), 0.1, gen)
    w2, b2 = _np((2 * hidden, emb), 1.0 / math.sqrt(2 * hidden), gen), _np((emb,), 0.1, gen)
    inits = [nh.from_array(w1, "w1"), nh.from_array(b1, "b1"), nh.from_array(w2, "w2"),
             nh.from_array(b2, "b2"), nh.from_array(np.array(1e-5, np.float32), "eps")]
    nodes = [
        helper.make_node("MatMul", ["input", "w1"], ["h0"]),
        helper.make_node("Add", ["h0", "b1"], ["h1"]),
        helper.make_node("Tanh", ["h1"], ["h"]),
        helper.make_node("ReduceMean", ["h"], ["mean_k"], axes=[1], keepdims=1),
        helper.make_node("Sub", ["h", "mean_k"], ["centered"]),
        helper.make_node("Mul", ["centered", "centered"], ["sq"]),
        helper.make_node("ReduceMean", ["sq"], ["var"], axes=[1], keepdims=0),
        helper.make_node("Add", ["var", "eps"], ["var_eps"]),
        helper.make_node("Sqrt", ["var_eps"], ["std"]),
        helper.make_node("ReduceMean", ["h"], ["mean"], axes=[1], keepdims=0),
        helper.make_node("Concat", ["mean", "std"], ["stats"], axis=1),
        helper.make_node("Gemm", ["stats", "w2", "b2"], ["output"]),
    ]
    graph = helper.make_graph(
        nodes, "campplus_standin",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["B", "T", n_mels])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, ["B", emb])], inits)
    _save_onnx(graph, path)


def write_speech_tokenizer_onnx(path: Path, hidden: int, gen: torch.Generator, n_mels: int = 128,
                                fsq_dims: int = 8) -> None:
    """`feats` (B, 128, T) float + `feats_length` (B,) int32 -> `indices` (B, T_tok) int32, T_tok as two
    stride-2 k3 convs give; codes = sum_i (round(0.999 * tanh(z_i)) + 1) * 3^i over 8 dims (0..6560)."""
    from onnx import TensorProto, helper, numpy_helper as nh
    w1, b1 = _np((hidden, n_mels, 3), 1.0 / math.sqrt(3 * n_mels), gen), _np((hidden,), 0.1, gen)
    w2, b2 = _np((fsq_dims, hidden, 3), 3.0 / math.sqrt(3 * hidden), gen), _np((fsq_dims,), 0.1, gen)
    powers = (3.0 ** np.arange(fsq_dims, dtype=np.float32)).reshape(1, fsq_dims, 1)
    inits = [nh.from_array(w1, "w1"), nh.from_array(b1, "b1"), nh.from_array(w2, "w2"), nh.from_array(b2, "b2"),
             nh.from_array(powers, "powers"),
             nh.from_array(np.array(0, np.int64), "zero"), nh.from_array(np.array(1, np.int64), "one"),
             nh.from_array(np.array(2, np.int64), "two"), nh.from_array(np.array([0], np.int64), "ax0"),
             nh.from_array(np.array([1], np.int64), "ax1"),
             nh.from_array(np.array(0.999, np.float32), "scale"), nh.from_array(np.array(1.0, np.float32), "fone")]
    nodes = [
        # zero the frames past feats_length
        helper.make_node("Shape", ["feats"], ["shape"]),
        helper.make_node("Gather", ["shape", "two"], ["t_len"], axis=0),
        helper.make_node("Range", ["zero", "t_len", "one"], ["frames"]),
        helper.make_node("Unsqueeze", ["frames", "ax0"], ["frames_row"]),
        helper.make_node("Cast", ["feats_length"], ["len64"], to=TensorProto.INT64),
        helper.make_node("Unsqueeze", ["len64", "ax1"], ["len_col"]),
        helper.make_node("Less", ["frames_row", "len_col"], ["valid"]),
        helper.make_node("Cast", ["valid"], ["valid_f"], to=TensorProto.FLOAT),
        helper.make_node("Unsqueeze", ["valid_f", "ax1"], ["mask"]),
        helper.make_node("Mul", ["feats", "mask"], ["x"]),
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], kernel_shape=[3], strides=[2], pads=[1, 1]),
        helper.make_node("Tanh", ["c1"], ["a1"]),
        helper.make_node("Conv", ["a1", "w2", "b2"], ["z"], kernel_shape=[3], strides=[2], pads=[1, 1]),
        helper.make_node("Tanh", ["z"], ["tz"]),
        helper.make_node("Mul", ["tz", "scale"], ["sz"]),
        helper.make_node("Round", ["sz"], ["rz"]),
        helper.make_node("Add", ["rz", "fone"], ["digits"]),
        helper.make_node("Mul", ["digits", "powers"], ["weighted"]),
        helper.make_node("ReduceSum", ["weighted", "ax1"], ["code_f"], keepdims=0),
        helper.make_node("Cast", ["code_f"], ["indices"], to=TensorProto.INT32),
    ]
    graph = helper.make_graph(
        nodes, "speech_tokenizer_v2_standin",
        [helper.make_tensor_value_info("feats", TensorProto.FLOAT, ["B", n_mels, "T"]),
         helper.make_tensor_value_info("feats_length", TensorProto.INT32, ["B"])],
        [helper.make_tensor_value_info("indices", TensorProto.INT32, ["B", "T_tok"])], inits)
    _save_onnx(graph, path)
