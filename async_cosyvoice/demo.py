"""The demo model: a tiny random-weight CosyVoice2 directory generated once into a cache folder.

It makes the embedded default run anywhere without a download. It speaks noise, not words.
"""
from __future__ import annotations

import logging
from pathlib import Path

from .files import cache_root
from .model_dir import model_kind
from .random_model import make_random_model

log = logging.getLogger(__name__)

DEMO_PRESET = "tiny"
DEMO_SEED = 0


def demo_model_dir() -> Path:
    """Path of the demo model, generated on first use (a few seconds)."""
    path = cache_root() / f"cosyvoice2-{DEMO_PRESET}-random-seed{DEMO_SEED}"
    return make_random_model(DEMO_PRESET, path, seed=DEMO_SEED)


def resolve_model_dir(model_dir: str | Path | None) -> Path:
    """The configured model directory, or the demo model (with a loud warning) when none is set."""
    if model_dir is not None:
        return Path(model_dir).expanduser()
    path = demo_model_dir()
    log.warning("No model directory given: using the tiny RANDOM-WEIGHT demo model at %s. "
                "It produces noise, not speech. Pass --model-dir /path/to/CosyVoice2-0.5B for real voices.", path)
    return path


def served_model_name(config) -> str:
    """The model id the doors show: `server.served_model_name`, else the configured model directory's
    kind (`cosyvoice2` or `cosyvoice3`, read from its yaml's name)."""
    return config.server.served_model_name or model_kind(resolve_model_dir(config.model.dir).resolve())
