"""Failures the command line can name: one line on stderr, exit code 2, nothing loaded or bound first;
and the voice arguments say what they lack."""
from __future__ import annotations

import socket

import pytest
from serve_process import run_cli

from cosyvoice_cli.cli import VERBS, build_parser, main
from cosyvoice_cli.options import verb_first


def one_error_line(r) -> str:
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), r.stderr[-3000:]
    return lines[0]


@pytest.fixture
def busy_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


@pytest.mark.slow
def test_cuda_on_a_cpu_torch_is_one_line(tiny_dir, tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this torch has a GPU")
    said = one_error_line(run_cli("serve", "--device", "cuda", "--port", "0", "--model-dir", str(tiny_dir),
                                  "--speakers-dir", str(tmp_path)))
    assert "device cuda" in said and "--device cpu" in said
    said = one_error_line(run_cli("synthesize", "--device", "cuda", "--model-dir", str(tiny_dir), "--mode",
                                  "cross_lingual", "--prompt-wav", str(tiny_dir / "golden" / "prompt_24k.wav"),
                                  "--text", "Hi.", "--out", str(tmp_path / "o.wav"), "--speakers-dir",
                                  str(tmp_path)))
    assert "device cuda" in said and not (tmp_path / "o.wav").exists()


@pytest.mark.slow
def test_a_port_in_use_is_one_line(tiny_dir, tmp_path, busy_port):
    said = one_error_line(run_cli("serve", "--port", str(busy_port), "--model-dir", str(tiny_dir),
                                  "--speakers-dir", str(tmp_path)))
    assert f"gRPC (--port) port 127.0.0.1:{busy_port} is in use" in said
    said = one_error_line(run_cli("serve", "--port", "-1", "--http-port", str(busy_port), "--model-dir",
                                  str(tiny_dir), "--speakers-dir", str(tmp_path)))
    assert f"HTTP (--http-port) port 127.0.0.1:{busy_port} is in use" in said


def test_a_prompt_without_its_transcript_says_how(tiny_dir, tmp_path, capsys):
    prompt = str(tiny_dir / "golden" / "prompt_24k.wav")
    assert main(["synthesize", "--prompt-wav", prompt, "--text", "Hi.", "--model-dir", str(tiny_dir),
                 "--speakers-dir", str(tmp_path), "--out", str(tmp_path / "o.wav")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--prompt-text" in err and "--mode cross_lingual" in err
    assert not (tmp_path / "o.wav").exists()


def test_shared_options_may_come_before_the_command():
    argv = ["-v", "--target", "h:1", "--wait=5", "--tls", "speakers", "list"]
    assert verb_first(argv, VERBS) == ["-v", "speakers", "list", "--target", "h:1", "--wait=5", "--tls"]
    args = build_parser().parse_args(verb_first(argv, VERBS))
    assert (args.verbose, args.target, args.wait, args.tls, args.action) == (True, "h:1", 5.0, True, "list")
    args = build_parser().parse_args(verb_first(["--model-dir", "m", "synthesize", "--text", "x", "--out", "o"],
                                                VERBS))
    assert str(args.model_dir) == "m" and args.text == "x"
    # a value that happens to be a command's name is still the option's value
    assert verb_first(["--config", "serve", "serve"], VERBS) == ["serve", "--config", "serve"]


def test_options_for_the_other_place_are_refused(capsys):
    assert main(["synthesize", "--text", "x", "--speaker", "a", "--wait", "3", "--out", "o.wav"]) == 2
    assert "--wait: only with --target" in capsys.readouterr().err


def test_an_invalid_config_is_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("server:\n  port: -5\n  bogus: 1\n")
    assert main(["--config", str(bad), "speakers", "list"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "server.port: Input should be greater than or equal to 0" in err
    assert "server.bogus: Extra inputs are not permitted" in err
