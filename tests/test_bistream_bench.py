"""benchmarks/bistream_latency.py end to end on CPU with the tiny random preset (one sentence)."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bistream_latency.py"


@pytest.mark.slow
def test_bistream_latency_script_on_cpu(tmp_path, capsys, monkeypatch):
    spec = importlib.util.spec_from_file_location("bistream_latency", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, script)  # its dataclasses look their module up there
    spec.loader.exec_module(script)
    out = tmp_path / "r.json"
    assert script.main(["--sentences", "1", "--repeats", "1", "--streams", "2", "--throughput-modes", "bistream",
                        "--throughput-max-tokens", "40", "--interval", "0.02", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    meta = r["meta"]
    assert meta["pieces"] > 3 and meta["first_sentence_at_s"] == pytest.approx(meta["last_piece_at_s"])
    for mode in ("bistream", "sentence"):
        run = r["latency_runs"][mode][0]
        assert run["error"] is None and run["first_audio_s"] > 0 and run["speech_tokens"] > 0
        assert run["audio_s"] == pytest.approx(run["speech_tokens"] * 0.04)
    throughput = r["throughput"]["bistream"]
    assert throughput["streams"] == 2 and throughput["errors"] == 0 and throughput["audio_s_per_s"] > 0
    assert throughput["speech_tokens_mean"] <= 40
    assert "first audio, sentence / bistream" in capsys.readouterr().out
