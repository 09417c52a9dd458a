"""The recipe of a random model: the official one of its kind (`cosyvoice2.yaml`, CosyVoice2-0.5B's, or
`cosyvoice3.yaml`, upstream's examples/libritts/cosyvoice3 recipe, beside this file) with a preset's dims
written in through the tables of `dims_map.py`."""
from __future__ import annotations

from pathlib import Path

from async_cosyvoice.dims_map import write_recipe
from async_cosyvoice.models.dims import ModelDims

OFFICIAL_RECIPE = Path(__file__).with_name("cosyvoice2.yaml")
OFFICIAL_RECIPES = {"cosyvoice2": OFFICIAL_RECIPE, "cosyvoice3": Path(__file__).with_name("cosyvoice3.yaml")}


def recipe_yaml(d: ModelDims) -> str:
    """The official recipe of `d.kind` with its structure, tags and comments, holding the dims `d`."""
    return write_recipe(d, OFFICIAL_RECIPES[d.kind].read_text(encoding="utf-8"))
