"""The devices of a server (`model.devices`), each checked against this torch build before anything
loads (so `--device cuda` on a CPU-only torch is one clear error instead of a traceback from deep
inside model loading), and what each reports about its share of the work."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .config import Config
from .engine.base import EngineStats
from .errors import ConfigError

if TYPE_CHECKING:
    from .token2wav.graph_state import DeviceGraphState


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
    graphs: DeviceGraphState | None = None  # a token2wav device's CUDA graphs (None: none, or not known yet)


def visible_cuda_devices() -> list[str]:
    return [f"cuda:{i}" for i in range(torch.cuda.device_count())]


def devices_of(config: Config) -> list[str]:
    """`model.devices` (`all`: every visible CUDA device), or `model.device` alone."""
    devices = config.model.devices
    if devices == "all":
        found = visible_cuda_devices()
        if not found:
            raise ConfigError("model.devices is 'all' but no CUDA device is visible; list the devices instead")
        return found
    return list(devices) or [config.model.device]


def on_device(config: Config, device: str) -> Config:
    """The config of one device's part (a single-device config)."""
    return config.model_copy(update={"model": config.model.model_copy(update={"device": device, "devices": []})})


def check_device(name: str) -> torch.device:
    """The torch.device for `name`, or ConfigError saying what is wrong and what to do."""
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError) as e:
        raise ConfigError(f"device {name!r} is not a device name torch knows ({e}); use cpu, cuda or "
                          "cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        why = ("is a build without CUDA: install a CUDA build of torch" if torch.version.cuda is None
               else "sees no GPU: check the driver and CUDA_VISIBLE_DEVICES")
        raise ConfigError(f"device {name}: this torch {torch.__version__} {why}, or run on the CPU with "
                          "--device cpu (model.device: cpu)")
    try:
        torch.empty(0, device=device)
    except (AssertionError, RuntimeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        count = torch.cuda.device_count() if device.type == "cuda" else None
        seen = f" ({count} GPU(s) visible: cuda:0..cuda:{count - 1})" if count else ""
        raise ConfigError(f"device {name} cannot be used: {first}{seen}") from None
    return device
