"""CosyVoice3's silence cap: long runs of silent speech tokens never reach the flow.

Upstream `CosyVoiceModel.llm_job` counts consecutive tokens from the model's `silent_tokens`
(CosyVoice3: the FSQ silent and breath ids, dims.COSYVOICE3_SILENT_TOKENS; CosyVoice2: none) and
drops every one past the fifth until a non-silent token comes. Only what the flow renders changes:
the LM has already been fed every sampled token (its repetition window and KV cache see them all).
"""
from __future__ import annotations

import contextlib
from typing import AsyncIterator, Iterable

from ..models.dims import MAX_SILENT_RUN


class SilenceCap:
    """Per-utterance state: `keep(token)` says whether a token goes on to the flow."""

    def __init__(self, silent_tokens: Iterable[int], max_run: int = MAX_SILENT_RUN):
        self.silent = frozenset(silent_tokens)
        self.max_run = max_run
        self.run = 0  # silent tokens in a row so far
        self.dropped = 0

    def keep(self, token: int) -> bool:
        if token not in self.silent:
            self.run = 0
            return True
        self.run += 1
        if self.run > self.max_run:
            self.dropped += 1
            return False
        return True

    def filter(self, tokens: Iterable[int]) -> list[int]:
        return [t for t in tokens if self.keep(t)]


async def cap_silences(speech: AsyncIterator[list[int]], cap: SilenceCap) -> AsyncIterator[list[int]]:
    """The engine's token batches with over-long silent runs dropped (a batch that loses every token
    is skipped). Closing this closes `speech`, which aborts the LM request."""
    async with contextlib.aclosing(speech):
        async for batch in speech:
            kept = cap.filter(batch)
            if kept:
                yield kept
