"""One request's state inside the native engine."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from enum import Enum, auto

import torch
from torch import Tensor

from ..models.dims import SpeechIds
from ..models.llm import Part, prompt_parts
from .base import BistreamRequest, GenerationRequest
from .bistream import BistreamSchedule

EOS_ALWAYS_MASKED = 1 << 62  # a min_tokens no sequence reaches


class SeqStatus(Enum):
    WAITING = auto()   # queued, no KV slot yet
    RUNNING = auto()   # holds a slot: feeding input segments and decoding
    FINISHED = auto()  # done, aborted or failed; its slot is free again


@dataclass(eq=False)
class Sequence:
    """Guarded by the engine's lock (native.py): the event loop adds, aborts and feeds text, the step
    thread plans and commits; a step itself reads it outside the lock and fills `segment_embeds`.

    The LM input comes in segments (rows fed as a prefill, possibly over several steps) and single
    decode rows (the last sampled token). A plain request has one segment, its prompt; a bistream
    request gets a new segment from its `schedule` at the start, after each fill and when the text
    ends, and waits (takes no part in steps) while the schedule needs more text.
    """
    request: GenerationRequest | BistreamRequest
    outputs: asyncio.Queue  # lists of tokens, then None (end) or an exception
    schedule: BistreamSchedule | None = None  # bistream requests only
    generator: torch.Generator | None = None  # per-request RAS draws when the request has a seed
    ids: SpeechIds = SpeechIds.of("cosyvoice2")  # the model's special speech ids (its sos/task rows)
    status: SeqStatus = SeqStatus.WAITING
    slot: int = -1
    num_cached: int = 0  # positions written to the KV cache
    num_output: int = 0  # tokens handed to the consumer
    segment: tuple[Part, ...] | None = None  # input rows not all fed yet
    segment_start: int = 0  # position of the segment's first row
    segment_len: int = 0
    decoding: bool = False  # the last sampled token is the next input
    last_token: int = -1
    segment_embeds: Tensor | None = field(default=None, repr=False)

    def __post_init__(self):
        if isinstance(self.request, GenerationRequest):
            self.set_segment(prompt_parts(self.request.text_tokens, self.request.prompt_speech_tokens, self.ids))

    @property
    def request_id(self) -> str:
        return self.request.request_id

    def set_segment(self, parts: tuple[Part, ...]) -> None:
        self.segment, self.segment_start = parts, self.num_cached
        self.segment_len = sum(len(ids) for _, ids in parts)
        self.segment_embeds = None

    def end_segment(self) -> None:
        self.segment, self.segment_embeds = None, None

    @property
    def segment_end(self) -> int:
        return self.segment_start + self.segment_len

    @property
    def needs_prefill(self) -> bool:
        return self.segment is not None and self.num_cached < self.segment_end

    @property
    def context_len(self) -> int:
        """Cache positions the next decode step attends over (the fed token's included)."""
        return self.num_cached + 1

    @property
    def min_tokens(self) -> int:
        """EOS is masked while fewer tokens than this are sampled (bistream: while text streams)."""
        if self.schedule is None:
            return self.request.min_tokens
        return EOS_ALWAYS_MASKED if self.schedule.masks_eos else 0

    @property
    def forces_fill(self) -> bool:
        return self.schedule is not None and self.schedule.forces_fill

    @property
    def ignore_stop_tokens(self) -> bool:
        return self.schedule is None and self.request.ignore_stop_tokens
