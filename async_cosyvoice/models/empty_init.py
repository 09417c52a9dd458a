"""Building a model's modules without initialising their weights.

Every parameter of our modules comes from a weight file, so the random init that `nn.Linear`,
`nn.Conv1d` and `nn.Embedding` run in their constructors is thrown away (seconds for the 0.5B LM on
a CPU). The loader (model_dir.build_models) builds the modules inside `empty_init()`, on the meta
device (shapes and dtypes, no memory, no init), assigns the file's tensors to them
(model_dir.load_strict) and then calls `finish_empty_init`, which checks that no tensor was left
on the meta device.

So a tensor that a constructor computes and no weight file holds (HiFT's iSTFT window) is made on
the CPU explicitly (`device="cpu"`), and random draws that replay upstream's generator
(CosyVoice3's NSF noise) run under `torch.device("cpu")`: else they would be meta tensors, or
draw nothing. `finish_empty_init` names any tensor that was missed.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

# what constructors call to fill a new parameter; on a meta tensor there is nothing to fill
_INITS = frozenset({
    nn.init.uniform_, nn.init.normal_, nn.init.trunc_normal_, nn.init.constant_, nn.init.ones_, nn.init.zeros_,
    nn.init.eye_, nn.init.dirac_, nn.init.xavier_uniform_, nn.init.xavier_normal_, nn.init.kaiming_uniform_,
    nn.init.kaiming_normal_, nn.init.orthogonal_, nn.init.sparse_,
    Tensor.uniform_, Tensor.normal_, Tensor.erfinv_, Tensor.fill_, Tensor.zero_,
})


class _SkipInitOnMeta(TorchFunctionMode):
    """Init calls on meta tensors return at once. Running them would cost nothing but time: torch's
    meta `normal_` (nn.Embedding's init) is Python code whose first call imports torch._dynamo
    (over a second), which a server that compiles nothing never needs."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _INITS:
            tensor = args[0] if args else kwargs.get("tensor")
            if isinstance(tensor, Tensor) and tensor.is_meta:
                return tensor
        return func(*args, **kwargs)


@contextlib.contextmanager
def empty_init() -> Iterator[None]:
    """Modules built inside have their parameters and buffers on the meta device, uninitialised."""
    with _SkipInitOnMeta(), torch.device("meta"):
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
    """After the file's tensors were assigned to a module built in `empty_init()`: check that nothing
    is left on the meta device (a constructor's bug, not the user's files: RuntimeError)."""
    left = meta_tensors(module)
    if left:
        raise RuntimeError(f"{type(module).__name__} built without init left {len(left)} tensor(s) unset "
                           f"({', '.join(left[:8])}): a tensor made in a constructor that is in no weight "
                           "file must be made on the CPU explicitly (device=\"cpu\")")
    return module
