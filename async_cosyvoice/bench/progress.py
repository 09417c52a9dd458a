"""Progress on stderr while a sweep runs."""
from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from .metrics import RequestResult


class Progress:
    """One live line per level on a terminal (`\\r`), one line per finished level otherwise."""

    def __init__(self, stream=None, enabled: bool = True):
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.live = enabled and hasattr(self.stream, "isatty") and self.stream.isatty()
        self._label, self._total, self._done, self._errors, self._first = "", 0, 0, 0, []
        self._t0 = 0.0
        self._last_draw = 0.0

    def start(self, label: str, total: int) -> None:
        self._label, self._total, self._done, self._errors, self._first = label, total, 0, 0, []
        self._t0 = time.monotonic()
        self._draw(force=True)

    def update(self, result: RequestResult) -> None:
        self._done += 1
        self._errors += 0 if result.ok else 1
        if result.first_chunk_s is not None:
            self._first.append(result.first_chunk_s)
        self._draw()

    def _line(self) -> str:
        first = f"  first p50 {1e3 * float(np.median(self._first)):7.1f} ms" if self._first else ""
        errors = f"  errors {self._errors}" if self._errors else ""
        return (f"[bench] {self._label}: {self._done}/{self._total} requests{first}{errors}  "
                f"{time.monotonic() - self._t0:6.1f} s")

    def _draw(self, force: bool = False) -> None:
        now = time.monotonic()
        if not self.live or (not force and now - self._last_draw < 0.1 and self._done < self._total):
            return
        self._last_draw = now
        self.stream.write("\r\033[K" + self._line())
        self.stream.flush()

    def end(self, summary: str = "") -> None:
        if not self.enabled:
            return
        line = self._line() + (f"  {summary}" if summary else "")
        self.stream.write(("\r\033[K" if self.live else "") + line + "\n")
        self.stream.flush()

    def note(self, message: str) -> None:
        if self.enabled:
            self.stream.write(f"[bench] {message}\n")
            self.stream.flush()
