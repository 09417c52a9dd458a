"""HeapTrimmer: freed heap memory goes back to the OS, at most one trim at a time, not more often
than asked (async_cosyvoice.heap; the soak in benchmarks/soak.py measures the effect on a server)."""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from async_cosyvoice.heap import HeapTrimmer

REPO = Path(__file__).resolve().parents[1]


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


MMAP_PROBE = """
import ctypes, sys
import numpy as np
from async_cosyvoice.heap import fix_mmap_threshold

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
big = np.ones(8 << 17)  # 8 MiB, mmapped; freeing it raises glibc's dynamic threshold to 8 MiB
del big
fixed = fix_mmap_threshold(1 << 20) if sys.argv[1] == "fix" else False
before = libc.mallinfo2().hblks
two_mib = np.ones(2 << 17)
print(fixed, libc.mallinfo2().hblks - before)
"""


@pytest.mark.parametrize("how, expected", [("fix", "True 1"), ("default", "False 0")])
def test_fixed_mmap_threshold_keeps_big_buffers_out_of_the_arenas(how, expected):
    """After an 8 MiB buffer is freed, glibc serves a 2 MiB one from its arenas (where freed
    memory stays resident); with the threshold fixed at 1 MiB it gets its own mmap."""
    if HeapTrimmer(1).enabled is False:
        pytest.skip("libc has no malloc_trim (not glibc)")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, "-c", MMAP_PROBE, how], capture_output=True, text=True, env=env,
                         timeout=120, check=True).stdout.strip()
    assert out == expected
