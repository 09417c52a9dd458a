"""`cosyvoice2.yaml` of a random model: the official recipe (`cosyvoice2.yaml` beside this file, the
CosyVoice2-0.5B one) with a preset's dims written in through the table of `dims_map.py`."""
from __future__ import annotations

from pathlib import Path

from async_cosyvoice.dims_map import write_recipe
from async_cosyvoice.models.dims import ModelDims

OFFICIAL_RECIPE = Path(__file__).with_name("cosyvoice2.yaml")


def recipe_yaml(d: ModelDims) -> str:
    """A `cosyvoice2.yaml` with the official structure, tags and comments, holding the dims `d`."""
    return write_recipe(d, OFFICIAL_RECIPE.read_text(encoding="utf-8"))
