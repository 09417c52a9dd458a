"""The devices of a server (`model.devices`) and what each reports about its share of the work."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import Config
from .engine.base import EngineStats


@dataclass
class DeviceStats:
    """One device's share of the work (`role`: worker, replica, llm, token2wav or all)."""
    device: str
    role: str
    active: int = 0          # requests (worker, replica) or streams (token2wav) in progress
    served: int = 0          # requests / streams assigned so far
    engine: EngineStats | None = None  # workers, replicas and the llm device: their engine's stats
    state: str = "serving"   # a worker process: starting, serving, restarting or failed
    restarts: int = 0        # a worker process: times it was started again after dying
    busy_s: float | None = None        # a worker process: seconds its device stages were busy
    memory_bytes: int | None = None    # a worker process: device memory it holds (CUDA reserved; CPU: RSS)


def visible_cuda_devices() -> list[str]:
    return [f"cuda:{i}" for i in range(torch.cuda.device_count())]


def devices_of(config: Config) -> list[str]:
    """`model.devices` (`all`: every visible CUDA device), or `model.device` alone."""
    devices = config.model.devices
    if devices == "all":
        found = visible_cuda_devices()
        if not found:
            raise ValueError("model.devices is 'all' but no CUDA device is visible; list the devices instead")
        return found
    return list(devices) or [config.model.device]


def on_device(config: Config, device: str) -> Config:
    """The config of one device's part (a single-device config)."""
    return config.model_copy(update={"model": config.model.model_copy(update={"device": device, "devices": []})})
