"""Building a model's modules without initialising their weights.

Every parameter of our modules comes from a weight file, so the random init that `nn.Linear`,
`nn.Conv1d` and `nn.Embedding` run in their constructors is thrown away (seconds for the 0.5B LM on
a CPU). The loader (model_dir.build_models) builds the modules inside `empty_init()`, on the meta
device (shapes and dtypes, no memory, no init), assigns the file's tensors to them
(model_dir.load_strict) and then calls `finish_empty_init`, which computes the buffers that are no
file's (`ComputedBuffers`) and checks that no tensor was left on the meta device.

A module whose buffer is computed in its constructor and not stored in a weight file (a window
function, a frequency table) implements `ComputedBuffers`: it registers what `computed_buffers()`
returns, and `finish_empty_init` registers it again on the CPU. A tensor made in a constructor
without going through it is still on the meta device after `empty_init()`: `finish_empty_init`
names it. Random draws that must replay upstream's generator (CosyVoice3's NSF noise) happen on
the CPU explicitly (`torch.device("cpu")`), whatever the default device.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Protocol, runtime_checkable

import torch
from torch import Tensor, nn


@runtime_checkable
class ComputedBuffers(Protocol):
    def computed_buffers(self) -> dict[str, Tensor]:
        """Non-persistent buffers computed from the module's dims (on the default device)."""


def register_computed_buffers(module: nn.Module) -> None:
    """`module.computed_buffers()` registered as non-persistent buffers (from its constructor)."""
    for name, value in module.computed_buffers().items():
        module.register_buffer(name, value, persistent=False)


@contextlib.contextmanager
def empty_init() -> Iterator[None]:
    """Modules built inside have their parameters and buffers on the meta device, uninitialised."""
    with torch.device("meta"):
        yield


def meta_tensors(module: nn.Module) -> list[str]:
    """Names of the parameters, buffers and plain tensor attributes of `module` (and below) still on
    the meta device."""
    found = []
    for prefix, sub in module.named_modules():
        dot = f"{prefix}." if prefix else ""
        for name, value in vars(sub).items():
            if isinstance(value, Tensor) and value.is_meta:
                found.append(dot + name)
        found += [dot + name for name, value in sub._parameters.items() if value is not None and value.is_meta]
        found += [dot + name for name, value in sub._buffers.items() if value is not None and value.is_meta]
    return found


def finish_empty_init(module: nn.Module) -> nn.Module:
    """After the file's tensors were assigned to a module built in `empty_init()`: its computed
    buffers made on the CPU, then a check that nothing is left on the meta device (a bug in a
    module's constructor, not in the user's files: RuntimeError)."""
    with torch.device("cpu"):
        for sub in module.modules():
            if isinstance(sub, ComputedBuffers):
                register_computed_buffers(sub)
    left = meta_tensors(module)
    if left:
        raise RuntimeError(f"{type(module).__name__} built without init left {len(left)} tensor(s) unset "
                           f"({', '.join(left[:8])}): a tensor made in a constructor that is in no weight "
                           "file must come from computed_buffers()")
    return module
