"""Offline batch: the data list checks, atomic and resumable outputs, the multi-worker parent,
and (slow) a real 3-entry run on the tiny fixture that a second run skips entirely."""
from __future__ import annotations

import asyncio
import json
import sys
from argparse import Namespace

import numpy as np
import pytest
import soundfile as sf

from async_cosyvoice import batch
from async_cosyvoice.batch import DataListError, load_data_list


def _write_list(path, lines):
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n", encoding="utf-8")
    return path


@pytest.fixture
def prompt(tmp_path):
    p = tmp_path / "prompts" / "p.wav"
    p.parent.mkdir()
    sf.write(p, (0.1 * np.sin(np.arange(16000) / 10)).astype(np.float32), 16000)
    return p


def test_load_data_list_resolves_paths(tmp_path, prompt):
    data = _write_list(tmp_path / "data.jsonl", [
        {"key": "a", "prompt_text": "hi", "text": "one", "prompt_wav": "prompts/p.wav", "wav": "sub/a.wav"},
        "",
        {"key": "b", "text": "two", "prompt_wav": str(prompt), "wav": str(tmp_path / "abs.wav")},
        {"key": "c", "text": "three", "prompt_wav": "prompts/p.wav"},
    ])
    a, b, c = load_data_list(data, tmp_path / "out")
    assert (a.line, b.line, c.line) == (1, 3, 4)
    assert a.prompt_wav == prompt and a.wav == (tmp_path / "out" / "sub" / "a.wav").resolve()
    assert b.prompt_text == "" and b.wav == (tmp_path / "abs.wav").resolve()
    assert c.wav.name == "c.wav"
    assert a.seed(0) != b.seed(0) and a.seed(0) == load_data_list(data, tmp_path / "x")[0].seed(0)


@pytest.mark.parametrize("bad, message", [
    ('{"key": "b", "text": "two", "prompt_wav": "prompts/p.wav"', "not a JSON object"),
    ('["b", "two"]', "expected a JSON object"),
    ({"key": "b", "prompt_wav": "prompts/p.wav"}, "'text' is missing or empty"),
    ({"key": "b", "text": "two"}, "'prompt_wav' is missing"),
    ({"key": "a", "text": "two", "prompt_wav": "prompts/p.wav"}, "key 'a' already used on line 1"),
    ({"key": "b", "text": "two", "prompt_wav": "prompts/nope.wav"}, "not found"),
    ({"key": "b", "text": "two", "prompt_wav": "prompts/p.wav", "wav": "a.wav"}, "also the output of line 1"),
    ({"key": "b", "text": 2, "prompt_wav": "prompts/p.wav"}, "'text' is missing or empty"),
])
def test_a_bad_line_is_named(tmp_path, prompt, bad, message):
    data = _write_list(tmp_path / "data.jsonl", [
        {"key": "a", "text": "one", "prompt_wav": "prompts/p.wav"}, bad])
    with pytest.raises(DataListError) as e:
        load_data_list(data, tmp_path / "out")
    assert "data.jsonl:2: " in str(e.value) and message in str(e.value)


def test_cli_reports_a_corrupt_line(tmp_path, prompt, capsys):
    from cosyvoice_cli.cli import main

    data = _write_list(tmp_path / "data.jsonl", [
        {"key": "a", "text": "one", "prompt_wav": "prompts/p.wav"},
        {"key": "b", "text": "two", "prompt_wav": "prompts/p.wav"},
        "{not json"])
    assert main(["batch", "--data-list", str(data), "--out-dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "data.jsonl:3:" in err and "not a JSON object" in err
    assert not (tmp_path / "out").exists()  # nothing started


def test_atomic_write_and_completeness(tmp_path):
    wav = tmp_path / "d" / "x.wav"
    assert not batch.is_complete(wav)
    batch.write_wav_atomic(wav, np.full(2400, 0.5, np.float32), 24000)
    assert batch.is_complete(wav) and list(wav.parent.iterdir()) == [wav]
    data, rate = sf.read(wav)
    assert rate == 24000 and data.shape == (2400,) and abs(data[0] - 0.5) < 1e-3
    wav.write_bytes(b"RIFF....garbage")  # a torn or foreign file is redone
    assert not batch.is_complete(wav)


def test_shard_is_a_stable_round_robin():
    items = list(range(7))
    assert batch.shard(items, 0, 3) == [0, 3, 6] and batch.shard(items, 2, 3) == [2, 5]
    assert sorted(sum((batch.shard(items, i, 3) for i in range(3)), [])) == items
    with pytest.raises(ValueError):
        batch.shard(items, 3, 3)


def test_parent_merges_worker_reports(monkeypatch, tmp_path):
    """run_workers with stand-in workers that print the JSON lines a real worker prints."""
    def fake_argv(args, device, index, count):
        report = {"entries": 2, "skipped": index, "done": 2 - index, "failed": 0, "failures": [],
                  "audio_s": 1.5 * (2 - index), "wall_s": 1.0, "load_s": 0.5,
                  "started": 100.0 + index, "finished": 103.0 + index}
        lines = [json.dumps({"event": "progress", **report, "done": 0}), "not json",
                 json.dumps({"event": "report", **report})]
        return [sys.executable, "-c", "import sys; print(sys.argv[1])", "\n".join(lines)]

    monkeypatch.setattr(batch, "worker_argv", fake_argv)
    args = Namespace()
    report = asyncio.run(batch.run_workers(args, ["cuda:0", "cuda:1"], batch.ProgressBar(enabled=False)))
    assert (report["entries"], report["done"], report["skipped"], report["failed"]) == (4, 3, 1, 0)
    assert report["audio_s"] == pytest.approx(4.5) and report["wall_s"] == pytest.approx(4.0)
    assert [w["device"] for w in report["workers"]] == ["cuda:0", "cuda:1"]
    assert all(w["exit_code"] == 0 for w in report["workers"]) and "worker_errors" not in report


def test_worker_argv_passes_the_options_through(tmp_path):
    args = Namespace(data_list=tmp_path / "d.jsonl", out_dir=tmp_path / "o", seed=3, config=None, model_dir="m",
                     speakers_dir=None, engine="native", concurrency=16, tokens=None, llm_dtype="bfloat16",
                     flow_dtype=None, no_text_frontend=True, no_offline=True)
    argv = batch.worker_argv(args, "cuda:1", 1, 2)
    assert argv[1:4] == ["-m", "cosyvoice_cli", "batch"]
    s = " ".join(argv)
    assert "--device cuda:1 --shard 1/2 --worker" in s and "--model-dir m" in s and "--concurrency 16" in s
    assert "--llm-dtype bfloat16" in s and "--no-text-frontend" in s and "--tokens" not in s
    assert "--no-offline" in s


# -- a real run (slow) ---------------------------------------------------------------------------

TOKENS = 20


@pytest.mark.slow
def test_batch_writes_playable_wavs_and_resumes(tiny_dir, golden_dir, tmp_path, capsys):
    from cosyvoice_cli.cli import main

    prompt = golden_dir / "prompt_24k.wav"
    data = _write_list(tmp_path / "data.jsonl", [
        {"key": "u1", "prompt_text": "The morning train was late again.", "text": "Hello there.",
         "prompt_wav": str(prompt), "wav": "u1.wav"},
        {"key": "u2", "prompt_text": "", "text": "A second sentence.", "prompt_wav": str(prompt), "wav": "x/u2.wav"},
        {"key": "u3", "prompt_text": "The morning train was late again.", "text": "And a third.",
         "prompt_wav": str(prompt), "wav": str(tmp_path / "abs" / "u3.wav")},
    ])
    out = tmp_path / "out"
    argv = ["batch", "--model-dir", str(tiny_dir), "--data-list", str(data), "--out-dir", str(out),
            "--tokens", str(TOKENS), "--concurrency", "3", "--report", str(tmp_path / "report.json")]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "3 synthesized, 0 skipped" in err and "x real time" in err
    wavs = [out / "u1.wav", out / "x" / "u2.wav", tmp_path / "abs" / "u3.wav"]
    for w in wavs:
        audio, rate = sf.read(w)
        assert rate == 24000 and audio.shape == (TOKENS * 960,) and np.isfinite(audio).all()
        assert np.abs(audio).max() > 0
    assert not [p for p in out.rglob(".*.tmp")]
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["done"] == 3 and report["audio_s"] == pytest.approx(3 * TOKENS * 0.04)
    assert report["offline"]["jobs"] == 3  # rendered by the offline path (warm-up streams: not offline)
    assert report["rtf"] > 0 and report["x_real_time"] > 0

    mtimes = [w.stat().st_mtime_ns for w in wavs]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "0 synthesized, 3 skipped" in err
    assert [w.stat().st_mtime_ns for w in wavs] == mtimes
