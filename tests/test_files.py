"""files.py: the cache root and the temp-then-rename writers."""
from __future__ import annotations

from pathlib import Path

import pytest

from async_cosyvoice.files import (
    atomic_directory, atomic_write_bytes, atomic_writer, cache_root, is_temp_name,
)


def test_cache_root_precedence(monkeypatch, tmp_path):
    monkeypatch.delenv("ASYNC_COSYVOICE_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", "")  # empty means unset (XDG spec)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_root() == tmp_path / "home" / ".cache" / "async_cosyvoice"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "async_cosyvoice"
    monkeypatch.setenv("ASYNC_COSYVOICE_CACHE", "~/mine")
    assert cache_root() == tmp_path / "home" / "mine"


def _leftovers(d: Path) -> list[str]:
    return [p.name for p in d.iterdir() if is_temp_name(p.name)]


def test_atomic_writer_replaces_or_leaves_the_old_file(tmp_path):
    target = tmp_path / "sub" / "out.bin"
    atomic_write_bytes(target, b"one")
    assert target.read_bytes() == b"one" and target.stat().st_mode & 0o777 == 0o644
    with pytest.raises(RuntimeError, match="writer failed"):
        with atomic_writer(target) as tmp:
            tmp.write_bytes(b"half")
            assert is_temp_name(tmp.name) and tmp.parent == target.parent
            raise RuntimeError("writer failed")
    assert target.read_bytes() == b"one" and _leftovers(target.parent) == []
    with atomic_writer(target, fsync=True) as tmp:
        tmp.write_bytes(b"two")
        assert target.read_bytes() == b"one"  # not visible before the writer is done
    assert target.read_bytes() == b"two" and _leftovers(target.parent) == []


def test_atomic_directory(tmp_path):
    target = tmp_path / "model"
    with atomic_directory(target) as tmp:
        (tmp / "a").write_text("1")
        assert not target.exists()
    assert (target / "a").read_text() == "1" and target.stat().st_mode & 0o777 == 0o755

    def finished(p: Path) -> bool:
        return (p / "done").is_file()

    with atomic_directory(target, finished) as tmp:  # a damaged copy is replaced
        (tmp / "done").write_text("ours")
    assert (target / "done").read_text() == "ours" and not (target / "a").exists()
    with atomic_directory(target, finished) as tmp:  # a finished copy (a concurrent writer's) is kept
        (tmp / "done").write_text("late")
    assert (target / "done").read_text() == "ours"
    with pytest.raises(OSError):
        with atomic_directory(target) as tmp:
            raise OSError("disk full")
    assert (target / "done").read_text() == "ours"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # no temporary directories left
