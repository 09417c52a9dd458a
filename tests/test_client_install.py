"""The client-only install (clients/python): its wheel holds exactly the modules a client imports and
asks for no torch, and the command line runs from nothing but that wheel (torch made unimportable)
against a real server."""
from __future__ import annotations

import email
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
import soundfile as sf

from async_cosyvoice.config import Config
from grpc_async.server import ServerThread

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "transformers", "onnxruntime", "onnx", "wetext", "scipy", "safetensors")
# run the CLI from the unpacked wheel alone: no site processing (no editable install of the full
# package), the environment's site-packages after it for grpc/numpy/av, and torch unimportable
RUN_FROM_WHEEL = """
import sys
wheel, site = sys.argv[1], sys.argv[2]
sys.path[:0] = [wheel]
sys.path.append(site)
sys.modules["torch"] = None
sys.argv = ["async-cosyvoice", *sys.argv[3:]]
from cosyvoice_cli.cli import main
import async_cosyvoice, grpc_async
assert async_cosyvoice.__file__.startswith(wheel) and grpc_async.__file__.startswith(wheel)
sys.exit(main())
"""


@pytest.fixture(scope="module")
def wheel_dir(tmp_path_factory) -> Path:
    """clients/python built into a wheel (from a copy with its links resolved) and unpacked."""
    work = tmp_path_factory.mktemp("client-wheel")
    source = work / "source"
    shutil.copytree(ROOT / "clients" / "python", source, symlinks=False,
                    ignore=shutil.ignore_patterns("build", "*.egg-info"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(work), str(source)], check=True, capture_output=True, timeout=600)
    (wheel,) = work.glob("async_cosyvoice_client-*.whl")
    unpacked = work / "unpacked"
    zipfile.ZipFile(wheel).extractall(unpacked)
    return unpacked


@pytest.fixture(scope="module")
def server(tiny_dir, tmp_path_factory):
    cfg = Config.model_validate({"model": {"dir": str(tiny_dir)},
                                 "speakers": {"dir": str(tmp_path_factory.mktemp("client-install-spk"))},
                                 "server": {"port": 0}})
    with ServerThread(cfg, ready_timeout=900) as st:
        yield st


def from_wheel(wheel_dir: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    site = sysconfig.get_paths()["purelib"]
    return subprocess.run([sys.executable, "-S", "-c", RUN_FROM_WHEEL, str(wheel_dir), site, *args], cwd=cwd,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_the_client_wheel_holds_the_client_and_asks_for_no_torch(wheel_dir):
    (info,) = wheel_dir.glob("*.dist-info")
    metadata = email.message_from_string((info / "METADATA").read_text())
    required = {r.split(";")[0].split(">")[0].split("=")[0].split("<")[0].strip().lower()
                for r in metadata.get_all("Requires-Dist")}
    assert not required & set(HEAVY), required
    modules = {str(p.relative_to(wheel_dir)) for p in wheel_dir.rglob("*.py")}
    assert {"grpc_async/client.py", "cosyvoice_cli/remote.py", "cosyvoice_cli/cli.py"} <= modules
    assert not {"grpc_async/server.py", "cosyvoice_cli/local.py", "async_cosyvoice/tts.py"} & modules
    assert (wheel_dir / "grpc_async" / "cosyvoice.proto").read_bytes() == (
        ROOT / "protos" / "cosyvoice" / "v1" / "cosyvoice.proto").read_bytes()
    assert "async-cosyvoice = cosyvoice_cli.cli:main" in (info / "entry_points.txt").read_text()


@pytest.mark.slow
def test_the_command_line_runs_from_the_client_wheel_without_torch(wheel_dir, server, tmp_path):
    listed = from_wheel(wheel_dir, "--target", server.target, "speakers", "list", cwd=tmp_path)
    assert listed.returncode == 0, listed.stderr
    assert "tiny_sft_spk\tsft" in listed.stdout  # the model directory's own speakers
    out = tmp_path / "hi.wav"
    spoken = from_wheel(wheel_dir, "synthesize", "--speaker", "tiny_zs_spk", "--text", "Hello.", "--seed", "1",
                        "--target", server.target, "--out", str(out), cwd=tmp_path)
    assert spoken.returncode == 0, spoken.stderr
    assert sf.info(out).samplerate == 24000 and sf.info(out).frames > 0
    kept = from_wheel(wheel_dir, "speakers", "rm", "tiny_sft_spk", "--target", server.target, cwd=tmp_path)
    assert kept.returncode == 2 and kept.stderr.startswith("error: FAILED_PRECONDITION") and "read-only" in kept.stderr
    local = from_wheel(wheel_dir, "speakers", "list", cwd=tmp_path)
    assert local.returncode == 2 and local.stderr.count("\n") == 1, local.stderr
    assert "needs the full async_cosyvoice package" in local.stderr and "--target" in local.stderr
