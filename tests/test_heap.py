"""HeapTrimmer: freed heap memory goes back to the OS, at most one trim at a time, not more often
than asked (async_cosyvoice.heap; the soak in benchmarks/soak.py measures the effect on a server)."""
from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from async_cosyvoice.heap import HeapTrimmer


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def test_trim_hands_freed_heap_memory_back():
    trimmer = HeapTrimmer(min_interval=1e-9)
    if not trimmer.enabled:
        pytest.skip("libc has no malloc_trim (not glibc)")
    # 1,600 blocks of 64 KiB (below glibc's mmap threshold, so they live in the heap); keeping
    # every 16th pins the heap, so freeing the rest leaves ~94 MiB free but resident
    blocks = [np.ones(64 * 1024 // 8) for _ in range(1600)]
    kept = blocks[::16]
    del blocks
    before = rss_mib()
    time.sleep(0.01)

    async def trim():
        trimmer.stream_ended()
        await trimmer.close()
    asyncio.run(trim())
    assert trimmer.trims == 1
    assert before - rss_mib() > 60, (before, rss_mib())
    assert all(float(b[0]) == 1.0 for b in kept)


def test_at_most_one_trim_at_a_time_and_not_more_often_than_asked():
    trimmer = HeapTrimmer(min_interval=3600)
    if not trimmer.enabled:
        pytest.skip("libc has no malloc_trim (not glibc)")

    async def body():
        trimmer.stream_ended()  # the interval counts from start-up: not due yet
        assert trimmer._task is None
        trimmer._last -= 3601
        trimmer.stream_ended()
        first = trimmer._task
        trimmer.stream_ended()  # one is running: no second
        assert trimmer._task is first
        await trimmer.close()
        trimmer.stream_ended()  # just trimmed: not due
        assert trimmer._task is first
    asyncio.run(body())
    assert trimmer.trims == 1 and trimmer.seconds > 0


def test_off_when_interval_is_zero():
    trimmer = HeapTrimmer(min_interval=0)
    assert not trimmer.enabled
    trimmer.stream_ended()  # no loop needed: nothing happens
    assert trimmer.trims == 0
