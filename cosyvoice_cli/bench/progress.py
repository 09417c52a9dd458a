"""Progress on stderr while a sweep runs: the counts of a level on one `ProgressLine`."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np

from async_cosyvoice.progress import ProgressLine

if TYPE_CHECKING:
    from .metrics import RequestResult


class Progress:
    """One live line per level on a terminal, one line per finished level otherwise."""

    def __init__(self, stream=None, enabled: bool = True):
        self.line = ProgressLine(stream, enabled)
        self._label, self._total, self._done, self._errors, self._first = "", 0, 0, 0, []
        self._t0 = 0.0

    def start(self, label: str, total: int) -> None:
        self._label, self._total, self._done, self._errors, self._first = label, total, 0, 0, []
        self._t0 = time.monotonic()
        self.line.show(self._text(), force=True)

    def update(self, result: RequestResult) -> None:
        self._done += 1
        self._errors += 0 if result.ok else 1
        if result.first_chunk_s is not None:
            self._first.append(result.first_chunk_s)
        self.line.show(self._text(), force=self._done >= self._total)

    def _text(self) -> str:
        first = f"  first p50 {1e3 * float(np.median(self._first)):7.1f} ms" if self._first else ""
        errors = f"  errors {self._errors}" if self._errors else ""
        return (f"[bench] {self._label}: {self._done}/{self._total} requests{first}{errors}  "
                f"{time.monotonic() - self._t0:6.1f} s")

    def end(self, summary: str = "") -> None:
        self.line.end(self._text() + (f"  {summary}" if summary else ""))

    def note(self, message: str) -> None:
        self.line.note(f"[bench] {message}")
