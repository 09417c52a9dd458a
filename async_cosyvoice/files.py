"""Where caches and user data live, and writes that a crash or a concurrent reader never sees half done.

Every writer builds its output under a temporary name in the destination's folder and renames it into
place (atomic on one filesystem), so a reader finds the old version, the new one or none.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

CACHE_ENV = "ASYNC_COSYVOICE_CACHE"


def cache_root() -> Path:
    """`$ASYNC_COSYVOICE_CACHE`, else `$XDG_CACHE_HOME/async_cosyvoice`, else `~/.cache/async_cosyvoice`."""
    if env := os.environ.get(CACHE_ENV):
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "async_cosyvoice"


DATA_ENV = "ASYNC_COSYVOICE_DATA"


def data_root() -> Path:
    """Where what users create is kept (the default speaker store is its `speakers/`):
    `$ASYNC_COSYVOICE_DATA`, else `$XDG_DATA_HOME/async_cosyvoice`, else `~/.local/share/async_cosyvoice`.
    Never the current directory: a command finds the same data wherever it is run."""
    if env := os.environ.get(DATA_ENV):
        return Path(env).expanduser()
    base = os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share"
    return Path(base).expanduser() / "async_cosyvoice"


def is_temp_name(name: str) -> bool:
    """A file name the writers below use for work in progress (a leftover after a crash)."""
    return name.startswith(".") and name.endswith(".tmp")


def fsync_dir(path: str | Path) -> None:
    """Make a rename inside `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def atomic_writer(path: str | Path, fsync: bool = False) -> Iterator[Path]:
    """Yield a temporary path beside `path` for a writer that takes a file name (torch.save, onnx export,
    soundfile); on success it is moved onto `path`, on error removed. `fsync` makes the new content
    and the rename durable before returning."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    os.chmod(tmp, 0o644)  # mkstemp makes it private; the output is an ordinary file
    try:
        yield tmp
        if fsync:
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
        os.replace(tmp, path)
        if fsync:
            fsync_dir(path.parent)
    finally:
        tmp.unlink(missing_ok=True)


def atomic_write_bytes(path: str | Path, data: bytes, fsync: bool = True) -> Path:
    with atomic_writer(path, fsync=fsync) as tmp:
        tmp.write_bytes(data)
    return Path(path)


@contextmanager
def atomic_directory(path: str | Path, finished: Callable[[Path], bool] = lambda p: False) -> Iterator[Path]:
    """Yield an empty temporary directory beside `path`; on success it replaces `path`.

    `finished(path)` tells a complete copy from a damaged one: when a concurrent writer has already put a
    finished copy in place, that copy is kept and ours is dropped; anything else at `path` is replaced."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; the output is an ordinary directory
    try:
        yield tmp
        if path.exists():
            if finished(path):
                return
            shutil.rmtree(path)
        try:
            os.rename(tmp, path)
        except OSError:
            if not finished(path):  # not a concurrent writer's finished copy
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def write_json(obj, path: str | Path) -> Path:
    """A report as indented JSON, written atomically (values JSON cannot hold become strings)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return atomic_write_bytes(path, (json.dumps(obj, indent=1, default=str) + "\n").encode(), fsync=False)
