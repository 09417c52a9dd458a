"""A bucket's CUDA graph is never captured on the request path (graph_buckets.py): its first call
runs the bucket's function padded, without a graph, and leaves the bucket wanted; `capture_wanted`
captures it later (the token2wav batcher calls it in its capture thread: tests/test_background_captures.py), and
the next call replays it. The same output either way.

On CPU: the bookkeeping that runs without CUDA (buckets, the failed-capture rule's effect on
`bucket`). On a GPU (run there; skipped here): a tiny GraphBuckets of a small function, the
estimator's `_example` capture, and a capture that fails.
"""
from __future__ import annotations

import pytest
import torch
from torch import Tensor

from async_cosyvoice.estimator.torch_backend import CompiledEstimator
from async_cosyvoice.graph_buckets import GraphBuckets
from async_cosyvoice.model_dir import build_models, load_model_dir

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")


class Scale(GraphBuckets):
    """y = tanh(x @ w) * mask along the length: a (batch, length) bucketed call of a few kernels."""
    what, unit = "test", "frames"

    def __init__(self, device: str, cuda_graphs: bool | None = None, **kw):
        super().__init__(torch.device(device), cuda_graphs=cuda_graphs, batch_buckets=(1, 2, 4), min_step=16,
                         max_bucket_size=None, max_graphs=kw.pop("max_graphs", 8), **kw)
        self.w = torch.randn(8, 8, generator=torch.Generator().manual_seed(0)).to(device)

    def __call__(self, x: Tensor) -> Tensor:
        """x (B, T, 8) -> (B, T, 8)."""
        B, T, _ = x.shape
        bucket = self.bucket(B, T)
        if bucket is None:
            self.fallbacks += 1
            return torch.tanh(x @ self.w)
        mask = torch.ones(B, T, 1, device=x.device)
        return self._run(bucket, dict(x=x, mask=mask))[:B, :T].clone()

    def _fn(self, bucket):
        return lambda x, mask: torch.tanh(x @ self.w) * mask

    def _buffer_shape(self, name: str, bucket, example: Tensor) -> tuple[int, ...]:
        B, T = bucket
        return (B, T, example.shape[2])

    def _example(self, bucket) -> dict[str, Tensor]:
        B, T = bucket
        return dict(x=torch.zeros(B, T, 8, device=self.device), mask=torch.ones(B, T, 1, device=self.device))


def test_off_cuda_calls_run_padded_and_want_nothing():
    calls = Scale("cpu")
    x = torch.randn(3, 20, 8)
    out = calls(x)
    assert torch.allclose(out, torch.tanh(x @ calls.w), atol=1e-6)
    assert (calls.replays, calls.deferred, calls.wanted, calls.capture_wanted()) == (1, 0, {}, False)


def test_the_estimators_example_is_a_finite_call_of_its_bucket(tiny_dir):
    """What `capture_wanted` captures the estimator with: its bucket's static shapes (all that
    reaches the capture), and values that make a finite call of the bucket."""

    module = build_models(load_model_dir(tiny_dir), with_llm=False).flow.decoder.estimator
    est = CompiledEstimator(module, compile=False, cuda_graphs=False, batch_buckets=(2, 4))
    example = est._example((4, 128))
    assert {k: tuple(v.shape) for k, v in example.items()} == {
        k: est._buffer_shape(k, (4, 128), v) for k, v in example.items()}
    with torch.inference_mode():
        out = est._fn((4, 128))(**example)
    assert out.shape == (4, module.dims.out_channels, 128) and torch.isfinite(out).all()


@cuda
def test_a_new_bucket_runs_ungraphed_until_captured_then_replays():
    calls = Scale("cuda")
    x = torch.randn(3, 20, 8, device="cuda")
    with torch.inference_mode():
        first = calls(x)  # bucket (4, 32): no graph yet
        assert not calls.graphs and list(calls.wanted) == [(4, 32)]
        assert (calls.replays, calls.deferred, calls.fallbacks) == (0, 1, 0)
        calls(torch.randn(1, 40, 8, device="cuda"))  # (1, 48): wanted after (4, 32)
        calls(x)  # (4, 32) again: still ungraphed, wanted once
        assert list(calls.wanted) == [(4, 32), (1, 48)] and calls.deferred == 3
        assert calls.capture_wanted()  # the oldest
        assert list(calls.graphs) == [(4, 32)] and list(calls.wanted) == [(1, 48)]
        replayed = calls(x)
        assert calls.replays == 1 and calls.deferred == 3
        assert (replayed - first).abs().max().item() <= 1e-5  # fp32: the same computation
        assert (replayed - torch.tanh(x @ calls.w)).abs().max().item() <= 1e-5
        assert calls.capture_wanted() and not calls.capture_wanted()  # (1, 48), then nothing wanted
        assert sorted(calls.graphs) == [(1, 48), (4, 32)]


@cuda
def test_capture_wanted_drops_buckets_without_room_and_survives_a_failed_capture():
    calls = Scale("cuda", max_graphs=1)
    with torch.inference_mode():
        calls(torch.randn(2, 10, 8, device="cuda"))
        calls(torch.randn(4, 10, 8, device="cuda"))
        assert list(calls.wanted) == [(2, 16), (4, 16)]
        assert calls.capture_wanted() and list(calls.graphs) == [(2, 16)]
        assert not calls.capture_wanted() and not calls.wanted  # max_graphs: (4, 16) dropped
        x = torch.randn(4, 10, 8, device="cuda")
        assert calls.bucket(4, 10) is None
        assert (calls(x) - torch.tanh(x @ calls.w)).abs().max().item() <= 1e-5 and calls.fallbacks == 1

    class Broken(Scale):
        def _example(self, bucket):
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (stand-in)")

    broken = Broken("cuda")
    with torch.inference_mode():
        x = torch.randn(2, 10, 8, device="cuda")
        broken(x)
        assert broken.capture_wanted()  # it ran (and failed): logged, the bucket given up
        assert not broken.graphs and not broken.wanted and broken.bucket(2, 10) is None
        assert (broken(x) - torch.tanh(x @ broken.w)).abs().max().item() <= 1e-5
        assert broken.fallbacks == 1 and not broken.wanted  # never wanted again


@cuda
def test_the_estimator_captures_from_its_example(tiny_dir):
    """CompiledEstimator's `_example` (zeros, a mask of ones) captures a bucket whose replay is the
    padded call: a first call ungraphed, capture_wanted, then a replay, the same within 1e-5."""
    from async_cosyvoice.estimator.torch_backend import CompiledEstimator

    module = build_models(load_model_dir(tiny_dir), device="cuda", with_llm=False).flow.decoder.estimator
    est = CompiledEstimator(module, compile=False, cuda_graphs=True, batch_buckets=(2, 4))
    g = torch.Generator(device="cuda").manual_seed(0)
    B, C, T = 3, module.dims.out_channels, 70
    x, mu, cond = (torch.randn(B, C, T, generator=g, device="cuda") for _ in range(3))
    mask = torch.ones(B, 1, T, device="cuda")
    mask[2, :, 50:] = 0
    args = (x, mask, mu, torch.rand(B, generator=g, device="cuda"), torch.randn(B, C, generator=g, device="cuda"),
            cond, torch.tensor([True, False, True], device="cuda"))
    with torch.inference_mode():
        first = est(*args)
        assert not est.graphs and list(est.wanted) == [(4, 128)] and est.deferred == 1
        assert est.capture_wanted() and list(est.graphs) == [(4, 128)]
        replayed = est(*args)
    assert est.replays == 1 and torch.isfinite(replayed).all()
    assert (replayed - first).abs().max().item() <= 1e-5


@cuda
def test_a_capture_in_one_thread_while_another_thread_calls():
    """What the token2wav batcher does: its capture thread captures wanted buckets while its
    device thread goes on calling, on a stream of its own, the bucket being captured included
    (ungraphed until its graph is in, then replayed). Every call's output stays right."""
    import threading

    calls = Scale("cuda")
    x = torch.randn(3, 20, 8, device="cuda")
    y = torch.randn(2, 9, 8, device="cuda")
    want_x, want_y = torch.tanh(x @ calls.w), torch.tanh(y @ calls.w)
    with torch.inference_mode():
        calls(x), calls(y)  # (4, 32) and (2, 16) wanted
    errors: list[float] = []
    stop = threading.Event()

    def device_thread():
        stream = torch.cuda.Stream()
        with torch.inference_mode(), torch.cuda.stream(stream):
            while not stop.is_set() or len(errors) < 200:
                errors.append(max((calls(x) - want_x).abs().max().item(), (calls(y) - want_y).abs().max().item()))

    worker = threading.Thread(target=device_thread)
    worker.start()
    try:
        captured = [calls.capture_wanted() for _ in range(3)]
    finally:
        stop.set()
        worker.join(60)
    assert not worker.is_alive() and captured == [True, True, False]
    assert sorted(calls.graphs) == [(2, 16), (4, 32)] and not calls.wanted
    assert max(errors) <= 1e-5 and calls.replays > 0  # the device thread's later calls replayed the graphs


@cuda
def test_want_marks_planned_buckets_for_the_capture_thread():
    """The warm-up's deferred plan (`capture_before_serving: first_chunks`): buckets marked wanted
    without a call, those captured already left out, then captured by `capture_wanted`."""
    calls = Scale("cuda")
    with torch.inference_mode():
        calls.warmup([1], [16])
        assert calls.want([1, 2], [10, 20]) == 3 and list(calls.wanted) == [(1, 32), (2, 16), (2, 32)]
        assert calls.want([2], [20]) == 0  # already wanted
        while calls.capture_wanted():
            pass
    assert sorted(calls.graphs) == [(1, 16), (1, 32), (2, 16), (2, 32)] and calls.deferred == 0


def test_want_is_nothing_off_cuda():
    calls = Scale("cpu")
    assert calls.want([1, 2], [10, 20]) == 0 and not calls.wanted


@cuda
def test_captures_never_run_on_a_serving_threads_stream():
    """torch.cuda.Stream() deals out a pool of 32 streams in turn: a new side stream per capture came
    round to the LLM's or the token2wav thread's own stream. Captures run on one stream of another
    pool (cuda_graph.capture_stream), however many captures and serving streams there are."""
    from async_cosyvoice.cuda_graph import capture_stream

    serving = [torch.cuda.Stream() for _ in range(40)]  # the default pool, dealt round more than once
    calls = Scale("cuda")
    with torch.inference_mode():
        for t in (16, 32, 48, 64):
            calls.warmup([1, 2], [t])
    side = capture_stream(torch.device("cuda", torch.cuda.current_device()))
    assert side.cuda_stream not in {s.cuda_stream for s in serving}
    assert side is capture_stream(torch.device("cuda", torch.cuda.current_device())) and len(calls.graphs) == 8
