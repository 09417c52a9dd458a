"""One status line on stderr for long commands (synthesize, bench): redrawn in place on a terminal,
written once when done otherwise, so logs and captured output get whole lines."""
from __future__ import annotations

import sys
import time

REDRAW_EVERY_S = 0.1


class ProgressLine:
    def __init__(self, stream=None, enabled: bool = True):
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.live = enabled and hasattr(self.stream, "isatty") and self.stream.isatty()
        self._last_draw = 0.0

    def show(self, text: str, force: bool = False) -> None:
        """Redraw the line (on a terminal, at most every REDRAW_EVERY_S unless `force`)."""
        now = time.monotonic()
        if not self.live or (not force and now - self._last_draw < REDRAW_EVERY_S):
            return
        self._last_draw = now
        self.stream.write("\r\033[K" + text)
        self.stream.flush()

    def end(self, text: str) -> None:
        """The line's final state, ended with a newline (a terminal's live line is overwritten)."""
        if not self.enabled:
            return
        self.stream.write(("\r\033[K" if self.live else "") + text + "\n")
        self.stream.flush()
        self._last_draw = 0.0

    def note(self, message: str) -> None:
        """A line of its own."""
        if self.enabled:
            self.stream.write(message + "\n")
            self.stream.flush()
