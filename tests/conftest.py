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


@pytest.fixture
def _one_thread():
    """Single-threaded torch: float sums in the order the goldens were made (1 thread)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def model_dir(tiny_dir):
    from async_cosyvoice.model_dir import load_model_dir

    return load_model_dir(tiny_dir)


@pytest.fixture(scope="session")
def hift(model_dir):
    from async_cosyvoice.models.hift import HiFT

    m = HiFT(model_dir.dims.hift).eval()
    m.load_state_dict(model_dir.hift_state_dict(), strict=True)
    return m


@pytest.fixture(scope="module")
def lm(model_dir):
    """The fixture's LM, loaded strictly, float32 CPU, eval mode."""
    from async_cosyvoice.model_dir import load_strict
    from async_cosyvoice.models.llm import CosyVoice2LM

    m = CosyVoice2LM(model_dir.dims.lm).eval()
    load_strict(m, model_dir.llm_state_dict(), "llm.pt")
    return m


def next_job_upto(stream, tokens, llm_done):
    """Plan with the token list as it stands: append what the stream has not seen yet, then plan."""
    import torch

    tokens = torch.as_tensor(tokens).reshape(-1)
    stream.append(tokens[stream.n_tokens:])
    return stream.next_job(llm_done)
