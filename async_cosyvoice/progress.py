"""One status line on stderr for long commands (synthesize, bench, batch): redrawn in place on a
terminal; elsewhere (logs, captured output) whole lines only: the final one, and with
`log_every_s` one every that many seconds on the way."""
from __future__ import annotations

import math
import sys
import time

REDRAW_EVERY_S = 0.1


class ProgressLine:
    def __init__(self, stream=None, enabled: bool = True, log_every_s: float | None = None,
                 redraw_every_s: float = REDRAW_EVERY_S):
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.live = enabled and hasattr(self.stream, "isatty") and self.stream.isatty()
        self.every_s = redraw_every_s if self.live else log_every_s
        self._last_draw = -math.inf  # never: monotonic time can be smaller than every_s (a fresh boot)

    def show(self, text: str, force: bool = False) -> None:
        """Redraw the line on a terminal (at most every `redraw_every_s` unless `force`); elsewhere
        write it as a line of its own at most every `log_every_s` (never when that is None)."""
        now = time.monotonic()
        if not self.enabled or self.every_s is None or (not force and now - self._last_draw < self.every_s):
            return
        self._last_draw = now
        self.stream.write("\r\033[K" + text if self.live else text + "\n")
        self.stream.flush()

    def end(self, text: str) -> None:
        """The line's final state, ended with a newline (a terminal's live line is overwritten)."""
        if not self.enabled:
            return
        self.stream.write(("\r\033[K" if self.live else "") + text + "\n")
        self.stream.flush()
        self._last_draw = -math.inf

    def note(self, message: str) -> None:
        """A line of its own."""
        if self.enabled:
            self.stream.write(message + "\n")
            self.stream.flush()
