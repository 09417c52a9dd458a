"""What a failed device call means to the requests in it: a CUDA out-of-memory error becomes
`DeviceOutOfMemory` (RESOURCE_EXHAUSTED / 503, a message naming the device's state) instead of an
INTERNAL "bug"; anything else is handed on as it is."""
from __future__ import annotations

import torch

from .errors import DeviceOutOfMemory


def device_error(error: BaseException) -> BaseException:
    """The exception the requests of a failed device call (an LLM step, a token2wav batch) get."""
    if isinstance(error, torch.OutOfMemoryError):
        first_line = str(error).split(". ", 1)[0].strip()
        wrapped = DeviceOutOfMemory(f"the device ran out of memory in a batch this request was part of "
                                    f"({first_line}); retry, or lower the server's concurrency")
        wrapped.__cause__ = error
        return wrapped
    return error
