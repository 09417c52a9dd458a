"""Stage timing (in-process): busy seconds of the engine's steps and the token2wav batches, added
up by wrapping those methods."""
from __future__ import annotations

import contextlib
import logging
import sys
import time
from typing import TYPE_CHECKING, Callable, Mapping

if TYPE_CHECKING:
    from ..tts import Synthesizer

log = logging.getLogger(__name__)


class StageTimer:
    """Wraps methods of model-facing objects (on the instance only) to add up their wall time.

    Each wrapped call runs in its stage's executor thread and ends by copying results to the
    CPU, so its wall time includes the device time. Stages share the device, so busy fractions
    of different stages may add up to more than 1."""

    def __init__(self):
        self.totals: dict[str, list[float]] = {}  # name -> [calls, seconds, items]
        self._restore: list[tuple[object, str]] = []

    def wrap(self, name: str, obj: object, method: str, items: Callable[..., int] | None = None) -> bool:
        fn = getattr(obj, method, None) if obj is not None else None
        if fn is None:
            return False
        acc = self.totals.setdefault(name, [0, 0.0, 0])

        # names the stage in a torch.profiler trace (next to nothing otherwise); torch is loaded
        # wherever there is a model to time
        record_function = sys.modules["torch"].profiler.record_function if "torch" in sys.modules \
            else contextlib.nullcontext

        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                with record_function(name):
                    return fn(*args, **kwargs)
            finally:
                acc[0] += 1
                acc[1] += time.perf_counter() - t
                if items is not None:
                    with contextlib.suppress(Exception):
                        acc[2] += int(items(*args, **kwargs))

        setattr(obj, method, timed)
        self._restore.append((obj, method))
        return True

    def snapshot(self) -> dict[str, tuple[int, float, int]]:
        return {k: (int(v[0]), float(v[1]), int(v[2])) for k, v in self.totals.items()}

    @staticmethod
    def delta(before: Mapping, after: Mapping, wall_s: float) -> dict:
        out = {}
        for name, (calls, secs, items) in after.items():
            c0, s0, i0 = before.get(name, (0, 0.0, 0))
            calls, secs, items = calls - c0, secs - s0, items - i0
            out[name] = {"calls": calls, "busy_s": secs, "busy_fraction": secs / wall_s if wall_s > 0 else None,
                         "ms_per_call": 1e3 * secs / calls if calls else None}
            if items:
                out[name]["items"] = items
                out[name]["items_per_call"] = items / calls if calls else None
        return out

    def close(self) -> None:
        for obj, method in reversed(self._restore):
            with contextlib.suppress(AttributeError):
                delattr(obj, method)
        self._restore.clear()


def time_synthesizer_stages(synth: "Synthesizer") -> StageTimer:
    """A StageTimer on the native engine's step and the token2wav runner (whatever exists)."""
    timer = StageTimer()
    if not timer.wrap("llm_step", getattr(synth.engine, "runner", None), "step"):
        log.info("stage timing: this engine has no runner.step; LLM busy time is not measured")
    t2w = getattr(synth.batcher, "runner", None)
    if not any(timer.wrap("token2wav_batch", t2w, name, items=lambda jobs, *a, **k: len(jobs))
               for name in ("run_many", "run_batch")):
        log.info("stage timing: the token2wav runner has no run_many; its busy time is not measured")
    return timer
