"""`async-cosyvoice serve` run as a user runs it (a child process, the real tiny model): the HTTP-only
server, where its speaker store is, what it warns about, and failures it can name (one line, exit 2)."""
from __future__ import annotations

import io

import httpx
import pytest
import soundfile as sf
from conftest import _free_port
from serve_process import ServeProcess


@pytest.mark.slow
def test_http_only_serve_becomes_ready_and_speaks(tiny_dir, tmp_path):
    """`serve --port -1 --http-port N` (documented): gRPC off, the model loads, health turns SERVING,
    a speech request is answered, and SIGTERM ends it with exit code 0. The store is empty and the
    default one (under $ASYNC_COSYVOICE_DATA), named in the log; the voice is the model directory's
    own (its spk2info.pt)."""
    data = tmp_path / "data"
    port = _free_port()
    with ServeProcess("--port", "-1", "--http-port", str(port), "--model-dir", str(tiny_dir),
                      ASYNC_COSYVOICE_DATA=str(data)) as server:
        server.wait_for("health SERVING")
        store = server.wait_for("speaker store:", timeout=1)
        assert str(data / "speakers") in store and str(tiny_dir / "spk2info.pt") in store
        r = httpx.post(f"http://127.0.0.1:{port}/v1/audio/speech", timeout=300,
                       json={"model": "tts-1", "input": "Hello there.", "voice": "tiny_zs_spk",
                             "response_format": "wav"})
        assert r.status_code == 200, r.text
        audio, rate = sf.read(io.BytesIO(r.content), dtype="float32")
        assert rate == 24000 and len(audio) > 0
        assert server.proc.poll() is None, server.log
        assert server.stop() == 0, server.log
        assert "Traceback" not in server.log and "listening on" not in server.log  # no gRPC port
