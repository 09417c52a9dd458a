"""The proto as outside clients see it: lint (buf STANDARD, exceptions in buf.yaml), stable enum
numbers, the canonical file name, and stubs that generate from a copy anywhere."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from grpc_async import SERVICE_NAME, pb2
from grpc_async import _stubs

ROOT = Path(__file__).resolve().parents[1]


def _buf() -> str | None:
    local = ROOT / ".tools" / "node_modules" / ".bin" / "buf"   # scripts/install.sh puts it here
    return str(local) if local.is_file() else shutil.which("buf")


def test_buf_lint_passes():
    buf = _buf()
    if buf is None:
        pytest.skip("LOUD: buf not installed (scripts/install.sh installs it with npm: "
                    "npm install --prefix .tools @bufbuild/buf); proto lint not checked")
    result = subprocess.run([buf, "lint"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_enum_numbers_never_change():
    """Wire values clients already use; new encodings are appended, never renumbered."""
    assert {name: pb2.AudioEncoding.Value(name) for name in pb2.AudioEncoding.keys()} == {
        "AUDIO_ENCODING_UNSPECIFIED": 0, "AUDIO_ENCODING_PCM16": 1, "AUDIO_ENCODING_FLOAT32": 2,
        "AUDIO_ENCODING_WAV": 3, "AUDIO_ENCODING_OPUS": 4, "AUDIO_ENCODING_MP3": 5,
        "AUDIO_ENCODING_AAC": 6, "AUDIO_ENCODING_FLAC": 7, "AUDIO_ENCODING_WEBM_OPUS": 8}
    assert dict(pb2.TextMode.items()) == {"TEXT_MODE_UNSPECIFIED": 0, "TEXT_MODE_BISTREAM": 1, "TEXT_MODE_SENTENCE": 2}
    assert dict(pb2.TextNormalization.items()) == {"TEXT_NORMALIZATION_UNSPECIFIED": 0, "TEXT_NORMALIZATION_SAFE": 1,
                                                   "TEXT_NORMALIZATION_RAW": 2}


def test_canonical_file_and_service_names():
    assert pb2.DESCRIPTOR.name == "cosyvoice/v1/cosyvoice.proto"
    assert pb2.DESCRIPTOR.package == "cosyvoice.v1"
    assert SERVICE_NAME == "cosyvoice.v1.CosyVoice"
    assert "GetServerInfo" in pb2.DESCRIPTOR.services_by_name["CosyVoice"].methods_by_name
    assert (ROOT / "grpc_async" / "cosyvoice.proto").resolve() == (ROOT / "protos/cosyvoice/v1/cosyvoice.proto")


def test_stubs_generate_from_a_copy_elsewhere(tmp_path, monkeypatch):
    """A wheel holds a copy of the proto next to the package: it compiles under the canonical
    name, and the service module imports its messages relatively (no sys.path, no `cosyvoice`)."""
    copy = tmp_path / "somewhere" / "cosyvoice.proto"
    copy.parent.mkdir()
    shutil.copyfile(ROOT / "protos/cosyvoice/v1/cosyvoice.proto", copy)
    monkeypatch.setenv("ASYNC_COSYVOICE_PROTO", str(copy))
    monkeypatch.setenv("ASYNC_COSYVOICE_STUBS_DIR", str(tmp_path / "cache"))
    folder = _stubs.stubs_dir()
    assert folder.parent == tmp_path / "cache"
    assert sorted(p.name for p in folder.iterdir()) == ["cosyvoice_pb2.py", "cosyvoice_pb2_grpc.py"]
    service = (folder / "cosyvoice_pb2_grpc.py").read_text()
    assert "from . import cosyvoice_pb2 as" in service and "from cosyvoice" not in service
    assert "cosyvoice/v1/cosyvoice.proto" in (folder / "cosyvoice_pb2.py").read_text()
