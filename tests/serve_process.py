"""`async-cosyvoice serve` as a user starts it: a child process (`python -m cosyvoice_cli serve ...`)
whose log lines a test can wait for, its exit code what a supervisor would see."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def cli_env(**extra: str) -> dict[str, str]:
    """The environment of a child `python -m cosyvoice_cli`: this checkout first on its path."""
    env = {k: v for k, v in os.environ.items()  # not the caller's config overrides or server
           if not k.startswith("ASYNC_COSYVOICE__") and k not in ("ASYNC_COSYVOICE_TARGET", "ASYNC_COSYVOICE_TOKEN")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.update(extra)
    return env


def run_cli(*args: str, cwd: Path | None = None, timeout: float = 300, python_flags: tuple[str, ...] = (),
            **env: str) -> subprocess.CompletedProcess:
    """`python [python_flags] -m cosyvoice_cli ARGS` as a user would run `async-cosyvoice ARGS`."""
    return subprocess.run([sys.executable, *python_flags, "-m", "cosyvoice_cli", *args], cwd=cwd or ROOT,
                          env=cli_env(**env), capture_output=True, text=True, timeout=timeout)


def imported_modules(importtime_log: str) -> set[str]:
    """The modules a `python -X importtime` run imported, from its stderr."""
    return {line.rsplit("|", 1)[1].strip() for line in importtime_log.splitlines()
            if line.startswith("import time:") and "|" in line}


class ServeProcess:
    """`python -m cosyvoice_cli serve ARGS`; its stderr (the log) is read by a thread into `lines`."""

    def __init__(self, *args: str, cwd: Path | None = None, **env: str):
        self.proc = subprocess.Popen([sys.executable, "-m", "cosyvoice_cli", "serve", *args], cwd=cwd or ROOT,
                                     env=cli_env(**env), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     text=True)
        self.lines: list[str] = []
        self._closed = False
        self._changed = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stderr:
            with self._changed:
                self.lines.append(line.rstrip("\n"))
                self._changed.notify_all()
        with self._changed:
            self._closed = True  # the process closed its log (it is exiting)
            self._changed.notify_all()

    @property
    def log(self) -> str:
        return "\n".join(self.lines)

    def wait_for(self, text: str, timeout: float = 300) -> str:
        """The first log line containing `text`; AssertionError (with the log) if the process ends
        or `timeout` passes first."""
        def hit() -> str | None:
            return next((line for line in self.lines if text in line), None)

        with self._changed:
            self._changed.wait_for(lambda: hit() is not None or self._closed, timeout)
            line = hit()
        assert line is not None, f"no {text!r} in the server's log (exit code {self.proc.poll()}):\n{self.log}"
        return line

    def stop(self, timeout: float = 60) -> int:
        """SIGTERM (a graceful shutdown), then the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        finally:
            self._reader.join(5)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._reader.join(5)

    def __enter__(self) -> "ServeProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.kill()
