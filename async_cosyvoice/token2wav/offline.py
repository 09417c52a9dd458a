"""Offline token2wav: whole non-streaming utterances rendered in length-sorted, padded batches.

A non-streaming utterance is one token2wav job (its Token2WavStream's only, final job: the flow
over prompt + all tokens with full attention, then HiFT over the whole mel, upstream's
non-streaming `token2wav`). `render_offline` computes many such jobs at once:

    flow:  jobs sorted by prompt + target tokens, cut into `padded_groups` (at most max_batch
           items and max_frames padded mel frames each, lengths within length_ratio); one padded
           `Flow.forward` per group (runner.flow_mels: masks make each item its own call)
    mel:   stream.hift_input (the target part, `speed` resampling) per job
    HiFT:  jobs sorted by mel frames, cut the same way; each group one call
           (hift_graphs.render_group: equal lengths one `HiFT.inference`, any other group one
           `HiFT.inference_padded`, exact for padded items; a CUDA graph where its bucket fits)
    out:   stream.finish per job (no cache: the whole utterance at once)

Every item equals its own one-at-a-time render up to float summation order: the flow noise is
the fixed noise indexed from frame 0 of each item (as in a call of its own), and each item's NSF
noise comes from its own stream's NSFNoise, drawn at its own length.
"""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch import Tensor

from .hift_graphs import render_group
from .runner import ChunkRecord, Token2WavRunner
from .stream import Token2WavJob


@dataclass(frozen=True)
class OfflineLimits:
    """How offline batches are cut (token2wav.offline_* in the config)."""
    max_batch: int = 64           # items per flow / HiFT call
    max_frames: int = 65536       # padded mel frames per call (items x the longest, prompt included for the flow)
    length_ratio: float = 1.5     # items of one call are within this length ratio (padding < 1 - 1/ratio)

    def __post_init__(self):
        if self.max_batch < 1 or self.max_frames < 1:
            raise ValueError(f"max_batch and max_frames must be >= 1, got {self.max_batch}, {self.max_frames}")
        if self.length_ratio < 1:
            raise ValueError(f"length_ratio must be >= 1, got {self.length_ratio}")


@dataclass
class OfflineStats:
    """What offline rendering has done (cumulative)."""
    jobs: int = 0
    flow_calls: int = 0
    hift_calls: int = 0
    flow_s: float = 0.0           # device-thread seconds in the flow (synchronized on CUDA)
    hift_s: float = 0.0           # ... in HiFT and finishing
    flow_frames: int = 0          # mel frames rendered by the flow (prompt + target)
    flow_padded_frames: int = 0   # frames of the padded flow batches
    flow_batches: Counter = field(default_factory=Counter)  # batch size -> calls
    hift_batches: Counter = field(default_factory=Counter)

    def to_json(self) -> dict:
        return {"jobs": self.jobs, "flow_calls": self.flow_calls, "hift_calls": self.hift_calls,
                "flow_s": self.flow_s, "hift_s": self.hift_s, "flow_frames": self.flow_frames,
                "flow_padded_frames": self.flow_padded_frames,
                "flow_batch_sizes": {str(k): v for k, v in sorted(self.flow_batches.items())},
                "hift_batch_sizes": {str(k): v for k, v in sorted(self.hift_batches.items())}}


def padded_groups(lengths: Sequence[int], limits: OfflineLimits) -> list[list[int]]:
    """Indices of `lengths`, longest first, cut into groups: a group takes the next item while it
    has fewer than max_batch items, (items + 1) x its longest <= max_frames, and the item is at
    least its longest / length_ratio. A single item longer than max_frames is a group of its own."""
    groups: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        if groups:
            g = groups[-1]
            longest = lengths[g[0]]
            if (len(g) < limits.max_batch and (len(g) + 1) * longest <= limits.max_frames
                    and lengths[i] * limits.length_ratio >= longest):
                g.append(i)
                continue
        groups.append([i])
    return groups


def is_offline_job(job: Token2WavJob) -> bool:
    """A non-streaming utterance's one job: everything at once, full attention, nothing cached."""
    return job.finalize and not job.streaming and job.token_offset == 0 and not job.stream.stream


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


@torch.no_grad()
def render_offline(runner: Token2WavRunner, jobs: Sequence[Token2WavJob], limits: OfflineLimits = OfflineLimits(),
                   stats: OfflineStats | None = None) -> list[Tensor]:
    """Compute offline jobs (`is_offline_job`) of distinct streams, apply each to its stream and
    return each job's samples (1-D float32, CPU), in the order of `jobs`. Runs in the device thread."""
    for job in jobs:
        if not is_offline_job(job):
            raise ValueError(f"job {job.index} of its stream is not a whole non-streaming utterance")
        job.stream._check(job)
    if len({id(j.stream) for j in jobs}) != len(jobs):
        raise ValueError("render_offline takes one job per stream")
    stats = stats if stats is not None else OfflineStats()
    if not jobs:
        return []
    device, ratio = runner.device, jobs[0].stream.schedule.token_mel_ratio
    with runner.cuda_stream():
        t = time.perf_counter()
        flow_mels: list[Tensor | None] = [None] * len(jobs)
        lengths = [j.stream.prompt_token.shape[1] + j.n_tokens for j in jobs]
        for group in padded_groups([ratio * n for n in lengths], limits):
            for i, mel in zip(group, runner.flow_mels([jobs[i] for i in group])):
                flow_mels[i] = mel
            stats.flow_calls += 1
            stats.flow_batches[len(group)] += 1
            stats.flow_frames += sum(ratio * lengths[i] for i in group)
            stats.flow_padded_frames += len(group) * ratio * lengths[group[0]]
        _sync(device)
        stats.flow_s += time.perf_counter() - t

        t = time.perf_counter()
        inputs = [job.stream.hift_input(job, mel)[0] for job, mel in zip(jobs, flow_mels)]
        frames = [mel.shape[2] for mel in inputs]
        hift_out: list[tuple[Tensor, Tensor]] = [None] * len(jobs)  # type: ignore[list-item]
        for group in padded_groups(frames, limits):
            group_out = render_group(runner.hift, runner.hift_graphs, [inputs[i] for i in group],
                                     [None] * len(group), [jobs[i].stream.noise for i in group], [True] * len(group))
            for i, out in zip(group, group_out):
                hift_out[i] = out
            stats.hift_calls += 1
            stats.hift_batches[len(group)] += 1
        outs = []
        for job, flow_mel, mel, (speech, source) in zip(jobs, flow_mels, inputs, hift_out):
            out = job.stream.finish(job, mel, speech, source)
            if runner.recorder is not None:
                runner.recorder(ChunkRecord(
                    n_tokens=job.n_tokens, token_offset=job.token_offset, finalize=True, flow_streaming=False,
                    flow_mel=flow_mel, hift_in_mel=mel, hift_in_cache_source=mel.new_zeros(1, 1, 0),
                    hift_speech=speech, hift_source=source, out=out.reshape(1, -1)))
            outs.append(out.cpu())
        stats.hift_s += time.perf_counter() - t
        stats.jobs += len(jobs)
    return outs

