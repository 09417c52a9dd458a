"""The open loop: requests arrive as a Poisson process at a given rate, whatever the server's state
(users do not wait for each other), and the capacity search built on it.

A level at rate R for D seconds with at least N requests (`min_requests`) draws exponential
inter-arrival gaps (mean 1/R, seeded: the same arrival times every run) for max(D, N / R) seconds,
continued to the N-th arrival when fewer fell in that window, and sends request i at its time;
requests in flight are not limited. The floor is there because a p99 over ~10 requests is their
maximum: one slow request decides the level (at 1 req/s a 10-s level has ~10). The level's
`duration_s` is the seconds of arrivals it really had (its `requests` how many); stopping at the
N-th arrival keeps the process Poisson at R, where adding requests to the window would offer more
than R. After the arrivals no request is sent and the level waits for those in flight (at most
`drain_timeout_s`; a request still running then is cancelled and counted as an error). Per
request it records what the closed loop records (first chunk, chunk arrivals, underruns, stall);
the level adds the offered and achieved arrival rates, how many requests were in flight (time
average and maximum), and the fraction of requests that played without an underrun (a failed
request did not play: it counts against).

Capacity: the largest rate at which p99 first chunk <= `p99_first_chunk_s` and at least
`min_underrun_free` of the requests play without an underrun (and none fails). The search doubles
the rate from `start_rate` until a level fails (or `max_rate`; halving instead when `start_rate`
fails), then bisects between the last passing and the first failing rate `refine` times, all in at
most `max_trials` trials. With `within` (e.g. 1.25) it bisects geometrically and stops as soon as
failing / passing <= `within`: a start near the answer converges in 4 trials. It reports that rate,
the streams in flight there (mean and max): for 10-s requests, "N concurrent 10-s streams", the
bracket [largest passing, smallest failing] with `converged` (both ends found and, with
`within`, close enough), and how many requests the two deciding trials had.
"""
from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass
from typing import Awaitable, Callable, Sequence

import numpy as np

from .metrics import RequestResult, summarize_level
from .progress import Progress
from .runner import run_request
from .stages import StageCounters, stage_delta
from .targets import Target
from .workload import Workload

MIN_REQUESTS = 40  # per open-loop level: below ~40 requests a p99 is the maximum of a handful


def poisson_arrivals(rate: float, duration_s: float, seed: int, min_requests: int = 0) -> list[float]:
    """Arrival times of a Poisson process of `rate` per second: those in [0, duration_s), then on
    until there are `min_requests`."""
    if not rate > 0 or not duration_s > 0:
        raise ValueError(f"rate and duration must be > 0, got {rate} and {duration_s}")
    rng = np.random.default_rng(seed)
    times, t = [], 0.0
    while True:
        t += float(rng.exponential(1.0 / rate))
        if t >= duration_s and len(times) >= min_requests:
            return times
        times.append(t)


def arrival_window(rate: float, duration_s: float, min_requests: int) -> float:
    """Seconds of arrivals a level at `rate` plans for: max(duration_s, min_requests / rate)."""
    if not rate > 0 or not duration_s > 0 or min_requests < 0:
        raise ValueError(f"rate and duration must be > 0 and min_requests >= 0, got {rate}, {duration_s} "
                         f"and {min_requests}")
    return max(duration_s, min_requests / rate)


@dataclass(frozen=True)
class Arrivals:
    """One open-loop level's send times and the seconds of arrivals it has."""
    rate: float
    duration_s: float  # arrival_window, or the min_requests-th arrival when that came later
    min_requests: int
    times: Sequence[float]


def plan_arrivals(rate: float, duration_s: float, seed: int, min_requests: int = MIN_REQUESTS) -> Arrivals:
    """The arrivals of a level at `rate` for `duration_s` seconds with at least `min_requests`."""
    window = arrival_window(rate, duration_s, min_requests)
    times = poisson_arrivals(rate, window, seed, min_requests)
    end = max(window, times[-1]) if times else window
    return Arrivals(rate, end, min_requests, tuple(times))


class _InFlight:
    """Requests in flight over time: the maximum and the time average."""

    def __init__(self, t0: float):
        self.t0 = self.last = t0
        self.n = self.max = 0
        self.area = 0.0

    def change(self, delta: int) -> None:
        now = time.monotonic()
        self.area += self.n * (now - self.last)
        self.last = now
        self.n += delta
        self.max = max(self.max, self.n)

    def mean(self, until: float) -> float:
        span = until - self.t0
        return (self.area + self.n * (until - self.last)) / span if span > 0 else 0.0


async def run_open_loop(target: Target, workload: Workload, rate: float, duration_s: float, *,
                        min_requests: int = MIN_REQUESTS, progress: Progress | None = None,
                        stages: StageCounters | None = None, drain_timeout_s: float = 120.0,
                        detail: bool = True) -> dict:
    """One open-loop level at `rate` for `duration_s` seconds and at least `min_requests` requests;
    returns `summarize_level`'s dict plus the open-loop fields."""
    return await run_arrivals(target, workload, plan_arrivals(rate, duration_s, workload.seed, min_requests),
                              progress=progress, stages=stages, drain_timeout_s=drain_timeout_s, detail=detail)


async def run_arrivals(target: Target, workload: Workload, plan: Arrivals, *, progress: Progress | None = None,
                       stages: StageCounters | None = None, drain_timeout_s: float = 120.0,
                       detail: bool = True) -> dict:
    """The level `plan` describes (see run_open_loop)."""
    arrivals, rate, duration_s = plan.times, plan.rate, plan.duration_s
    results: list[RequestResult] = []
    if progress:
        progress.start(f"open loop {rate:g}/s x {duration_s:.3g} s", len(arrivals))
    before = await stages.read() if stages else None
    t0 = time.monotonic()
    flight = _InFlight(t0)

    async def one(i: int) -> None:
        flight.change(+1)
        try:
            r = await run_request(target, workload, i, t0)
        finally:
            flight.change(-1)
        results.append(r)
        if progress:
            progress.update(r)

    tasks: list[asyncio.Task] = []
    for i, at in enumerate(arrivals):
        delay = t0 + at - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(i)))
    sent_s = time.monotonic() - t0
    done, unfinished = await asyncio.wait(tasks, timeout=drain_timeout_s) if tasks else (set(), set())
    for task in unfinished:
        task.cancel()
    await asyncio.gather(*unfinished, return_exceptions=True)
    wall = time.monotonic() - t0
    sent = {r.index for r in results}
    for i in range(len(arrivals)):  # cancelled at the drain timeout
        if i not in sent:
            results.append(RequestResult(index=i, seed=workload.seed + i, start_s=arrivals[i], total_s=wall - arrivals[i],
                                         error=f"unfinished after the {drain_timeout_s:g} s drain"))
    results.sort(key=lambda r: r.index)
    busy = stage_delta(before, await stages.read(), wall) if stages else None
    level = summarize_level(flight.max, results, wall, stream=workload.stream, stages=busy, detail=detail)
    n = len(results)
    clean = sum(1 for r in results if r.ok and r.underrun_stats[0] == 0)
    level.update({
        "mode": "open_loop",
        "rate": rate,
        "duration_s": duration_s,
        "min_requests": plan.min_requests,
        "achieved_rate": n / duration_s,
        "send_span_s": sent_s,
        "in_flight": {"mean": flight.mean(t0 + wall), "max": flight.max},
        "underrun_free_fraction": clean / n if n else None,
    })
    if progress:
        f = level["first_chunk_s"]
        progress.end(f"first p99 {_ms(f['p99'])} ms  underrun-free {_pct(level['underrun_free_fraction'])}  "
                     f"in flight {level['in_flight']['mean']:.1f} (max {flight.max})")
    return level


@dataclass(frozen=True)
class CapacityCriteria:
    p99_first_chunk_s: float = 0.300
    min_underrun_free: float = 0.99

    def check(self, level: dict) -> tuple[bool, list[str]]:
        """(passes, reasons it does not)."""
        why = []
        if level["requests"] == 0:
            why.append("no request was sent (raise the duration or the rate)")
        if level["errors"]:
            why.append(f"{level['errors']} requests failed")
        p99 = level["first_chunk_s"]["p99"]
        if p99 is None or p99 > self.p99_first_chunk_s:
            why.append(f"first chunk p99 {_ms(p99)} ms > {1e3 * self.p99_first_chunk_s:g} ms")
        free = level["underrun_free_fraction"]
        if free is None or free < self.min_underrun_free:
            why.append(f"underrun-free {_pct(free)} < {_pct(self.min_underrun_free)}")
        return not why, why

    def to_json(self) -> dict:
        return {"p99_first_chunk_s": self.p99_first_chunk_s, "min_underrun_free": self.min_underrun_free}


async def capacity_search(target: Target, workload: Workload, *, start_rate: float, duration_s: float,
                          min_requests: int = MIN_REQUESTS, max_rate: float = math.inf, refine: int = 2,
                          within: float | None = None,
                          criteria: CapacityCriteria = CapacityCriteria(), progress: Progress | None = None,
                          stages: StageCounters | None = None, drain_timeout_s: float = 120.0,
                          max_trials: int = 12, detail: bool = False, stop_at: float | None = None,
                          before_trial: Callable[[float], Awaitable[None]] | None = None) -> dict:
    """The largest passing arrival rate (see the module docstring) and every trial run, each a level
    of `duration_s` seconds and at least `min_requests` requests. With `stop_at` (monotonic seconds)
    no trial starts that could not finish its arrivals (its own duration) and a drain as long again
    by then; `stopped_early` says so. `before_trial(rate)` is awaited before each trial (a server
    bench waits there for the CUDA graphs the last trial's calls wanted)."""
    if not start_rate > 0:
        raise ValueError(f"start_rate must be > 0, got {start_rate}")
    if within is not None and not within > 1:
        raise ValueError(f"within must be > 1, got {within}")
    trials: list[dict] = []
    stopped = False

    async def trial(rate: float) -> bool | None:
        nonlocal stopped
        plan = plan_arrivals(rate, duration_s, workload.seed, min_requests)
        if stop_at is not None and time.monotonic() + 2 * plan.duration_s > stop_at:
            stopped = True
            return None
        if before_trial is not None:
            await before_trial(rate)
        level = await run_arrivals(target, workload, plan, progress=progress, stages=stages,
                                   drain_timeout_s=drain_timeout_s, detail=detail)
        ok, why = criteria.check(level)
        level["capacity_check"] = {"passed": ok, "reasons": why}
        trials.append(level)
        return ok

    best, worst = None, None  # highest passing, lowest failing rate
    rate = min(start_rate, max_rate)
    while len(trials) < max_trials and not stopped:
        passed = await trial(rate)
        if passed:
            best = rate
            if rate >= max_rate:
                break
            rate = min(2 * rate, max_rate)
        elif passed is False:
            worst = rate
            break
    if best is None and worst is not None:  # even the start failed: halve down (a few times)
        rate = worst / 2
        while len(trials) < max_trials and best is None and not stopped and rate >= start_rate / 8:
            passed = await trial(rate)
            if passed:
                best = rate
            elif passed is False:
                worst, rate = rate, rate / 2
    def close_enough() -> bool:
        return best is not None and worst is not None and (within is None or worst <= within * best)

    for _ in range(refine):
        if best is None or worst is None or len(trials) >= max_trials or stopped:
            break
        if within is not None and close_enough():
            break
        mid = (best + worst) / 2 if within is None else math.sqrt(best * worst)
        passed = await trial(mid)
        if passed:
            best = mid
        elif passed is False:
            worst = mid
    at = next((lv for lv in trials if lv["rate"] == best), None)
    failing = next((lv for lv in trials if lv["rate"] == worst), None)
    return {
        "criteria": criteria.to_json(),
        "duration_s": duration_s,
        "min_requests": min_requests,
        "capacity_rate": best,
        "first_failing_rate": worst,
        "requests_at_capacity": at and at["requests"],
        "requests_at_first_failing": failing and failing["requests"],
        "streams_in_flight": at and at["in_flight"],
        "request_audio_s": at and at["audio_s_per_request"]["avg"],
        "trials": sorted(trials, key=lambda lv: lv["rate"]),
        "stopped_early": stopped,
        "bracket": [best, worst],
        "within": within,
        "converged": close_enough(),
    }


def format_open_loop(levels: list[dict]) -> str:
    head = (f"{'rate/s':>7} {'secs':>5} {'sent':>5} {'flight':>6} {'max':>4} {'first p50':>9} {'p90':>8} "
            f"{'p99':>8} {'late':>5} {'req late':>8} {'clean':>6} {'max stall':>9} {'err':>4} {'pass':>5}")
    lines = [head, "-" * len(head)]
    for lv in levels:
        f, u = lv["first_chunk_s"], lv["underruns"]
        check = lv.get("capacity_check")
        verdict = "" if check is None else ("yes" if check["passed"] else "no")
        lines.append(f"{lv['rate']:7.3g} {lv['duration_s']:5.3g} {lv['requests']:5d} "
                     f"{lv['in_flight']['mean']:6.1f} {lv['in_flight']['max']:4d} {_ms(f['p50']):>9} "
                     f"{_ms(f['p90']):>8} {_ms(f['p99']):>8} "
                     f"{u['late_chunks']:5d} {u['requests_with_underruns']:8d} "
                     f"{_pct(lv['underrun_free_fraction']):>6} {_ms(u['stall_s']['max']):>9} {lv['errors']:4d} "
                     f"{verdict:>5}")
    lines.append("open loop (Poisson arrivals); secs = seconds of arrivals, sent = requests; latencies in ms; "
                 "flight = requests in flight (time average); clean = requests that played without an underrun")
    return "\n".join(lines)


def format_capacity(cap: dict) -> str:
    c = cap["criteria"]
    rule = (f"p99 first chunk <= {1e3 * c['p99_first_chunk_s']:g} ms and >= {_pct(c['min_underrun_free'])} "
            f"of requests without an underrun")
    if cap["capacity_rate"] is None:
        if cap["first_failing_rate"] is None:
            return f"capacity ({rule}): not measured (no trial ran)"
        return (f"capacity ({rule}): not reached at any rate tried (lowest failing {cap['first_failing_rate']:g}/s"
                f"{_requests(cap.get('requests_at_first_failing'))})")
    fl = cap["streams_in_flight"]
    audio = cap["request_audio_s"]
    converged = {True: "converged", False: "not converged", None: ""}[cap.get("converged")]
    failing = "none tried"
    if cap["first_failing_rate"] is not None:
        failing = f"{cap['first_failing_rate']:.3g}/s" + _requests(cap.get("requests_at_first_failing"))
    return (f"capacity ({rule}): {cap['capacity_rate']:.3g} requests/s{_requests(cap.get('requests_at_capacity'))} "
            f"= {fl['mean']:.1f} concurrent streams (max {fl['max']}) of {audio:.1f} s audio; first failing rate "
            + failing + (f" ({converged})" if converged else ""))


def _requests(n: int | None) -> str:
    return "" if n is None else f" (a trial of {n} requests)"


def _ms(x: float | None) -> str:
    return f"{1e3 * x:.1f}" if x is not None else "-"


def _pct(x: float | None) -> str:
    return f"{100 * x:.1f}%" if x is not None else "-"
