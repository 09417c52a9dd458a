"""The client verbs as a new user runs them: right after `async-cosyvoice serve &` (they wait for the
server to be SERVING), with `--target` before or after the verb, and without importing torch."""
from __future__ import annotations

import pytest
import soundfile as sf
from conftest import _free_port
from serve_process import ServeProcess, imported_modules, run_cli

from async_cosyvoice.speakers import SpeakerStore
from cosyvoice_cli.cli import main


def torch_modules(importtime_log: str) -> set[str]:
    return {m for m in imported_modules(importtime_log) if m == "torch" or m.startswith("torch.")}


@pytest.mark.slow
def test_client_verbs_run_right_after_serve(tiny_dir, tmp_path):
    speakers = tmp_path / "speakers"
    SpeakerStore(speakers).import_spk2info(tiny_dir / "spk2info.pt")
    port = _free_port()
    target = f"127.0.0.1:{port}"
    with ServeProcess("--port", str(port), "--model-dir", str(tiny_dir), "--speakers-dir", str(speakers)) as server:
        # at once, as the README shows: the server is still starting (importing, loading the model)
        listed = run_cli("--target", target, "speakers", "list", python_flags=("-X", "importtime"))
        assert listed.returncode == 0, listed.stderr[-3000:]
        assert "tiny_zs_spk\tzero_shot" in listed.stdout and "tiny_sft_spk\tsft" in listed.stdout
        assert f"waiting up to 60 s for {target} to report SERVING" in listed.stderr
        assert torch_modules(listed.stderr) == set()
        server.wait_for("health SERVING", timeout=5)  # it was SERVING when the list came

        # an sft speaker by id alone (no --mode sft), options after the verb, still no torch
        out = tmp_path / "sft.wav"
        spoken = run_cli("synthesize", "--speaker", "tiny_sft_spk", "--text", "Hello there.", "--seed", "1",
                         "--out", str(out), "--target", target, python_flags=("-X", "importtime"))
        assert spoken.returncode == 0, spoken.stderr[-3000:]
        assert torch_modules(spoken.stderr) == set()
        audio, rate = sf.read(out, dtype="float32")
        assert rate == 24000 and len(audio) > 0 and len(audio) % 960 == 0
        wrong = run_cli("synthesize", "--speaker", "tiny_sft_spk", "--mode", "zero_shot_by_spk_id", "--text", "Hi.",
                        "--out", str(tmp_path / "x.wav"), "--target", target)
        assert wrong.returncode == 2 and wrong.stderr.startswith("error: FAILED_PRECONDITION")
        assert "use mode sft for it" in wrong.stderr and wrong.stderr.count("\n") == 1
        assert server.proc.poll() is None


def test_no_server_there_is_one_line_after_the_wait(tmp_path):
    dead = f"127.0.0.1:{_free_port()}"
    r = run_cli("speakers", "list", "--target", dead, "--wait", "0.5")
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1] == (
        f"error: {dead} did not report SERVING within 0.5 s (no server listening there, or its model is "
        "still loading: wait longer with --wait SECONDS)")
    assert "Traceback" not in r.stderr
    r = run_cli("--target", dead, "--wait", "0", "speakers", "list")  # no wait: the call itself fails
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [r.stderr.strip()]
    assert r.stderr.startswith("error: UNAVAILABLE")


def test_bench_waits_as_long_as_it_is_told(capsys):
    dead = f"127.0.0.1:{_free_port()}"
    assert main(["--target", dead, "--wait", "0.5", "bench", "--concurrency", "1", "--requests", "1"]) == 2
    assert capsys.readouterr().err == f"error: {dead} not SERVING after 0.5 s\n"
