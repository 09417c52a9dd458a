"""The CUDA graph state of a token2wav device on /metrics (grpc_async/device_metrics.py) and the
benchmarks' wait for its pending captures (cosyvoice_cli/bench/graphs.py): a real server on
127.0.0.1 with the tiny fixture model on the CPU, read over HTTP.

A CPU captures no graph, so `Token2WavRunner.graph_holders` lists no holder there (it lists those
that capture). Here the runner lists its flow and HiFT graph holders anyway, built with CUDA graphs
off: their calls run padded to their bucket (counted as replays) or past the buckets (fallbacks),
the bookkeeping a GPU does too, so the series carry counts that real synthesis made. A bucket is
wanted only on CUDA (a call before its capture); the test marks one on the real holder to see the
gauge and the benchmark's wait follow it.
"""
from __future__ import annotations

import asyncio
import dataclasses
import urllib.request

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from async_cosyvoice.config import Config
from async_cosyvoice.estimator import estimator_from_config
from async_cosyvoice.graph_buckets import GraphBuckets
from async_cosyvoice.model_dir import build_models
from async_cosyvoice.token2wav import ChunkSchedule, Token2WavRunner
from async_cosyvoice.token2wav.batcher import Token2WavBatcher
from async_cosyvoice.token2wav.flow_graphs import FlowGraphs
from async_cosyvoice.token2wav.graph_state import DeviceGraphState, GraphKindState
from async_cosyvoice.token2wav.hift_graphs import HiFTGraphs
from async_cosyvoice.tts import Synthesizer
from cosyvoice_cli import bench
from grpc_async.client import CosyVoiceClient
from grpc_async.device_metrics import GraphFamilies
from grpc_async.server import ServerThread

TEXT = "Hello there, this is a small test."
PROMPT_TEXT = "The morning train was late again, so I walked along the river."
FLOW_BUCKET_TOKENS = 160  # streams x tokens of the largest flow bucket: longer calls run past the buckets
PER_KIND = {"cosyvoice_device_cuda_graphs": "graphs", "cosyvoice_device_cuda_graphs_wanted": "wanted",
            "cosyvoice_device_cuda_graph_replays": "replays",
            "cosyvoice_device_cuda_graph_deferred_calls": "deferred",
            "cosyvoice_device_cuda_graph_fallback_calls": "fallbacks"}
DEVICE = {"index": "0", "device": "cpu", "role": "all"}


class EveryHolder(Token2WavRunner):
    """The real runner, listing its graph holders whether or not they capture."""

    def graph_holders(self) -> list[GraphBuckets]:
        return [g for g in (self.flow_graphs, self.hift_graphs, self.slot_calls, self.estimator)
                if isinstance(g, GraphBuckets)]


def _token2wav(config: Config, model_dir) -> Token2WavBatcher:
    models = build_models(model_dir, with_llm=False)
    estimator = estimator_from_config(config.token2wav, models.flow, flow_pt=model_dir.path / "flow.pt")
    flow_graphs = FlowGraphs(models.flow, estimator.capturable, estimator, cuda_graphs=False,
                             max_bucket_tokens=FLOW_BUCKET_TOKENS)
    hift_graphs = HiFTGraphs(models.hift, cuda_graphs=False,
                             cache_samples=ChunkSchedule(samples_per_frame=models.hift.upsample_scale).source_cache_len)
    runner = EveryHolder(models.flow, models.hift, estimator=estimator, flow_cache=False, flow_graphs=flow_graphs,
                         hift_graphs=hift_graphs)
    return Token2WavBatcher(runner)


async def _synthesizer(config: Config) -> Synthesizer:
    return await Synthesizer.create(config, token2wav=lambda model_dir: _token2wav(config, model_dir))


@pytest.fixture(scope="module")
def server(tiny_dir, tmp_path_factory):
    cfg = Config.model_validate({
        "model": {"dir": str(tiny_dir)},
        "speakers": {"dir": str(tmp_path_factory.mktemp("spk"))},
        "server": {"port": 0, "metrics_port": 0, "grace_seconds": 5},
        "token2wav": {"flow_cache": False},  # every flow call through the flow's graph holder
    })
    with ServerThread(cfg, ready_timeout=600, synthesizer_factory=_synthesizer) as st:
        yield st


def _url(st: ServerThread) -> str:
    return f"http://127.0.0.1:{st.server.metrics_port}/metrics"


def _scrape(st: ServerThread) -> dict[tuple[str, str | None], float]:
    """(series, kind) -> value of the graph series of device 0 (kind None: per device)."""
    text = urllib.request.urlopen(_url(st), timeout=10).read().decode()
    found = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith("cosyvoice_device_cuda_graph") and not s.name.endswith("_created"):
                assert {k: s.labels[k] for k in DEVICE} == DEVICE
                found[(family.name, s.labels.get("kind"))] = s.value
    return found


def _holders(st: ServerThread) -> dict[str, GraphBuckets]:
    return {g.what: g for g in st.server.synthesizer.batcher.runner.graph_holders()}


def test_the_graph_series_are_the_holders_counts_after_synthesis(server, golden_dir):
    prompt = (golden_dir / "prompt_24k.wav").read_bytes()

    async def speak():
        async with CosyVoiceClient(server.target) as client:
            async def one(seed: int) -> None:
                chunks = [c async for c in client.synthesize(TEXT, stream=True, max_tokens=60, seed=seed,
                                                             prompt_audio=prompt, prompt_text=PROMPT_TEXT)]
                assert chunks and chunks[-1].is_final
            await asyncio.gather(*(one(s) for s in range(3)))

    server.call(speak(), timeout=300)
    found = _scrape(server)
    holders = _holders(server)
    assert set(holders) == {"flow", "HiFT"}
    for kind, g in holders.items():
        expected = {(name, kind): float(v) for name, attr in PER_KIND.items()
                    for v in [len(getattr(g, attr)) if attr in ("graphs", "wanted") else getattr(g, attr)]}
        assert {key: found[key] for key in expected} == expected
    # real calls were counted: in their bucket, and (flow: prompt + tokens past FLOW_BUCKET_TOKENS) past them
    assert found[("cosyvoice_device_cuda_graph_replays", "HiFT")] > 0
    assert found[("cosyvoice_device_cuda_graph_replays", "flow")] > 0
    assert found[("cosyvoice_device_cuda_graph_fallback_calls", "flow")] > 0
    batcher = server.server.synthesizer.batcher
    assert found[("cosyvoice_device_cuda_graph_background_captures", None)] == batcher.background_captures == 0
    assert found[("cosyvoice_device_cuda_graph_capture_seconds", None)] == 0.0
    assert found[("cosyvoice_device_cuda_graph_capture_gave_way_seconds", None)] == batcher.capture_gave_way_seconds == 0.0
    assert found[("cosyvoice_device_cuda_graph_capturing", None)] == 0.0


def test_the_bench_waits_for_wanted_graphs_within_its_bound(server):
    flow = _holders(server)["flow"]
    stages = bench.PrometheusStages(_url(server))

    async def settle_while_wanted():
        timed_out = await bench.settle_graphs(stages, bound_s=0.6, poll_s=0.1)
        # the wanted bucket goes (as when the batcher has captured it) while the bench waits
        asyncio.get_running_loop().call_later(0.5, flow.wanted.clear)
        settled = await bench.settle_graphs(stages, bound_s=60.0, poll_s=0.1)
        return timed_out, settled

    flow.wanted[(2, 64)] = None
    try:
        assert _scrape(server)[("cosyvoice_device_cuda_graphs_wanted", "flow")] == 1.0
        timed_out, settled = asyncio.run(settle_while_wanted())
    finally:
        flow.wanted.clear()
    assert not timed_out["settled"] and timed_out["wanted"] == 1 and timed_out["waited_s"] >= 0.6
    assert "1 STILL WANTED (0 device(s) capturing) after the 0.6 s bound" in bench.format_settle(timed_out, "sweep 32")
    assert settled["settled"] and settled["wanted"] == 0 and 0.5 <= settled["waited_s"] < 60.0
    assert settled["captured"] == 0 and settled["background_captures"] == 0
    assert "STILL" not in bench.format_settle(settled, "capacity")


def test_a_capture_under_way_keeps_the_wait_going():
    """A bucket leaves `wanted` as its capture starts: a device that says its capture thread is at
    work is not settled, with nothing wanted. The exposition is the server's collector's."""
    class OneDevice:
        def __init__(self, state: DeviceGraphState):
            self.state = state

        def collect(self):
            families = GraphFamilies()
            families.add(["0", "cuda:0", "all"], self.state)
            return families.families()

    def counts(state: DeviceGraphState) -> bench.GraphCounts:
        registry = CollectorRegistry()
        registry.register(OneDevice(state))
        return bench.parse_graph_counts(generate_latest(registry).decode())

    flow = GraphKindState("flow", graphs=12, wanted=0, replays=40, deferred=3, fallbacks=1)
    capturing = counts(DeviceGraphState((flow,), background_captures=2, capture_seconds=3.5, capturing=True))
    assert capturing == bench.GraphCounts(captured=12, wanted=0, background_captures=2, capture_seconds=3.5,
                                          capturing=1)
    assert not capturing.settled
    assert counts(DeviceGraphState((flow,), background_captures=3, capture_seconds=5.0)).settled
    assert not counts(DeviceGraphState((dataclasses.replace(flow, wanted=2),))).settled
