"""A device's out-of-memory error reaches the requests of the failed batch as DeviceOutOfMemory:
RESOURCE_EXHAUSTED / 503 `device_out_of_memory` on every door, not INTERNAL (a bug). The CosyVoice3
run on an 80 GB H100 (docs/perf/h100-cosyvoice3-server/) failed its requests with CUDA OOM as
INTERNAL. CPU allocations do not raise torch.OutOfMemoryError, so the error is built here as
torch raises it (its message as seen on the H100)."""
from __future__ import annotations

import torch

from async_cosyvoice.device_errors import device_error
from async_cosyvoice.errors import DeviceOutOfMemory, status_of

H100_MESSAGE = ("CUDA out of memory. Tried to allocate 16.00 MiB. GPU 0 has a total capacity of 79.18 GiB of which "
                "8.12 MiB is free. Including non-PyTorch memory, this process has 79.16 GiB memory in use.")


def test_out_of_memory_is_resource_exhausted_with_the_devices_words():
    oom = torch.OutOfMemoryError(H100_MESSAGE)
    error = device_error(oom)
    assert isinstance(error, DeviceOutOfMemory) and error.__cause__ is oom
    assert "CUDA out of memory" in str(error) and "lower the server's concurrency" in str(error)
    status = status_of(error)
    assert (status.grpc, status.http, status.code) == ("RESOURCE_EXHAUSTED", 503, "device_out_of_memory")


def test_other_failures_pass_through_unchanged():
    bug = ValueError("shape mismatch")
    assert device_error(bug) is bug
    assert status_of(bug).grpc == "INTERNAL"
