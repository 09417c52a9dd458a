"""Busy-time counters a device stage keeps about itself (the LM engine's steps, the token2wav
batches), read by Prometheus, the benchmark and logs. No one wraps a stage to time it.

A stage's device work runs in its own executor thread and ends by copying results to the CPU,
so the wall time of one call includes its device time. The stage measures each call in that
thread and adds it up on the event loop (`record`); readers on the loop see consistent values.
Stages may share a device, so busy fractions of different stages can add up to more than 1.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Callable, TypeVar

T = TypeVar("T")


@dataclass
class StageStats:
    """Cumulative since the stage was built."""
    name: str
    calls: int = 0        # steps / batches run
    items: int = 0        # rows / jobs in them
    busy_s: float = 0.0   # seconds the stage's device thread spent in its calls
    failed: int = 0       # calls that raised (their time is counted too)

    def record(self, seconds: float, items: int, ok: bool = True) -> None:
        self.calls += 1
        self.items += items
        self.busy_s += seconds
        self.failed += not ok

    def copy(self) -> "StageStats":
        return dataclasses.replace(self)

    def since(self, before: "StageStats | None", wall_s: float) -> dict:
        """What happened between `before` (a copy taken earlier; None: since the start) and now,
        over `wall_s` seconds of wall time, as JSON."""
        b = before or StageStats(self.name)
        calls, items, busy = self.calls - b.calls, self.items - b.items, self.busy_s - b.busy_s
        return {"calls": calls, "items": items, "busy_s": busy,
                "busy_fraction": busy / wall_s if wall_s > 0 else None,
                "ms_per_call": 1e3 * busy / calls if calls else None,
                "items_per_call": items / calls if calls else None,
                "failed": self.failed - b.failed}


def totals(stats: "list[StageStats]") -> "list[StageStats]":
    """One StageStats per stage name, summed (several devices or replicas run the same stage)."""
    out: dict[str, StageStats] = {}
    for st in stats:
        total = out.setdefault(st.name, StageStats(st.name))
        total.calls += st.calls
        total.items += st.items
        total.busy_s += st.busy_s
        total.failed += st.failed
    return list(out.values())


def timed_call(fn: Callable[..., T], *args) -> tuple[T | BaseException, float, bool]:
    """Run `fn(*args)` (in a stage's device thread); returns (result or the exception raised,
    seconds, ok). The caller records the time and re-raises."""
    t = time.perf_counter()
    try:
        return fn(*args), time.perf_counter() - t, True
    except Exception as e:  # noqa: BLE001 - handed back to the event loop, which re-raises it
        return e, time.perf_counter() - t, False
