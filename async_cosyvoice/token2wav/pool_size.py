"""How many stream slots a state pool (state_pool.py) gets: checked against the device's memory
before anything is allocated, so a pool too large fails start with one line that says what fits,
instead of a CUDA out-of-memory error (or a server that runs out at 64 streams).

The pool may take `fraction` of the memory free when it is built (token2wav.flow_cache_memory_fraction);
the rest stays for the CUDA graphs' memory pools, the calls' activations and HiFT. `slots: auto`
takes the largest count that fits.
"""
from __future__ import annotations

import os

import torch

__all__ = ["PoolTooLarge", "free_memory", "stream_slots"]

GiB = 2**30


class PoolTooLarge(ValueError):
    """The configured state pool does not fit the device."""


def stream_slots(requested: int | str, *, slot_bytes: int, speaker_slots: int, free_bytes: int, fraction: float,
                 slot_tokens: int, max_slots: int | None = None) -> int:
    """The stream slots of a pool whose slots (1 scratch + stream slots + `speaker_slots`) are
    `slot_bytes` each, within `fraction` of `free_bytes`: `requested`, checked, or for "auto" the
    largest count that fits (at most `max_slots`). Raises PoolTooLarge naming the settings."""
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction must be in (0, 1], got {fraction}")
    fits = int(free_bytes * fraction) // slot_bytes - 1 - speaker_slots
    what = (f"{slot_bytes / GiB:.2f} GiB per {slot_tokens}-token slot (token2wav.flow_cache_slot_tokens), "
            f"plus 1 scratch and {speaker_slots} speaker slot(s) (flow_cache_speaker_bytes); the pool may take "
            f"{fraction:g} of the {free_bytes / GiB:.1f} GiB free (flow_cache_memory_fraction)")
    if fits < 1:
        raise PoolTooLarge(f"token2wav.flow_cache_slots: not even one slot fits: {what}; lower "
                           "flow_cache_slot_tokens or flow_cache_speaker_bytes, or set flow_cache_slots: null")
    if requested == "auto":
        return fits if max_slots is None else min(fits, max_slots)
    if requested > fits:
        raise PoolTooLarge(f"token2wav.flow_cache_slots: {requested} slots need "
                           f"{(requested + 1 + speaker_slots) * slot_bytes / GiB:.1f} GiB: {what}; at most "
                           f"{fits} fit: lower flow_cache_slots or flow_cache_slot_tokens, or set flow_cache_slots: auto")
    return requested


def free_memory(device: torch.device) -> int:
    """Bytes free on `device` now: the CUDA device's, or the host's available memory."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
