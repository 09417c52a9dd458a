"""Python's thread switch interval, shortened while background work holds the GIL for long.

Every thread of the server shares one GIL: the event loop, the LLM's step thread, the token2wav
device thread and, after SERVING, the capture thread. A CUDA graph capture is seconds of Python
(three runs of a compiled flow call, tens of thousands of launches) that gives the GIL up only
when the interpreter forces it, every `sys.getswitchinterval()` (5 ms by default). The LLM step
thread takes the GIL a few times per decode step, so beside a capture each step waited up to 5 ms
per take: on an H200 the first request after SERVING, beside the post-SERVING captures, needed
181 ms to its first tokens against 64 ms warm (docs/perf/h200-session13/). While a capture runs
the interval is `seconds` instead; the last holder out restores Python's own.
"""
from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator

__all__ = ["shortened_switch_interval"]

_lock = threading.Lock()
_holders: list[float] = []  # the intervals asked for by those inside, in entry order
_saved: float | None = None  # the process's own interval while anyone is inside


@contextlib.contextmanager
def shortened_switch_interval(seconds: float | None) -> Iterator[None]:
    """Inside: the switch interval is at most `seconds` (the smallest any holder asked for);
    None changes nothing. Process-wide, as the setting is; nests and overlaps across threads."""
    global _saved
    if seconds is None:
        yield
        return
    if seconds <= 0:
        raise ValueError(f"a switch interval must be > 0 seconds, got {seconds}")
    with _lock:
        if not _holders:
            _saved = sys.getswitchinterval()
        _holders.append(seconds)
        sys.setswitchinterval(min(min(_holders), _saved))
    try:
        yield
    finally:
        with _lock:
            _holders.remove(seconds)
            sys.setswitchinterval(min(_holders + [_saved]))
            if not _holders:
                _saved = None
