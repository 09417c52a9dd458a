"""The benchmark client: metrics on hand-made arrival times, the closed loop on a fake target,
and (slow) a real in-process sweep + token2wav comparison on the tiny fixture, and the gRPC path."""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

import numpy as np
import pytest

from cosyvoice_cli import bench
from cosyvoice_cli.bench import RequestResult, underruns


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


# -- open-loop trials: at least min_requests ------------------------------------------------------

def test_a_low_rate_trial_gets_min_requests_arrivals():
    # 1 req/s for 8 s would be ~8 requests; with 40 the window is max(8, 40 / 1) = 40 s
    assert bench.arrival_window(1.0, 8.0, 40) == 40.0 and bench.arrival_window(8.0, 20.0, 40) == 20.0
    enough = bench.plan_arrivals(1.0, 8.0, seed=2, min_requests=40)  # this seed has >= 40 in the 40 s
    assert enough.duration_s == max(8.0, 40 / 1.0) and len(enough.times) >= 40
    assert list(enough.times) == bench.poisson_arrivals(1.0, 40.0, seed=2)  # the plain Poisson draw, all < 40 s
    short = bench.plan_arrivals(1.0, 8.0, seed=0, min_requests=40)  # fewer than 40 by 40 s: on to the 40th
    in_window = bench.poisson_arrivals(1.0, 40.0, seed=0)
    assert len(in_window) < 40 and len(short.times) == 40 and list(short.times[:len(in_window)]) == in_window
    assert short.duration_s == short.times[-1] > 40.0
    assert bench.plan_arrivals(1.0, 8.0, seed=0, min_requests=40) == short  # seeded: the same every run
    # a rate whose duration already holds N: the duration decides, as before the floor
    fast = bench.plan_arrivals(8.0, 20.0, seed=0, min_requests=40)
    assert fast.duration_s == 20.0 and list(fast.times) == bench.poisson_arrivals(8.0, 20.0, seed=0)
    assert len(fast.times) > 40
    assert list(bench.plan_arrivals(1.0, 8.0, seed=0, min_requests=0).times) == bench.poisson_arrivals(1.0, 8.0, 0)
    with pytest.raises(ValueError, match="min_requests >= 0"):
        bench.plan_arrivals(1.0, 8.0, seed=0, min_requests=-1)
    with pytest.raises(ValueError, match="must be > 0"):
        bench.plan_arrivals(0.0, 8.0, seed=0, min_requests=40)


def test_open_loop_level_records_its_real_duration_and_requests():
    target = FakeTarget()
    lv = asyncio.run(bench.run_open_loop(target, bench.Workload(seed=3), 100.0, 0.05, min_requests=20))
    plan = bench.plan_arrivals(100.0, 0.05, seed=3, min_requests=20)
    assert lv["duration_s"] == plan.duration_s >= max(0.05, 20 / 100.0)
    assert lv["requests"] == len(plan.times) == len(target.seeds) >= 20 and lv["min_requests"] == 20
    assert lv["achieved_rate"] == pytest.approx(lv["requests"] / plan.duration_s)
    row = bench.format_open_loop([lv]).splitlines()[2].split()
    assert row[:3] == [f"{100.0:.3g}", f"{plan.duration_s:.3g}", str(lv["requests"])]  # rate, secs, sent


def test_capacity_search_trials_have_min_requests_and_say_so():
    workload = bench.Workload(seed=1)
    cap = asyncio.run(bench.capacity_search(FakeTarget(), workload, start_rate=100.0, duration_s=0.05,
                                            min_requests=20, max_rate=200.0, stop_at=None))
    assert [t["rate"] for t in cap["trials"]] == [100.0, 200.0] and cap["capacity_rate"] == 200.0
    for t in cap["trials"]:
        plan = bench.plan_arrivals(t["rate"], 0.05, seed=1, min_requests=20)
        assert t["duration_s"] == plan.duration_s and t["requests"] == len(plan.times) >= 20
    assert cap["min_requests"] == 20 and cap["requests_at_capacity"] == cap["trials"][1]["requests"]
    assert cap["requests_at_first_failing"] is None
    assert f"200 requests/s (a trial of {cap['trials'][1]['requests']} requests)" in bench.format_capacity(cap)
    # every trial fails: the failing trial's requests are reported
    never = bench.CapacityCriteria(p99_first_chunk_s=1e-6)
    cap = asyncio.run(bench.capacity_search(FakeTarget(), workload, start_rate=200.0, duration_s=0.05,
                                            min_requests=20, max_trials=2, criteria=never))
    assert [t["rate"] for t in cap["trials"]] == [100.0, 200.0] and cap["first_failing_rate"] == 100.0
    assert cap["requests_at_first_failing"] == cap["trials"][0]["requests"] >= 20
    assert cap["capacity_rate"] is None and cap["requests_at_capacity"] is None
    assert f"lowest failing 100/s (a trial of {cap['trials'][0]['requests']} requests)" in bench.format_capacity(cap)


def test_capacity_budget_counts_the_trials_real_duration():
    """1 req/s, 8 s, 40 requests, seed 0: the trial runs to its 40th arrival at 46.3 s. A budget of
    86 s holds 2 x 8 s and 2 x the 40-s window but not 2 x 46.3 s: no trial may start."""
    plan = bench.plan_arrivals(1.0, 8.0, seed=0, min_requests=40)
    assert 2 * 40.0 < 86.0 < 2 * plan.duration_s
    target = FakeTarget()
    cap = asyncio.run(bench.capacity_search(target, bench.Workload(seed=0), start_rate=1.0, duration_s=8.0,
                                            min_requests=40, stop_at=time.monotonic() + 86.0))
    assert cap["stopped_early"] and cap["trials"] == [] and target.seeds == []
    assert bench.format_capacity(cap).endswith("not measured (no trial ran)")


def test_min_requests_on_the_command_lines():
    assert bench.non_negative_int("0") == 0 and bench.non_negative_int("40") == 40
    for bad in ("-1", "x"):
        with pytest.raises(argparse.ArgumentTypeError):
            bench.non_negative_int(bad)
    from cosyvoice_cli.bench.cli import open_loop_plan
    from cosyvoice_cli.cli import build_parser

    def plan(*extra):
        return open_loop_plan(build_parser().parse_args(["bench", "--target", "h:1", "--capacity", *extra]))

    assert plan().min_requests == bench.MIN_REQUESTS == 40 and plan("--min-requests", "7").min_requests == 7
    assert plan().to_json()["min_requests"] == 40
    with pytest.raises(SystemExit):
        plan("--min-requests", "-3")
    server_bench = _load_script("h200_server_bench")
    assert server_bench.parse_args([])[1]["min_requests"] == 40
    assert server_bench.parse_args(["--quick"])[1]["min_requests"] == server_bench.QUICK["min_requests"] < 40
    assert server_bench.parse_args(["--quick", "--min-requests", "9"])[1]["min_requests"] == 9
    with pytest.raises(SystemExit):
        server_bench.parse_args(["--min-requests", "-1"])


def test_stage_counters_from_prometheus_text():
    from grpc_async.metrics import Metrics
    from prometheus_client import generate_latest

    from async_cosyvoice.stage_stats import StageStats

    llm, t2w = StageStats("llm_step"), StageStats("token2wav_batch")
    metrics = Metrics()
    metrics.bind_stages(lambda: [llm, t2w])
    before = bench.parse_prometheus(generate_latest(metrics.registry).decode())
    assert before == {"llm_step": StageStats("llm_step"), "token2wav_batch": StageStats("token2wav_batch")}
    llm.record(0.25, 3)
    llm.record(0.5, 5, ok=False)
    t2w.record(1.5, 4)
    after = bench.parse_prometheus(generate_latest(metrics.registry).decode())
    assert after["llm_step"] == llm and after["token2wav_batch"] == t2w
    d = bench.stage_delta(before, after, wall_s=2.0)
    assert d["llm_step"] == {"calls": 2, "items": 8, "busy_s": 0.75, "busy_fraction": 0.375, "ms_per_call": 375.0,
                             "items_per_call": 4.0, "failed": 1}
    assert d["token2wav_batch"]["busy_fraction"] == 0.75 and d["token2wav_batch"]["items_per_call"] == 4.0

    # where first chunks' time went: a stage per part, its ms_per_call the part's mean
    from async_cosyvoice.request import FirstChunkParts
    for parts in (FirstChunkParts(0.05, 0.01, 0.04, 0.02), FirstChunkParts(0.07, 0.03, 0.06, 0.03)):
        metrics.record_request("Synthesize", "sft", "OK", True, "true", 0.5, 0.1, 1.0, 25, 2, parts)
    d = bench.stage_delta(after, bench.parse_prometheus(generate_latest(metrics.registry).decode()), wall_s=2.0)
    assert {p: (d[f"first_chunk_{p}"]["calls"], round(d[f"first_chunk_{p}"]["ms_per_call"], 6))
            for p in ("tokens", "wait", "t2w", "first_token")} == {"tokens": (2, 60.0), "wait": (2, 20.0),
                                                                   "t2w": (2, 50.0), "first_token": (2, 25.0)}
    table = bench.format_stages([{"concurrency": 1, "stages": d}])
    assert table.splitlines()[-1].split()[-4:] == ["60.0", "20.0", "50.0", "25.0"]


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


@pytest.fixture(scope="module")
def server(tiny_dir, tmp_path_factory):
    """A real server on 127.0.0.1 with the tiny model and its Prometheus endpoint."""
    from async_cosyvoice.config import Config
    from grpc_async.server import ServerThread

    cfg = Config.model_validate({"model": {"dir": str(tiny_dir)},
                                 "speakers": {"dir": str(tmp_path_factory.mktemp("spk"))},
                                 "server": {"port": 0, "metrics_port": 0}})
    with ServerThread(cfg, ready_timeout=900) as st:
        yield st


@pytest.mark.slow
def test_bench_over_grpc(server):
    speaker = bench.SpeakerSpec(prompt_seconds=1.0)
    r = asyncio.run(bench.bench_grpc(server.target, bench.Workload(text="Hello there.", tokens=20), [1], 2,
                                     speaker=speaker, warmup=False,
                                     metrics_url=f"127.0.0.1:{server.server.metrics_port}"))
    (lv,) = r["levels"]
    # the server's own stage counters, read over its Prometheus endpoint
    assert lv["stages"]["llm_step"]["calls"] >= 20 and lv["stages"]["token2wav_batch"]["items"] >= 2 * 2
    assert 0 < lv["stages"]["token2wav_batch"]["busy_s"] <= lv["wall_s"]
    assert lv["audio_s"] == pytest.approx(2 * 20 * 0.04)  # the forced token count travelled over gRPC
    assert r["meta"]["mode"] == "grpc" and lv["errors"] == 0 and lv["requests"] == 2
    assert lv["audio_s"] > 0 and 0 < lv["first_chunk_s"]["p50"] <= lv["total_s"]["p50"]
    # the same seeds give the same workload
    assert lv["detail"][0]["audio_s"] > 0 and lv["detail"][0]["seed"] == 0


def _check_open_level(lv, rate, duration, seed, min_requests):
    plan = bench.plan_arrivals(rate, duration, seed, min_requests)
    arrivals = list(plan.times)
    assert lv["mode"] == "open_loop" and lv["rate"] == rate and lv["duration_s"] == plan.duration_s
    assert plan.duration_s >= max(duration, min_requests / rate) and lv["min_requests"] == min_requests
    assert lv["requests"] == len(arrivals) == len(lv["detail"]) >= min_requests
    assert lv["ok"] + lv["errors"] == lv["requests"]
    assert lv["achieved_rate"] == pytest.approx(len(arrivals) / plan.duration_s)
    # sent at their arrival times (never early), in order
    starts = [d["start_s"] for d in lv["detail"]]
    assert all(s >= a - 1e-3 for s, a in zip(starts, arrivals)) and starts == sorted(starts)
    for key in ("first_chunk_s", "total_s"):
        q = lv[key]
        assert q["n"] == lv["ok"]
        assert q["min"] <= q["p50"] <= q["p90"] <= q["p95"] <= q["p99"] <= q["max"]
    assert lv["first_chunk_s"]["max"] <= lv["total_s"]["max"]
    assert 1 <= lv["in_flight"]["max"] <= lv["requests"] and 0 < lv["in_flight"]["mean"] <= lv["in_flight"]["max"]
    late = [d["underruns"] for d in lv["detail"]]
    assert lv["underruns"]["late_chunks"] == sum(late)
    assert lv["underruns"]["requests_with_underruns"] == sum(1 for n in late if n)
    clean = sum(1 for d in lv["detail"] if d["ok"] and d["underruns"] == 0)
    assert lv["underrun_free_fraction"] == pytest.approx(clean / lv["requests"])
    assert lv["stages"]["token2wav_batch"]["items"] >= lv["ok"]


@pytest.mark.slow
def test_open_loop_and_capacity_over_grpc(server, tmp_path, capsys):
    from cosyvoice_cli.cli import main

    out = tmp_path / "open.json"
    rc = main(["bench", "--target", server.target, "--metrics", f"127.0.0.1:{server.server.metrics_port}",
               "--open-loop", "--rate", "2", "--duration", "3", "--min-requests", "8", "--tokens", "20",
               "--text", "Hello there.",
               "--prompt-seconds", "1", "--seed", "3", "--no-warmup", "--out", str(out), "--quiet", "--no-plots"])
    assert rc == 0
    assert "open loop (Poisson arrivals)" in capsys.readouterr().out
    r = json.loads(out.read_text())
    assert r["levels"] == [] and r["meta"]["open_loop"]["rates"] == [2.0]
    assert r["meta"]["open_loop"]["min_requests"] == 8
    (lv,) = r["open_loop"]
    assert lv["errors"] == 0
    _check_open_level(lv, 2.0, 3.0, seed=3, min_requests=8)  # 8 requests at 2/s: >= 4 s of arrivals

    # a capacity search with criteria every level meets: doubles from 1/s up to the 2/s ceiling
    from grpc_async.client import CosyVoiceClient

    async def search():  # the speaker "bench" is registered on the server by the run above
        async with CosyVoiceClient(server.target) as client:
            return await bench.capacity_search(
                bench.GrpcTarget(client), bench.Workload(text="Hello there.", tokens=20, seed=5),
                start_rate=1.0, duration_s=2.0, min_requests=3, max_rate=2.0, detail=True,
                criteria=bench.CapacityCriteria(p99_first_chunk_s=60.0, min_underrun_free=0.0),
                stages=bench.PrometheusStages(f"127.0.0.1:{server.server.metrics_port}"))
    cap = asyncio.run(search())
    assert [t["rate"] for t in cap["trials"]] == [1.0, 2.0] and cap["capacity_rate"] == 2.0
    assert cap["first_failing_rate"] is None and cap["streams_in_flight"] == cap["trials"][1]["in_flight"]
    assert cap["bracket"] == [2.0, None] and cap["converged"] is False  # capacity >= the ceiling: no bracket
    assert cap["requests_at_capacity"] == cap["trials"][1]["requests"] and cap["requests_at_first_failing"] is None
    for t in cap["trials"]:  # 1/s: 3 requests need >= 3 s; 2/s: 2 s
        assert t["capacity_check"] == {"passed": True, "reasons": []}
        _check_open_level(t, t["rate"], 2.0, seed=5, min_requests=3)
    assert "capacity (" in bench.format_capacity(cap)


def test_capacity_criteria_reasons():
    ok = [_result(i, [0.1, 0.5], [0.5, 0.5]) for i in range(99)]
    late = _result(99, [0.1, 0.9], [0.5, 0.5])
    lv = bench.summarize_level(3, ok + [late], wall_s=10.0)
    lv["underrun_free_fraction"] = 0.99
    crit = bench.CapacityCriteria(p99_first_chunk_s=0.3, min_underrun_free=0.99)
    assert crit.check(lv) == (True, [])
    lv["underrun_free_fraction"] = 0.98
    passed, why = crit.check(lv)
    assert not passed and why == ["underrun-free 98.0% < 99.0%"]
    slow = bench.summarize_level(3, [_result(i, [0.1 + i / 10, 2.0], [0.5, 0.5]) for i in range(10)], wall_s=10.0)
    slow["underrun_free_fraction"] = 1.0
    passed, why = crit.check(slow)
    assert not passed and why[0].startswith("first chunk p99 ") and why[0].endswith(" ms > 300 ms")
    assert bench.poisson_arrivals(4.0, 100.0, seed=1) == bench.poisson_arrivals(4.0, 100.0, seed=1)
    assert len(bench.poisson_arrivals(4.0, 100.0, seed=1)) == pytest.approx(400, rel=0.15)


def _load_script(name: str):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    script = importlib.util.module_from_spec(spec)
    sys.modules[name] = script  # a dataclass looks its module up while the module executes
    spec.loader.exec_module(script)
    return script


@pytest.mark.slow
def test_h200_script_quick_on_cpu(tmp_path):
    h200 = _load_script("h200_bench")
    assert h200.main(["--device", "cpu", "--preset", "tiny", "--quick", "--out", str(tmp_path)]) == 0
    r = json.loads((tmp_path / "h200_results.json").read_text())
    assert [lv["concurrency"] for lv in r["levels"]] == [1, 2] and r["meta"]["prompt_tokens"] == 50
    assert r["offline"]["errors"] == 0 and not r["offline"]["stream"]
    assert r["offline"]["audio_s"] == pytest.approx(4 * 30 * bench.SECONDS_PER_TOKEN)
    assert r["t2w_compare"]["speedup"] > 0
    assert len(r["targets"]) == 6 and r["targets"][0]["value"] is not None
    assert "targets (issue 6)" in (tmp_path / "h200_table.txt").read_text()
    assert {"h200-latency.png", "h200-throughput.png", "h200-t2w.png"} <= {p.name for p in tmp_path.iterdir()}


@pytest.mark.slow
def test_h200_server_script_quick_on_cpu(tmp_path):
    """The through-the-server script end to end on the tiny model: a real server child process."""
    script = _load_script("h200_server_bench")
    assert script.main(["--quick", "--skip", "capacity", "--out", str(tmp_path)]) == 0
    r = json.loads((tmp_path / "server_results.json").read_text())
    assert [lv["concurrency"] for lv in r["levels"]] == [1, 2] and r["skipped"] == ["capacity"]
    assert r["first_request"]["errors"] == 0 and r["meta"]["server_returncode"] is not None
    for lv in r["levels"]:
        assert lv["errors"] == 0 and lv["audio_s"] == pytest.approx(lv["requests"] * 20 * bench.SECONDS_PER_TOKEN)
        assert lv["stages"]["token2wav_batch"]["calls"] > 0  # the server's counters, over Prometheus
        assert lv["stages"]["first_chunk_t2w"]["calls"] > 0 and lv["stages"]["first_chunk_t2w"]["ms_per_call"] > 0
    assert r["meta"]["phases"]["server_start_s"] > 0 and len(r["summary"]) == 10
    # before each timed level, the wait for the server's pending CUDA graph captures (a CPU has none)
    assert [s["before"] for s in r["graph_settle"]] == ["sweep 1", "sweep 2"] and r["meta"]["plan"]["settle_s"] == 180
    assert all(s["settled"] and s["wanted"] == s["captured"] == 0 and s["bound_s"] > 0 for s in r["graph_settle"])
    # the second start of the same server: its own time to SERVING, its first request and warm ones
    assert r["restart"]["start_s"] > 0 and r["restart"]["first_request"]["errors"] == 0
    assert r["restart"]["warm"]["errors"] == 0 and r["restart"]["warm"]["requests"] == 3
    # both starts' phase tables, as the server reported them (GetServerInfo.startup)
    for start in (r["startup"], r["restart"]["startup"]):
        assert list(start["phases_s"]) == ["load weights", "compile", "capture", "warm-up requests",
                                           "save compile cache"]
        assert start["phases_s"]["load weights"] > 0 and 0 < start["server_s"] <= start["spawn_to_serving_s"]
        assert start["compile_cache"] == "off"  # CPU: nothing compiled
    table = (tmp_path / "server_table.txt").read_text()
    assert "through the gRPC server:" in table and "start-up (seconds):" in table and "warm-up requests" in table
    # where the first requests' first chunks went, as the server counted them
    assert r["restart"]["first_request"]["stages"]["first_chunk_t2w"]["calls"] == 1
    assert "first request after the restart" in table
    assert {"server-latency.png", "server-first_chunk_hist.png"} <= {p.name for p in tmp_path.iterdir()}


def test_the_server_bench_keeps_the_logs_error_lines():
    """A level's failed requests leave only a count in the results: the cause is kept from the log."""
    script = _load_script("h200_server_bench")
    log = ["2026-11-27 21:20:33,842 INFO async_cosyvoice.graph_buckets: capturing the HiFT CUDA graph",
           "2026-11-27 21:20:35,001 ERROR async_cosyvoice.token2wav.batcher: token2wav batch of 64 failed",
           "Traceback (most recent call last):",
           '  File "runner.py", line 1, in run_many',
           "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB",
           "2026-11-27 21:20:36,000 INFO grpc_async.server: request done"]
    assert script.error_lines(log) == [f"{i + 1}: {log[i]}" for i in (1, 2, 3, 4, 5)]
    assert script.error_lines(log[:1]) == [] and len(script.error_lines(log[1:2] * 500)) == 300


@pytest.mark.slow
def test_h200_server_script_quick_on_cpu_cosyvoice3(tmp_path):
    """--preset cosyvoice3-0.5b --quick runs CosyVoice3's tiny twin through a real server: the speaker
    registered from a prompt, forced tokens (no stop id among CosyVoice3's >= 6562) to their count."""
    script = _load_script("h200_server_bench")
    assert script.main(["--quick", "--preset", "cosyvoice3-0.5b", "--skip", "capacity,restart",
                        "--out", str(tmp_path)]) == 0
    r = json.loads((tmp_path / "server_results.json").read_text())
    assert r["meta"]["model_kind"] == "cosyvoice3" and r["meta"]["preset"] == "cosyvoice3-tiny"
    assert r["title"].startswith("async_cosyvoice (cosyvoice3)") and r["meta"]["prompt_seconds"] > 0
    assert r["meta"]["plan"]["warmup_tokens"] is None  # its warm-up runs the workload's full length
    assert r["first_request"]["errors"] == 0 and r["skipped"] == ["capacity", "restart"]
    for lv in r["levels"]:
        assert lv["errors"] == 0 and lv["audio_s"] == pytest.approx(lv["requests"] * 20 * bench.SECONDS_PER_TOKEN)


@pytest.fixture
def multi_gpu(monkeypatch):
    """benchmarks/multi_gpu_server_bench.py; the NVLink-multicast variables it sets are undone afterwards."""
    script = _load_script("multi_gpu_server_bench")
    for key in script.NVLS_OFF:
        monkeypatch.setenv(key, "unset-by-the-test")
        monkeypatch.delenv(key)
    return script


@pytest.mark.slow
def test_multi_gpu_server_script_quick_on_cpu(multi_gpu, tmp_path):
    """Every other placement through a real server child process, in one invocation: one device,
    then two CPU devices as LLM + token2wav process and as in-process replicas (worker processes:
    test_multi_gpu_server_script_rounds_on_cpu)."""
    assert multi_gpu.main(["--quick", "--setups", "one,disaggregated:2,replicas:2", "--skip", "warmup,capacity",
                           "--out", str(tmp_path)]) == 0
    table = (tmp_path / "multi_gpu_table.txt").read_text()
    setups = (("one", [], "workers", False),
              ("disaggregated-2", ["cpu", "cpu"], "disaggregated", True),
              ("replicas-2", ["cpu", "cpu"], "replicas", False))
    for name, devices, placement, t2w_process in setups:
        r = json.loads((tmp_path / f"setup-{name}.json").read_text())
        config = r["meta"]["config"]
        assert (config["model"]["devices"], config["model"]["placement"]) == (devices, placement)
        assert config["token2wav"]["process"] is t2w_process
        assert config["limits"]["max_concurrent_streams"] == 256
        assert r["meta"]["multicast_env"] == multi_gpu.NVLS_OFF and r["skipped"] == ["warmup", "capacity"]
        assert r["meta"]["phases"]["server_start_s"] > 0 and r["meta"]["server_returncode"] is not None
        assert [lv["concurrency"] for lv in r["levels"]] == [1, 2]
        for lv in r["levels"]:
            assert lv["errors"] == 0 and lv["first_chunk_s"]["p50"] > 0
        assert [(s["before"], s["settled"]) for s in r["graph_settle"]] == [("sweep 1", True), ("sweep 2", True)]
        assert name in table and name in (tmp_path / "multi_gpu_table.md").read_text()
    combined = json.loads((tmp_path / "multi_gpu_results.json").read_text())
    assert [(s["setup"], s["gpus"]) for s in combined["setups"]] == [
        ("one", 1), ("disaggregated-2", 2), ("replicas-2", 2)]
    assert combined["setups"][0]["throughput_vs_one"] == pytest.approx(1.0)
    assert (tmp_path / "multi_gpu_scaling.png").stat().st_size > 0
    assert len(list(tmp_path.iterdir())) == 7  # 3 setups + results, 2 tables, the plot


@pytest.mark.slow
def test_multi_gpu_server_script_rounds_on_cpu(multi_gpu, tmp_path):
    """--quick's default: a round of two one-device servers AT THE SAME TIME (their own processes,
    ports and clients), then 2 worker processes; every setup with a bounded capacity search."""
    assert multi_gpu.main(["--quick", "--out", str(tmp_path)]) in (0, 1)
    runs = {n: json.loads((tmp_path / f"setup-{n}.json").read_text()) for n in ("one", "one-at1", "workers-2")}
    ports = []
    for name, r in runs.items():
        meta, config = r["meta"], r["meta"]["config"]
        assert not r.get("phase_errors"), r.get("phase_errors")
        assert meta["round"] == (2 if name == "workers-2" else 1)
        assert meta["concurrent_with"] == {"one": ["one-at1"], "one-at1": ["one"], "workers-2": []}[name]
        assert (config["server"]["port"], config["server"]["metrics_port"]) == (meta["ports"]["grpc"],
                                                                              meta["ports"]["metrics"])
        assert config["server"]["http_port"] is None
        ports += meta["ports"].values()
        assert [lv["concurrency"] for lv in r["levels"]] == [1, 2] and all(lv["errors"] == 0 for lv in r["levels"])
        # the warm-up runs by default, and every timed phase waits for the server's graphs first
        assert "warmup" not in r["skipped"] and meta["phases"]["warmup_s"] > 0
        cap = r["capacity"]
        trial_rates = [f"capacity {lv['rate']:g}/s" for lv in sorted(cap["trials"], key=lambda lv: lv["rate"])]
        assert [s["before"] for s in r["graph_settle"]][:2] == ["sweep 1", "sweep 2"]
        assert sorted(s["before"] for s in r["graph_settle"][2:]) == sorted(trial_rates)  # before every trial
        assert all(s["settled"] for s in r["graph_settle"])
        assert isinstance(cap["converged"], bool) and 1 <= len(cap["trials"]) <= 3 and cap["within"] == 1.25
        best, worst = cap["bracket"]
        assert (best, worst) == (cap["capacity_rate"], cap["first_failing_rate"])
        assert cap["converged"] == (best is not None and worst is not None and worst <= 1.25 * best)
        assert cap["trials"][0]["rate"] <= 1.0 * meta["gpus"]  # starts from --rate-per-gpu x GPUs (or below)
    assert len(set(ports)) == len(ports) == 6
    assert runs["one-at1"]["meta"]["spec"] == "one:1@1-1" and runs["workers-2"]["meta"]["config"]["model"]["devices"] \
        == ["cpu", "cpu"]
    combined = json.loads((tmp_path / "multi_gpu_results.json").read_text())
    rows = {r["setup"]: r for r in combined["setups"]}
    assert set(rows) == {"one", "one-at1", "workers-2"}
    assert rows["one"]["round"] == 1 and rows["workers-2"]["concurrent_with"] == []
    assert all(isinstance(r["capacity_converged"], bool) for r in rows.values())
    assert rows["one"]["first_chunk_1_stream_vs_one"] == pytest.approx(1.0)
    assert any(n.startswith("round 1: one (cpu) and one-at1 (cpu) ran at the same time") for n in combined["notes"])
    assert len(list(tmp_path.iterdir())) == 7  # 3 setups + results, 2 tables, the plot: <= 8 files come back


def test_multi_gpu_notes_name_the_setups_that_ran_together():
    """Folders of separate invocations merged: each numbers its rounds from 1, so who ran together
    comes from each setup's own `concurrent_with`, not from equal round numbers."""
    script = _load_script("multi_gpu_server_bench")

    def row(name, round_, devices, concurrent_with):
        return {"setup": name, "round": round_, "devices": devices, "concurrent_with": concurrent_with,
                "host": "h", "gpu": "g", "time": "t", "skipped": [], "failed": [],
                "capacity_stopped_early": False, "capacity_converged": True}

    rows = [row("one", 1, ["cuda:0"], ["workers-2-at1"]), row("workers-2-at1", 1, ["cuda:1", "cuda:2"], ["one"]),
            row("workers-4", 2, ["cuda:0", "cuda:1"], []), row("disaggregated-4", 1, ["cuda:0", "cuda:1"], [])]
    together = [n for n in script.notes(rows, {}) if "ran at the same time" in n]
    assert together == [("round 1: one (cuda:0) and workers-2-at1 (cuda:1, cuda:2) ran at the same time "
                         "(own server, ports and client each; the host shared)")]


def test_multi_gpu_setups_parse():
    script = _load_script("multi_gpu_server_bench")
    Setup = script.Setup
    assert script.parse_setup("workers:4", 8) == Setup("workers", 4) and script.parse_setup("one", 8) == Setup("one", 1)
    assert script.parse_setup("disaggregated", 2) == Setup("disaggregated", 2)
    assert script.parse_setup("workers:2@1-2", 4) == Setup("workers", 2, 1)
    assert script.default_setups(4) == "one+workers:2,workers:4" and script.default_setups(2) == "one,workers:2"
    assert script.parse_rounds("one+workers:2,workers:4", 4) == [[Setup("one", 1, 0), Setup("workers", 2, 1)],
                                                                 [Setup("workers", 4, 0)]]
    (rnd,) = script.parse_rounds("workers:2+one@0", 4)  # explicit devices first, the rest packed after
    assert rnd == [Setup("workers", 2, 1), Setup("one", 1, 0)] and [s.name for s in rnd] == ["workers-2-at1", "one"]
    assert rnd[0].spec == "workers:2@1-2" and script.parse_setup(rnd[0].spec, 4) == rnd[0]
    with pytest.raises(ValueError, match="share devices"):
        script.parse_rounds("one@1+workers:2@1-2", 4)
    with pytest.raises(ValueError, match="no 4 free consecutive devices"):
        script.parse_rounds("one+workers:4", 4)
    with pytest.raises(ValueError, match="beyond the 4 seen"):
        script.parse_rounds("workers:2@3-4", 4)
    with pytest.raises(ValueError, match="named twice"):
        script.parse_rounds("one,one", 4)
    assert len(set(script.distinct_ports(8))) == 8
    plan = {"duration_s": 10.0, "levels": [1, 128], "max_level_seconds": 12.0, "start_rate": 4.0, "min_requests": 40}
    assert script.phase_reserve(plan) == {
        "sweep": 60.0, "capacity": 10.0, "sweep 128": 87.0}  # 1 stream before 4 capacity trials, 128 after
    # at 1 req/s a trial of 40 requests lasts 40 s, not 10: the reserve counts the trial's own length
    assert script.phase_reserve({**plan, "start_rate": 1.0}) == {"sweep": 180.0, "capacity": 40.0, "sweep 128": 207.0}
    with pytest.raises(ValueError, match="unknown placement"):
        script.parse_setup("sharded:2", 2)
    with pytest.raises(ValueError, match="at least 2 devices"):
        script.parse_setup("workers:1", 2)
    assert script.setup_sections("disaggregated", ["cuda:0", "cuda:1"])["token2wav"] == {"process": True}


def _setup_results(name: str, gpus: int, capacity: float | None, throughput: dict, start_s: float = 100.0,
                   requests: tuple[int, int] | None = None) -> dict:
    """A hand-made setup-<name>.json: capacity in requests/s, throughput {streams: audio s/s}; with
    `requests` (the deciding trials' requests) as a run with --min-requests 40 writes it, else as
    one from before that option."""
    levels = [{"concurrency": c, "requests": 2 * c, "errors": 0, "audio_s_per_s": aps,
               "first_chunk_s": {"p50": 0.1 * c, "p99": 0.2 * c},
               "underruns": {"late_chunks": c, "requests_with_underruns": c // 2}} for c, aps in throughput.items()]
    cap = {"capacity_rate": capacity, "first_failing_rate": 2 * (capacity or 0.125), "stopped_early": False,
           "streams_in_flight": capacity and {"mean": 10 * capacity, "max": 25}}
    plan = {"tokens": 250, "prompt_seconds": 6.0, "duration_s": 20.0}
    if requests:
        cap.update(requests_at_capacity=requests[0], requests_at_first_failing=requests[1], min_requests=40)
        plan["min_requests"] = 40
    return {"setup": name, "levels": levels, "capacity": cap, "skipped": [], "phase_errors": {},
            "meta": {"gpus": gpus, "devices": [f"cuda:{i}" for i in range(gpus)], "compile_cache_warm": False,
                     "phases": {"server_start_s": start_s}, "plan": plan,
                     "environment": {"gpu": "NVIDIA H100 80GB HBM3", "host": "h", "time": "t"}}}


def test_multi_gpu_merge_scaling_against_one_gpu(multi_gpu, tmp_path):
    a, b, out = tmp_path / "a", tmp_path / "b", tmp_path / "out"
    a.mkdir(), b.mkdir()
    bench.write_json(_setup_results("one", 1, 0.5, {1: 8.0, 32: 40.0, 64: 41.0}, requests=(41, 44)),
                     a / "setup-one.json")
    bench.write_json(_setup_results("replicas", 4, 2.0, {1: 8.0, 32: 100.0, 64: 150.0, 128: 160.0}),
                     b / "setup-replicas.json")
    bench.write_json(_setup_results("disaggregated", 4, None, {1: 7.0, 32: 60.0}), b / "setup-disaggregated.json")
    assert multi_gpu.main(["--merge", f"{a},{b}", "--out", str(out)]) == 0
    rows = {r["setup"]: r for r in json.loads((out / "multi_gpu_results.json").read_text())["setups"]}
    assert list(rows) == ["one", "disaggregated", "replicas"]  # by placement (workers first), then GPUs
    rep, dis, one = rows["replicas"], rows["disaggregated"], rows["one"]
    assert rep["capacity_vs_one"] == pytest.approx(4.0) and rep["capacity_rate_per_gpu"] == pytest.approx(0.5)
    assert rep["capacity_streams"] == pytest.approx(20.0) and rep["capacity_streams_per_gpu"] == pytest.approx(5.0)
    # throughput at the largest level both ran (64; one never ran 128)
    assert (rep["throughput_streams"], rep["throughput_vs_one"]) == (64, pytest.approx(150.0 / 41.0))
    assert (dis["throughput_streams"], dis["throughput_vs_one"]) == (32, pytest.approx(60.0 / 40.0))
    assert dis["capacity_vs_one"] is None and dis["capacity_streams_per_gpu"] is None
    assert one["capacity_vs_one"] == pytest.approx(1.0) and one["capacity_streams_per_gpu"] == pytest.approx(5.0)
    md = (out / "multi_gpu_table.md").read_text()
    assert "| replicas | - | 4 | 100 s (cold) | 100 ms (1.00x) | 2 (fails 4) | 20.0 | 5.00 | 4.00x | 150.0 (64) | 3.66x |" in md
    assert "| disaggregated | - | 4 | 100 s (cold) | 100 ms (1.00x) | < 0.25 | - | - | - | 60.0 (32) | 1.50x |" in md
    assert "| one | 64 | 6400 ms | 12800 ms | 64 (32 of 128) | 41.0 | 0 |" in md
    # the deciding trials' requests (a run with --min-requests); results from before it show none
    assert "| one | - | 1 | 100 s (cold) | 100 ms (1.00x) | 0.5 (fails 1) [41 / 44 requests] | 5.0 |" in md
    assert (one["capacity_requests"], one["first_failing_requests"]) == (41, 44)
    assert rep["capacity_requests"] is None and rep["first_failing_requests"] is None
    notes = json.loads((out / "multi_gpu_results.json").read_text())["notes"]
    assert "(trials of max(20 s, 40 requests / rate) of arrivals; [n / m requests]" in notes[0]
    assert notes[1].startswith("setups ran with different workloads: one: 250 tokens, trials of max(20 s, 40 "
                               "requests / rate) of arrivals; ") and "replicas: 250 tokens, 20-s trials" in notes[1]
    assert {p.name for p in out.iterdir()} == {"multi_gpu_results.json", "multi_gpu_table.txt", "multi_gpu_table.md",
                                             "multi_gpu_scaling.png"}
    # without one GPU in the folders there is nothing to scale against
    assert multi_gpu.main(["--merge", str(b), "--out", str(tmp_path / "alone")]) == 0
    alone = json.loads((tmp_path / "alone" / "multi_gpu_results.json").read_text())["setups"]
    assert [r["capacity_vs_one"] for r in alone] == [None, None]
