"""Regional compilation's module surgery: a copy of a module whose repeated blocks are wrapped.

A model class names the block classes it repeats in `repeated_blocks` (CosyVoice2's estimator:
its transformer and resnet blocks; its encoder: the conformer layers; CosyVoice3's DiT: its
blocks). Compiling each block instance through one program of its class, the glue between them
eager, keeps Dynamo's trace to one block instead of growing with the block count (PyTorch's
regional compilation recipe). Two callers wrap the blocks: the recompute estimator
(torch_backend.compile_estimator: each block torch.compile'd) and the cached flow call over
state slots (token2wav/slot_regions.py: each block through its class's program over its own
state entries).
"""
from __future__ import annotations

import copy
from collections.abc import Callable

from torch import nn

__all__ = ["regional", "repeated_blocks"]


def repeated_blocks(module: nn.Module) -> tuple[type[nn.Module], ...]:
    """The block classes named in `repeated_blocks` by `module` and its submodules, in module order."""
    found: dict[type[nn.Module], None] = {}
    for m in module.modules():
        found.update(dict.fromkeys(getattr(m, "repeated_blocks", ())))
    return tuple(found)


def regional(module: nn.Module, wrap: Callable[[nn.Module], nn.Module]) -> nn.Module:
    """A shallow copy of `module` in which every instance of its repeated blocks is wrap(block).
    Everything else (parameters, buffers, attributes) is shared with `module`, which is left as it
    is, so its other callers keep running it unwrapped."""
    blocks = repeated_blocks(module)
    if not blocks:
        raise ValueError(f"{type(module).__name__} names no repeated_blocks to compile regionally")

    def copied(m: nn.Module) -> nn.Module:
        if isinstance(m, blocks):
            return wrap(m)
        clone = copy.copy(m)  # the same parameters and buffers; only the child modules are replaced
        clone._modules = {name: None if child is None else copied(child) for name, child in m._modules.items()}
        return clone

    return copied(module)
