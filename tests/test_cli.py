"""The `async-cosyvoice` command line in-process: synthesize (every voice source) and the speakers
commands (tests/test_client.py runs the same verbs with --target against a server)."""
import json

import pytest
import soundfile as sf

from cosyvoice_cli.cli import main


@pytest.fixture
def common(tiny_dir, tmp_path):
    return ["--model-dir", str(tiny_dir), "--speakers-dir", str(tmp_path / "spk")]


@pytest.mark.slow
def test_register_then_synthesize_by_id(common, tiny_dir, tmp_path, capsys):
    prompt = str(tiny_dir / "golden" / "prompt_24k.wav")
    assert main(["speakers", "add", "alice", "--prompt-wav", prompt, "--prompt-text", "The morning train.",
                 *common]) == 0
    assert main(["speakers", "list", *common]) == 0
    assert "alice\tzero_shot" in capsys.readouterr().out

    out, tokens = tmp_path / "alice.wav", tmp_path / "tokens.json"
    assert main(["synthesize", "--speaker", "alice", "--text", "Hello there.", "--stream", "--seed", "1",
                 "--max-tokens", "30", "--save-tokens", str(tokens), "--out", str(out), *common]) == 0
    audio, rate = sf.read(out)
    saved = json.loads(tokens.read_text())
    assert rate == 24000 and len(saved) == 30 and audio.shape == (30 * 960,)

    resampled = tmp_path / "alice16k.wav"
    assert main(["synthesize", "--speaker", "alice", "--text", "Hello there.", "--seed", "1", "--max-tokens", "30",
                 "--sample-rate", "16000", "--out", str(resampled), *common]) == 0
    audio16, rate16 = sf.read(resampled)
    assert rate16 == 16000 and audio16.shape == (30 * 640,)

    capsys.readouterr()
    assert main(["speakers", "show", "alice", *common]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["kind"] == "zero_shot" and shown["speech_feat"][0] == 2 * shown["speech_tokens"]

    exported = tmp_path / "spk2info.pt"
    assert main(["speakers", "export", str(exported), *common]) == 0
    assert main(["speakers", "rm", "alice", *common]) == 0
    assert main(["synthesize", "--speaker", "alice", "--text", "Hi.", "--out", str(out), *common]) == 2
    assert "alice" in capsys.readouterr().err
    assert main(["speakers", "import", str(exported), *common]) == 0
    assert main(["speakers", "show", "alice", *common]) == 0


@pytest.mark.slow
def test_greedy_tokens_are_reproducible_from_the_command_line(common, tiny_dir, tmp_path):
    prompt = str(tiny_dir / "golden" / "prompt_24k.wav")
    runs = []
    for i in range(2):
        tokens = tmp_path / f"t{i}.json"
        assert main(["synthesize", "--mode", "cross_lingual", "--prompt-wav", prompt, "--text", "Hello there.",
                     "--top-k", "1",
                     "--engine", "native", "--save-tokens", str(tokens), "--out", str(tmp_path / f"{i}.wav"),
                     *common]) == 0
        runs.append(json.loads(tokens.read_text()))
    assert runs[0] == runs[1] and len(runs[0]) > 0


def test_bad_input_is_an_error_not_a_traceback(common, tiny_dir, tmp_path, capsys):
    garbage = tmp_path / "garbage.wav"
    garbage.write_bytes(b"not audio at all")
    assert main(["synthesize", "--mode", "cross_lingual", "--prompt-wav", str(garbage), "--text", "Hi.",
                 "--out", str(tmp_path / "o.wav"),
                 *common]) == 2
    assert "cannot decode file" in capsys.readouterr().err
    assert main(["speakers", "show", "../etc", *common]) == 2
    assert main(["synthesize", "--model-dir", str(tmp_path), "--mode", "cross_lingual",
                 "--prompt-wav", str(tiny_dir / "golden" / "prompt_24k.wav"),
                 "--text", "Hi.", "--out", str(tmp_path / "o.wav")]) == 2
    assert "cosyvoice2.yaml" in capsys.readouterr().err
    assert not (tmp_path / "o.wav").exists()


@pytest.mark.slow
def test_config_first_hop_is_honoured(common, tiny_dir, tmp_path, capsys):
    """The configured token2wav.first_hop sets the first streamed chunk (15 + 3 lookahead tokens by
    default): 20 tokens -> 20 x 960 samples, minus the 3840 HiFT keeps for the cross-fade. The
    progress line (stderr) ends with the last chunk; the summary (stdout) tells the first. Written as
    Ogg Opus at 48 kHz by the library's encoder, as a server would send it."""
    config = tmp_path / "c.yaml"
    config.write_text("token2wav:\n  first_hop: 20\n  adaptive: false\n")
    prompt = str(tiny_dir / "golden" / "prompt_24k.wav")
    out = tmp_path / "o.opus"
    assert main(["synthesize", "--mode", "cross_lingual", "--prompt-wav", prompt, "--text", "Hello there.",
                 "--stream", "--max-tokens", "40",
                 "--encoding", "opus", "--sample-rate", "48000", "--config", str(config), "--out", str(out),
                 *common]) == 0
    assert out.read_bytes()[:4] == b"OggS" and sf.info(out).frames == 40 * 960 * 2
    said = capsys.readouterr()
    assert f"({(20 * 960 - 3840) / 24000:.2f} s of audio)" in said.out and "40 speech tokens" in said.out
    last = said.err.splitlines()[-1].split()  # "chunk   N  audio   1.60 s  elapsed ..." (not a terminal)
    assert last[0] == "chunk" and int(last[1]) >= 1 and last[3] == f"{40 * 960 / 24000:.2f}"
