"""Seeded inputs of a flow estimator call at any (batch, frames), shared by the estimator-backend
and regional-compile tests."""
from __future__ import annotations

import torch

from async_cosyvoice.estimator.onnx_export import dummy_inputs


def estimator_inputs(module, batch: int, frames: int, seed: int) -> tuple[torch.Tensor, ...]:
    """(x, mask, mu, t, spks, cond): random x / mu / cond / t from `seed`, every other row padded
    (a shorter valid length in its mask)."""
    x, mask, mu, t, spks, cond = dummy_inputs(module, batch, frames)
    g = torch.Generator().manual_seed(seed)
    x, mu, cond = (torch.randn(a.shape, generator=g) for a in (x, mu, cond))
    t = torch.rand(batch, generator=g)
    for b in range(1, batch, 2):  # every other row padded: shorter valid length
        mask[b, :, frames - frames // 3 - b:] = 0
    return x, mask, mu, t, spks, cond
