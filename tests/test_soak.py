"""A bounded soak in CI: benchmarks/soak.py against its own real server process (tiny model).

A few hundred mixed requests (every mode, streamed and whole, StreamSynthesize, cancellations,
deadlines, malformed requests, speaker register/get/synthesize/delete, listing) must end with
0 crashes, 0 unexpected statuses, no stream or engine request left on the server, a clean exit
of the server on SIGTERM, and bounded resident memory after warm-up (see SOAK_ARGS).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
REQUESTS = 240
WARMUP = 80
# RSS after warm-up: on this plan the server went 595 MiB (ready) -> 647 (80 requests) -> 667
# (240), i.e. +20 MiB after warm-up. The bound, 96 MiB, leaves ~5x headroom for allocator noise
# and still fails a leak of >= 0.6 MiB per request (a request's audio, mel or LM state kept
# alive). Small per-request leaks need thousands of requests to see; the slope over a 3,000-
# request run is checked by benchmarks/soak.py's default run (docs/robustness.md), not here.
SOAK_ARGS = ["--requests", str(REQUESTS), "--warmup", str(WARMUP), "--concurrency", "4", "--sample-every", "20",
             "--max-tokens-cap", "12", "--prompt-seconds", "1.0", "--rss-bound-mib", "96",
             "--slope-bound-kib", "inf"]


@pytest.mark.slow
def test_soak(tiny_dir, tmp_path):
    out = tmp_path / "soak.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "soak.py"), *SOAK_ARGS,
                           "--model-dir", str(tiny_dir), "--json", str(out)],
                          capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    print(proc.stdout[-4000:], proc.stderr[-4000:], sep="\n", file=sys.stderr)
    result = json.loads(out.read_text())
    assert not result["crashed"], result.get("error")
    assert result["requests"] == REQUESTS
    assert result["unexpected"] == []
    assert result["server_unexpected"] == {}  # the server's own count: nothing no client saw either
    assert result["leaked"] == {"active_streams": 0, "engine_running": 0, "engine_waiting": 0}
    assert result["server_exit_code"] == 0
    by_status = result["by_status"]
    assert by_status["OK"] > REQUESTS // 2 and by_status["INVALID_ARGUMENT"] > 10 and by_status["NOT_FOUND"] > 0
    assert result["rss"]["ok"], result["rss"]
    assert proc.returncode == 0, proc.stdout[-2000:]
