"""One request's state inside the native engine."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from enum import Enum, auto

import torch
from torch import Tensor

from .base import GenerationRequest


class SeqStatus(Enum):
    WAITING = auto()   # queued, no KV slot yet
    RUNNING = auto()   # holds a slot: prefilling, then decoding
    FINISHED = auto()  # done, aborted or failed; its slot is free again


@dataclass(eq=False)
class Sequence:
    """Owned by the event-loop thread, except `prompt_embeds`, which the step thread fills."""
    request: GenerationRequest
    outputs: asyncio.Queue  # lists of tokens, then None (end) or an exception
    generator: torch.Generator | None = None  # per-request RAS draws when the request has a seed
    status: SeqStatus = SeqStatus.WAITING
    slot: int = -1
    num_cached: int = 0  # prompt positions already written to the KV cache
    num_output: int = 0  # tokens handed to the consumer
    prompt_embeds: Tensor | None = field(default=None, repr=False)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def prompt_len(self) -> int:
        return len(self.request.text_tokens) + len(self.request.prompt_speech_tokens) + 2

    @property
    def prefilled(self) -> bool:
        return self.num_cached == self.prompt_len

    @property
    def context_len(self) -> int:
        """Cache positions the next decode step attends over (the fed token's included)."""
        return self.prompt_len + self.num_output
