"""The one progress line (synthesize, bench, batch): redrawn in place on a real terminal (a pty),
whole lines elsewhere."""
import io
import os
import pty

from async_cosyvoice.progress import ProgressLine


def test_on_a_terminal_the_line_is_redrawn_in_place():
    master, slave = pty.openpty()
    with open(slave, "w", closefd=True) as terminal:
        line = ProgressLine(terminal, redraw_every_s=3600)
        assert line.live
        line.show("one")
        line.show("two")              # within redraw_every_s of "one": skipped
        line.show("three", force=True)
        line.end("done")
    written = ""
    while not written.endswith("\n"):  # a pty may hand the writes over in pieces; only the last ends a line
        written += os.read(master, 4096).decode()
    os.close(master)
    assert written.replace("\r\n", "\n") == "\r\033[Kone\r\033[Kthree\r\033[Kdone\n"


def test_elsewhere_whole_lines_only():
    out = io.StringIO()
    line = ProgressLine(out)
    line.show("one", force=True)      # no live line in a log
    line.end("done")
    line.note("a note")
    assert out.getvalue() == "done\na note\n"

    logged = io.StringIO()
    line = ProgressLine(logged, log_every_s=3600)
    line.show("first")
    line.show("too soon")
    line.end("last")
    assert logged.getvalue() == "first\nlast\n"

    quiet = io.StringIO()
    line = ProgressLine(quiet, enabled=False, log_every_s=1)
    line.show("x", force=True)
    line.end("y")
    line.note("z")
    assert quiet.getvalue() == ""
