"""Config files and environment overrides."""
from pathlib import Path

import pydantic
import pytest

from async_cosyvoice.config import Config

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_shipped_configs_load(path):
    config = Config.load(path, env={})
    assert config.engine.kind in ("native", "vllm")


def test_environment_overrides_and_validation(tmp_path):
    config = Config.load(None, env={"ASYNC_COSYVOICE__SERVER__PORT": "50099",
                                    "ASYNC_COSYVOICE__ENGINE__KIND": "vllm", "UNRELATED": "x"})
    assert config.server.port == 50099 and config.engine.kind == "vllm"
    with pytest.raises(ValueError, match="SECTION"):
        Config.load(None, env={"ASYNC_COSYVOICE__PORT": "1"})
    with pytest.raises(pydantic.ValidationError):
        Config.load(None, env={"ASYNC_COSYVOICE__ENGINE__KIND": "tensorrt-llm"})
    bad = tmp_path / "bad.yaml"
    bad.write_text("server:\n  prot: 1\n")  # a typo is an error, not a silently ignored key
    with pytest.raises(pydantic.ValidationError):
        Config.load(bad, env={})
