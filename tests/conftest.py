import os
from pathlib import Path

import pytest

FIXTURE_ENV = "COSYVOICE_TINY_FIXTURE"
DEFAULT_FIXTURE = Path(__file__).resolve().parents[1] / ".." / "shared" / "fixtures" / "cosyvoice2-tiny"


def fixture_dir() -> Path:
    return Path(os.environ.get(FIXTURE_ENV, DEFAULT_FIXTURE)).resolve()


@pytest.fixture(scope="session")
def tiny_dir() -> Path:
    d = fixture_dir()
    if not (d / "cosyvoice2.yaml").is_file():
        pytest.fail(
            f"CosyVoice2 tiny fixture not found at {d}. Set {FIXTURE_ENV} to the directory "
            "holding cosyvoice2.yaml, llm.pt, flow.pt, hift.pt and golden/."
        )
    return d


@pytest.fixture(scope="session")
def golden_dir(tiny_dir) -> Path:
    return tiny_dir / "golden"
