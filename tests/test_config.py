"""Config files and environment overrides."""
from pathlib import Path

import pydantic
import pytest
import torch

from async_cosyvoice.config import Config
from async_cosyvoice.devices import devices_of

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


def test_devices_all_and_the_default_placement():
    config = Config.load(env={"ASYNC_COSYVOICE__MODEL__DEVICES": "all"})
    assert config.model.devices == "all" and config.model.placement == "workers"
    visible = torch.cuda.device_count()
    if visible:
        assert devices_of(config) == [f"cuda:{i}" for i in range(visible)]
    else:
        with pytest.raises(ValueError, match="no CUDA device is visible"):
            devices_of(config)
    assert devices_of(Config.model_validate({"model": {"devices": ["cpu", "cpu"]}})) == ["cpu", "cpu"]
    assert devices_of(Config()) == ["cpu"]
    with pytest.raises(pydantic.ValidationError, match="at least two entries"):
        Config.model_validate({"model": {"devices": ["cuda:0"], "placement": "disaggregated"}})
