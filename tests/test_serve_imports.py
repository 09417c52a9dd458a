"""What `async-cosyvoice serve` imports before it serves: a process that compiles nothing (the CPU
default) loads the models without torch's compiler (torch._dynamo and torch._inductor, over a
second of imports) and never imports plotting or the transformers library. A fresh interpreter
each time: the test process itself has imported much more."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NOT_AT_SERVE_TIME = ("torch._dynamo", "torch._inductor", "matplotlib", "transformers", "sympy", "triton")

PROBE = """
import json, sys
import cosyvoice_cli.cli, cosyvoice_cli.serve
from async_cosyvoice.model_dir import build_models
from async_cosyvoice.startup import Startup
models = build_models(sys.argv[1])
startup = Startup()
with startup.span("load weights", "loading weights"):
    pass
print(json.dumps({"loaded": sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "matplotlib", "transformers",
                                                                                  "sympy", "triton")),
                  "compile": startup.finish().phases["compile"]}))
"""


def probe(model_dir: Path) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE, str(model_dir)], cwd=ROOT, capture_output=True, text=True,
                         timeout=300, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_serving_without_compiling_imports_no_compiler_and_no_plotting(tiny_dir, tiny3_dir):
    for model_dir in (tiny_dir, tiny3_dir):  # CosyVoice3's DiT and causal vocoder too
        seen = probe(model_dir)
        heavy = [m for m in seen["loaded"] if m.startswith(NOT_AT_SERVE_TIME)]
        assert heavy == [], f"{model_dir.name}: imported at serve time: {heavy[:10]}"
        assert seen["compile"] == 0.0  # read from torch's accounting without importing it
