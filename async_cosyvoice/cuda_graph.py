"""One function captured as a CUDA graph at fixed input shapes: the flow estimator's buckets
(estimator/torch_backend.py) and the flow's and HiFT's bucketed graphs (graph_buckets.py) are all this.

The inputs are static buffers. A call zeroes each buffer, copies its argument into the leading
corner (an argument may be smaller than its buffer in every dimension: that is the padding),
replays the graph and returns its static outputs, which the next replay of any graph of the same
memory pool overwrites: callers copy out what they keep before that.

Capture follows PyTorch's recipe: two runs on a side stream first (they compile, autotune and fill
lazy caches, none of which may happen inside a capture), then the capture, in `thread_local` mode
so that another thread's CUDA work (the LLM engine's, the token2wav device thread's) does not
invalidate it, on that side stream with the graph's device current: torch.cuda.graph's default
capture stream is one per process, made on whatever device was current at the first capture, which
with several GPUs in one process is another GPU's (on an H100 pair: "operation not permitted when
stream is capturing").

The capture is begun and ended on the graph itself, not with `torch.cuda.graph`, whose entry
synchronizes the whole device and empties the caching allocator (the other threads' cached blocks
too, and pinned host memory): harmless at start-up, a stall of every stream and a wave of fresh
cudaMallocs when captures run beside serving.

The side stream is one per device (`capture_stream`), taken from PyTorch's pool of higher-priority
streams, which nothing else here uses. `torch.cuda.Stream()` hands out the 32 streams of a pool in
turn, so a new side stream per capture came round, after 32 captures, to the very stream the LLM
engine or the token2wav device thread runs on (both from the default pool); with captures beside
serving, that thread's work then ran on a capturing stream (an H100 server: "Cannot copy between
CPU and CUDA tensors during CUDA graph capture" in an LLM step). The two runs before a capture
run there too, at that priority: a capture's warm-up goes ahead of the batches' kernels (two
recomputing calls of its bucket, tens to hundreds of ms of GPU per capture).
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import torch
from torch import Tensor

CAPTURE_STREAM_PRIORITY = -1  # a pool of its own: the serving threads' streams are priority 0


@functools.cache
def capture_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream captures on `device` run on: one capture at a time per token2wav batcher (its capture
    thread), and a process has one batcher per device."""
    return torch.cuda.Stream(device, priority=CAPTURE_STREAM_PRIORITY)


def fill_corner(buffer: Tensor, value: Tensor) -> None:
    """Copy `value` into the leading corner of `buffer` (at most its size in every dimension): what
    a captured call's input buffer holds, the rest being padding."""
    buffer[tuple(slice(0, n) for n in value.shape)].copy_(value)


class CapturedCall:
    def __init__(self, fn: Callable[..., Any], inputs: dict[str, Tensor], device: torch.device, pool=None):
        self.inputs = inputs
        with torch.cuda.device(device):
            side = capture_stream(torch.device("cuda", torch.cuda.current_device()))
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                for _ in range(2):
                    fn(**inputs)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.stream(side):
                self.graph.capture_begin(pool=pool, capture_error_mode="thread_local")
                try:
                    self.out = fn(**inputs)
                finally:
                    self.graph.capture_end()
            # the example inputs, made on this thread's stream, are freed after the capture
            torch.cuda.current_stream(device).wait_stream(side)

    def __call__(self, **inputs: Tensor) -> Any:
        for name, value in inputs.items():
            buf = self.inputs[name]
            buf.zero_()
            fill_corner(buf, value)
        self.graph.replay()
        return self.out

