"""A configured device checked against this torch build before anything loads, so `--device cuda`
on a CPU-only torch is one clear error instead of a traceback from deep inside model loading."""
from __future__ import annotations

import torch

from .errors import ConfigError


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
