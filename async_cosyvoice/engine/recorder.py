"""An optional record of what the native engine feeds the LM and gets back, per request and step.

For parity checks against a plain reference loop (tests, or a real checkpoint against upstream)
and for debugging what a request was fed. Attaching one turns CUDA graphs off (a graph replay
cannot hand back the log-probs) and copies every sampled row's log-probs to the host: it is a
diagnostic, not for serving at load.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

from torch import Tensor

from ..models.llm import Table


@dataclass(frozen=True)
class StepRecord:
    step: int  # the recorder's own step count, from 0
    request_id: str
    start: int  # KV position of the first row
    rows: tuple[tuple[Table, int], ...]  # LM input rows fed at positions start, start + 1, ...
    logp: Tensor | None  # float32 log-probs [V] after the last row, before EOS/stop masking; None if
    token: int | None    # no token was taken (a segment chunk that is not its last); token: forced fill included


class StepRecorder:
    """Collects `StepRecord`s; written by the engine's step thread, read by anyone."""

    def __init__(self):
        self._lock = threading.Lock()
        self._records: list[StepRecord] = []
        self._steps = 0

    def next_step(self) -> int:
        with self._lock:
            self._steps += 1
            return self._steps - 1

    def add(self, records: list[StepRecord]) -> None:
        with self._lock:
            self._records.extend(records)

    def of(self, request_id: str) -> list[StepRecord]:
        with self._lock:
            return [r for r in self._records if r.request_id == request_id]

    def clear(self) -> None:
        with self._lock:
            self._records.clear()
