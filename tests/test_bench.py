"""The benchmark client: metrics on hand-made arrival times, the closed loop on a fake target,
and (slow) a real in-process sweep + token2wav comparison on the tiny fixture, and the gRPC path."""
from __future__ import annotations

import asyncio
import json
import sys

import numpy as np
import pytest

from async_cosyvoice import bench
from async_cosyvoice.bench import RequestResult, underruns


# -- underruns ---------------------------------------------------------------------------------

def test_underruns_none_when_every_chunk_is_in_time():
    # chunk 1 due at 0.1 + 0.5, chunk 2 at 0.1 + 1.0
    assert underruns([0.1, 0.6, 0.9], [0.5, 0.5, 0.5]) == (0, 0.0)


def test_underruns_counts_late_chunks_and_the_stall_a_listener_hears():
    late, stall = underruns([0.1, 0.8, 1.0], [0.5, 0.5, 0.5])
    assert late == 1 and stall == pytest.approx(0.2)  # chunk 1 due 0.6, came 0.8; chunk 2 due 1.1, came 1.0
    # a pausing player: 0.5 s of silence before chunk 1, then 1.5 s more before chunk 2 -> 2.0 s
    late, stall = underruns([0.0, 1.0, 3.0], [0.5, 0.5, 0.5])
    assert late == 2 and stall == pytest.approx(2.0)


def test_underruns_depend_on_audio_before_not_on_the_first_latency():
    assert underruns([5.0, 5.9, 6.7], [1.0, 1.0, 1.0]) == (0, 0.0)
    late, stall = underruns([5.0, 5.9, 7.5], [1.0, 0.2, 1.0])  # chunk 2 due 6.2
    assert late == 1 and stall == pytest.approx(1.3)


def test_underruns_edge_cases():
    assert underruns([], []) == (0, 0.0)
    assert underruns([3.0], [0.1]) == (0, 0.0)
    assert underruns([0.0, 0.5], [0.5, 0.5]) == (0, 0.0)  # exactly on time is not late
    with pytest.raises(ValueError):
        underruns([0.0, 1.0], [0.5])


# -- aggregation -------------------------------------------------------------------------------

def test_summarize_percentiles_and_missing_values():
    s = bench.summarize([None, *range(1, 101)])
    assert s["n"] == 100 and s["avg"] == pytest.approx(50.5) and s["min"] == 1 and s["max"] == 100
    assert s["p50"] == pytest.approx(50.5) and s["p99"] == pytest.approx(99.01)
    empty = bench.summarize([None])
    assert empty["n"] == 0 and empty["p50"] is None


def _result(i, arrivals, durations, error=None):
    return RequestResult(index=i, seed=i, start_s=0.0, total_s=arrivals[-1] if arrivals else 1.0,
                         arrivals_s=list(arrivals), chunk_audio_s=list(durations), error=error)


def test_summarize_level_aggregates():
    results = [_result(0, [0.2, 0.5, 1.0], [0.4, 0.6, 1.0]),
               _result(1, [0.4, 1.5], [0.4, 1.6]),  # chunk 1 due 0.8, came 1.5
               _result(2, [], [], error="RuntimeError: boom")]
    lv = bench.summarize_level(2, results, wall_s=2.0)
    assert (lv["requests"], lv["ok"], lv["errors"]) == (3, 2, 1)
    assert lv["audio_s"] == pytest.approx(4.0)
    assert lv["rtf"] == pytest.approx(0.5) and lv["audio_s_per_s"] == pytest.approx(2.0)
    assert lv["first_chunk_s"]["n"] == 2 and lv["first_chunk_s"]["avg"] == pytest.approx(0.3)
    assert lv["second_chunk_s"]["max"] == pytest.approx(1.1)
    assert lv["underruns"]["late_chunks"] == 1 and lv["underruns"]["requests_with_underruns"] == 1
    assert lv["underruns"]["stall_s"]["max"] == pytest.approx(0.7)
    assert lv["rtf_per_request"]["avg"] == pytest.approx((1.0 / 2.0 + 1.5 / 2.0) / 2)
    assert lv["error_messages"] == ["RuntimeError: boom"]
    assert [d["index"] for d in lv["detail"]] == [0, 1, 2] and lv["detail"][1]["underruns"] == 1
    json.dumps(lv)


def test_requests_per_level():
    assert bench.requests_per_level([1, 4, 16], 8) == {1: 8, 4: 8, 16: 16}
    assert bench.requests_per_level([1, 2], [3, 5]) == {1: 3, 2: 5}
    assert bench.requests_per_level([1, 2], {1: 1, 2: 9}) == {1: 1, 2: 9}
    with pytest.raises(ValueError):
        bench.requests_per_level([1, 2], [3])
    assert bench.parse_int_list("1, 2,4") == [1, 2, 4]
    with pytest.raises(ValueError):
        bench.parse_int_list("1,x")


# -- the closed loop on a fake target ------------------------------------------------------------

class FakeTarget:
    """Three chunks of 0.1 s audio, 10 ms apart; counts requests in flight."""
    name = "fake"

    def __init__(self, fail_seed=None):
        self.in_flight = 0
        self.max_in_flight = 0
        self.seeds = []
        self.fail_seed = fail_seed

    async def stream(self, workload, seed):
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        self.seeds.append(seed)
        try:
            for _ in range(3):
                await asyncio.sleep(0.01)
                if seed == self.fail_seed:
                    raise RuntimeError("synthetic failure")
                yield 0.1
            yield 0.0  # an empty end marker is not a chunk
        finally:
            self.in_flight -= 1


def test_run_level_is_a_closed_loop_at_the_given_concurrency():
    target = FakeTarget(fail_seed=7)
    lv = asyncio.run(bench.run_level(target, bench.Workload(seed=5), concurrency=3, requests=7))
    assert target.max_in_flight == 3
    assert sorted(target.seeds) == list(range(5, 12))
    assert lv["requests"] == 7 and lv["errors"] == 1 and "synthetic failure" in lv["error_messages"][0]
    ok = [d for d in lv["detail"] if d["ok"]]
    assert all(d["chunks"] == 3 and d["audio_s"] == pytest.approx(0.3) for d in ok)
    assert all(0 < d["first_chunk_s"] <= d["total_s"] for d in ok)
    assert lv["underruns"]["late_chunks"] == 0
    # a level always runs at least `concurrency` requests
    lv = asyncio.run(bench.run_level(FakeTarget(), bench.Workload(), concurrency=4, requests=1))
    assert lv["requests"] == 4


def test_run_level_stops_sending_after_max_seconds():
    lv = asyncio.run(bench.run_level(FakeTarget(), bench.Workload(), concurrency=1, requests=1000, max_seconds=0.1))
    assert 1 <= lv["requests"] < 1000 and lv["stopped_early"]["planned"] == 1000


def test_stage_timer_wraps_and_restores():
    class Runner:
        def step(self, plan):
            return plan * 2

    r = Runner()
    timer = bench.StageTimer()
    assert timer.wrap("s", r, "step", items=lambda plan: plan)
    assert not timer.wrap("missing", r, "nope")
    before = timer.snapshot()
    assert r.step(3) == 6 and r.step(4) == 8
    d = bench.StageTimer.delta(before, timer.snapshot(), wall_s=1.0)
    assert d["s"]["calls"] == 2 and d["s"]["items"] == 7 and d["s"]["busy_s"] >= 0
    timer.close()
    assert "step" not in vars(r)


def test_synthetic_prompt_is_deterministic_and_bounded():
    a, b = bench.synthetic_prompt(2.0, seed=3), bench.synthetic_prompt(2.0, seed=3)
    assert a.sample_rate == 16000 and a.samples.shape == (32000,) and a.samples.dtype == np.float32
    assert np.array_equal(a.samples, b.samples) and 0.1 < np.abs(a.samples).max() <= 0.5


def test_plots_are_skipped_without_matplotlib(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert bench.write_plots({"levels": []}, tmp_path) == []
    assert "matplotlib is not installed" in capsys.readouterr().err


# -- real runs on the tiny fixture (slow) --------------------------------------------------------

TOKENS = 20


@pytest.mark.slow
def test_cli_bench_in_process_sweep_and_t2w_compare(tiny_dir, tmp_path, capsys):
    from cosyvoice_cli.cli import main

    out = tmp_path / "r.json"
    rc = main(["bench", "--in-process", "--model-dir", str(tiny_dir), "--concurrency", "1,2", "--requests", "2",
               "--tokens", str(TOKENS), "--prompt-seconds", "1", "--t2w-compare", "2", "--t2w-tokens", str(TOKENS),
               "--no-warmup", "--out", str(out), "--quiet"])
    assert rc == 0
    table = capsys.readouterr().out
    assert "conc" in table and "token2wav alone" in table
    r = json.loads(out.read_text())
    assert r["meta"]["mode"] == "in-process" and r["meta"]["prompt_tokens"] == 25
    assert [lv["concurrency"] for lv in r["levels"]] == [1, 2]
    for lv in r["levels"]:
        for key in ("first_chunk_s", "second_chunk_s", "total_s", "rtf_per_request"):
            assert set(lv[key]) >= {"avg", "p50", "p90", "p95", "p99"}
        assert lv["errors"] == 0 and lv["requests"] == 2
        assert lv["rtf"] > 0 and lv["audio_s_per_s"] > 0
        assert lv["audio_s"] == pytest.approx(lv["requests"] * TOKENS * bench.SECONDS_PER_TOKEN)
        assert isinstance(lv["underruns"]["late_chunks"], int)
        assert lv["stages"]["token2wav_batch"]["calls"] > 0 and lv["stages"]["llm_step"]["calls"] > 0
        for d in lv["detail"]:
            assert d["ok"] and 0 < d["first_chunk_s"] <= d["total_s"]
            assert d["audio_s"] == pytest.approx(TOKENS * bench.SECONDS_PER_TOKEN)
            assert d["chunks"] >= 2 and d["second_chunk_s"] > 0  # streamed: 15-token first chunk + the rest
            assert isinstance(d["underruns"], int) and d["underruns"] >= 0
    cmp = r["t2w_compare"]
    for mode in ("batched", "sequential"):
        assert cmp[mode]["audio_s"] == pytest.approx(2 * TOKENS * bench.SECONDS_PER_TOKEN)
        assert cmp[mode]["audio_s_per_s"] > 0
    assert cmp["speedup"] > 0 and cmp["batched"]["batcher"].get("max_batch_seen", 2) <= 2
    assert cmp["sequential"]["batcher"].get("max_batch_seen", 1) == 1
    for name in ("r-latency.png", "r-throughput.png", "r-t2w.png"):
        assert (tmp_path / name).stat().st_size > 1000


@pytest.mark.slow
def test_bench_over_grpc(tiny_dir, tmp_path):
    from async_cosyvoice.config import Config
    from grpc_async.server import ServerThread

    cfg = Config.model_validate({"model": {"dir": str(tiny_dir)}, "speakers": {"dir": str(tmp_path / "spk")},
                                 "server": {"port": 0}})
    with ServerThread(cfg, ready_timeout=900) as st:
        speaker = bench.SpeakerSpec(prompt_seconds=1.0)
        r = asyncio.run(bench.bench_grpc(st.target, bench.Workload(text="Hello there.", tokens=20), [1], 2,
                                         speaker=speaker, warmup=False))
    (lv,) = r["levels"]
    assert lv["audio_s"] == pytest.approx(2 * 20 * 0.04)  # the forced token count travelled over gRPC
    assert r["meta"]["mode"] == "grpc" and lv["errors"] == 0 and lv["requests"] == 2
    assert lv["audio_s"] > 0 and 0 < lv["first_chunk_s"]["p50"] <= lv["total_s"]["p50"]
    # the same seeds give the same workload
    assert lv["detail"][0]["audio_s"] > 0 and lv["detail"][0]["seed"] == 0


@pytest.mark.slow
def test_h200_script_quick_on_cpu(tmp_path):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "h200_bench.py"
    spec = importlib.util.spec_from_file_location("h200_bench", path)
    h200 = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(h200)
    assert h200.main(["--device", "cpu", "--preset", "tiny", "--quick", "--out", str(tmp_path)]) == 0
    r = json.loads((tmp_path / "h200_results.json").read_text())
    assert [lv["concurrency"] for lv in r["levels"]] == [1, 2] and r["meta"]["prompt_tokens"] == 50
    assert r["offline"]["errors"] == 0 and not r["offline"]["stream"]
    assert r["offline"]["audio_s"] == pytest.approx(4 * 30 * bench.SECONDS_PER_TOKEN)
    assert r["t2w_compare"]["speedup"] > 0
    assert len(r["targets"]) == 6 and r["targets"][0]["value"] is not None
    assert "targets (issue 6)" in (tmp_path / "h200_table.txt").read_text()
    assert {"h200-latency.png", "h200-throughput.png", "h200-t2w.png"} <= {p.name for p in tmp_path.iterdir()}
