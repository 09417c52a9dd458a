"""A clone without the parity fixture: the tests that need it fail at once, naming where they looked
and what to do."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_a_missing_fixture_says_where_it_comes_from_and_what_to_do(tmp_path):
    missing = tmp_path / "nowhere"
    env = {**os.environ, "COSYVOICE_TINY_FIXTURE": str(missing)}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        "tests/test_model_dir.py::test_dims_full_value"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    said = " ".join(r.stdout.split())  # pytest wraps long messages
    assert r.returncode == 1, r.stdout[-2000:]
    assert f"CosyVoice2 tiny fixture not found at {missing}" in said
    assert "../shared/fixtures/cosyvoice2-tiny" in said and "COSYVOICE_TINY_FIXTURE" in said
    assert "The parity fixture" in said
    assert "**The parity fixture**" in (ROOT / "README.md").read_text()
