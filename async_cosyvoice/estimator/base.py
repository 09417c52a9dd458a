"""The flow-estimator interface shared by every backend.

An estimator is the CFM vector field v(x, t | mu, spks, cond): a callable

    estimator(x, mask, mu, t, spks, cond, streaming) -> out

with x, mu, cond (B, 80, T), mask (B, 1, T), t (B,), spks (B, 80), out (B, 80, T) in x's dtype,
zero where mask is 0. `streaming` is a bool for the whole batch or a (B,) bool tensor: rows with
True attend in chunks of `static_chunk_size` frames counted from frame 0 (streaming chunks),
rows with False attend to every valid frame (final / non-streaming calls). The flow passes one
(2B,) batch per CFM step: B conditional rows then B unconditional rows.

Every backend also says what it is (`name`) and whether it computes chunked rows itself
(`supports_streaming`; a backend that does not hands those rows to a fallback and says so once
in the log).

Graph backends (ONNX Runtime, TensorRT) run one fixed attention pattern per graph, like upstream's
export (which traces streaming=False and so ignores the flag under TensorRT). Ours exports two
graphs with the same six inputs, one with full attention and one with the chunk mask baked in,
and `RowSplitEstimator` sends each row to the graph that is exact for it.
"""
from __future__ import annotations

import logging
from typing import Callable, Protocol, runtime_checkable

import torch
from torch import Tensor

log = logging.getLogger(__name__)

INPUT_NAMES = ("x", "mask", "mu", "t", "spks", "cond")
OUTPUT_NAME = "estimator_out"


class MissingBackendError(ImportError):
    """A configured estimator backend needs a package that is not installed (the message names it)."""


# (x, mask, mu, t, spks, cond) -> out, for one fixed attention pattern
GraphFn = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]


@runtime_checkable
class Estimator(Protocol):
    name: str
    supports_streaming: bool

    def __call__(self, x: Tensor, mask: Tensor, mu: Tensor, t: Tensor, spks: Tensor, cond: Tensor,
                 streaming: bool | Tensor = False) -> Tensor:
        ...


def attention_options(module: torch.nn.Module, attention: str) -> dict[str, str]:
    """The keyword a recomputing call passes the estimator module for its attention
    (token2wav.flow_attention): none for "sdpa", every module's default; another only where the
    module's class lists it in `attentions` (CosyVoice2's decoder: "flex")."""
    if attention == "sdpa":
        return {}
    supported = getattr(module, "attentions", ("sdpa",))
    if attention not in supported:
        raise ValueError(f"flow attention {attention!r}: the {type(module).__name__} estimator supports "
                         f"{', '.join(supported)}")
    return {"attention": attention}


def streaming_rows(streaming: bool | Tensor, batch: int, device: torch.device | str = "cpu") -> Tensor:
    """The flag as a (batch,) bool tensor on `device`."""
    if isinstance(streaming, Tensor):
        return streaming.reshape(-1).to(device, torch.bool).expand(batch)
    return torch.full((batch,), bool(streaming), dtype=torch.bool, device=device)


class RowSplitEstimator:
    """A backend made of one graph per attention pattern.

    `full` computes rows with full attention, `chunked` rows with the streaming chunk mask (None:
    such rows go to `fallback`, normally the flow's own PyTorch estimator). A batch mixing both
    kinds of rows is split in two calls and the outputs put back in row order; rows are
    independent in the estimator, so the split is exact.
    """

    def __init__(self, name: str, full: GraphFn, chunked: GraphFn | None, fallback: Estimator | None = None):
        if chunked is None and fallback is None:
            raise ValueError(f"{name}: without a chunked graph, a fallback estimator is needed for streaming rows")
        self.name = name
        self.full = full
        self.chunked = chunked
        self.fallback = fallback
        self.supports_streaming = chunked is not None
        self._warned = False
        # the last per-row flag tensor and its row split: the CFM passes the same tensor at every step,
        # so the device is synced once per flow batch, not once per step
        self._flag: Tensor | None = None
        self._batch = 0
        self._split: tuple[Tensor, Tensor] | None = None

    def _chunked(self, x, mask, mu, t, spks, cond) -> Tensor:
        if self.chunked is not None:
            return self.chunked(x, mask, mu, t, spks, cond)
        if not self._warned:
            log.warning("%s estimator has no streaming (chunked-attention) graph: streaming chunks run on the "
                        "%s fallback", self.name, getattr(self.fallback, "name", "torch"))
            self._warned = True
        return self.fallback(x, mask, mu, t, spks, cond, True)

    def __call__(self, x: Tensor, mask: Tensor, mu: Tensor, t: Tensor, spks: Tensor, cond: Tensor,
                 streaming: bool | Tensor = False) -> Tensor:
        args = (x, mask, mu, t, spks, cond)
        if not isinstance(streaming, Tensor):
            return self._chunked(*args) if streaming else self.full(*args)
        if streaming is not self._flag or self._batch != x.shape[0]:
            rows = streaming_rows(streaming, x.shape[0])
            self._flag, self._batch = streaming, x.shape[0]
            self._split = (rows.nonzero().reshape(-1).to(x.device), (~rows).nonzero().reshape(-1).to(x.device))
        chunked_idx, full_idx = self._split
        if not len(full_idx):
            return self._chunked(*args)
        if not len(chunked_idx):
            return self.full(*args)
        out = torch.empty_like(x)
        out[chunked_idx] = self._chunked(*(a.index_select(0, chunked_idx) for a in args)).to(x.dtype)
        out[full_idx] = self.full(*(a.index_select(0, full_idx) for a in args)).to(x.dtype)
        return out
