"""The protocol every speech-token engine implements (built-in and vLLM).

An engine turns one LM prompt into a stream of speech tokens (ids 0..6560). Stop ids
(6561/6562/6563) end the stream and are never yielded. Engines with `supports_bistream` also
take the text itself as a stream (`generate_bistream`, CosyVoice2's bistream mode, facts §2.7).
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import AsyncIterator, Awaitable, Protocol, Sequence, runtime_checkable

from ..models.dims import RASParams
from ..stage_stats import StageStats


@dataclass(frozen=True)
class GenerationRequest:
    """One LM generation. The prompt is typed ids, embedded by the engine as
    [llm_embedding[sos]; embed_tokens(text_tokens); llm_embedding[task]; speech_embedding(prompt_speech_tokens)].
    """
    request_id: str
    text_tokens: tuple[int, ...]           # prompt text ++ target text (Qwen ids)
    prompt_speech_tokens: tuple[int, ...]  # speech ids 0..6560 (may be empty)
    min_tokens: int                        # EOS (6561 only) is masked before this many tokens
    max_tokens: int
    ras: RASParams = field(default_factory=RASParams)
    seed: int | None = None
    ignore_stop_tokens: bool = False       # benchmarks: never stop before max_tokens

    def __post_init__(self):
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")


@dataclass(frozen=True)
class BistreamRequest:
    """One bistream generation: the prompt is given up front, the target text arrives as a stream
    of Qwen token-id pieces (`SpeechTokenEngine.generate_bistream`).

    Upstream's bistream loop has no length rules: EOS is masked while text streams and allowed
    from the moment it ends (no min length), and nothing bounds the output. `max_tokens` is ours,
    a safety bound on the speech tokens yielded (fills excluded); reaching it ends the stream.
    `training_consistent` selects the training layout instead of upstream's inference loop
    (engine/bistream.py says how they differ).
    """
    request_id: str
    prompt_text_tokens: tuple[int, ...]    # normalized prompt transcript / instruct text (Qwen ids)
    prompt_speech_tokens: tuple[int, ...]  # speech ids 0..6560 (may be empty)
    max_tokens: int
    ras: RASParams = field(default_factory=RASParams)
    seed: int | None = None
    training_consistent: bool = False
    # CosyVoice3: how many leading prompt_text_tokens (through <|endofprompt|>) go in with sos
    system_prompt_len: int = 0

    def __post_init__(self):
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")


@dataclass(frozen=True)
class EngineStats:
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0  # fraction of KV capacity in use, 0..1


def length_limits(n_target_text_tokens: int, min_ratio: float = 2.0, max_ratio: float = 20.0) -> tuple[int, int]:
    """Upstream's rule: min/max speech tokens are 2x / 20x the target-text token count."""
    return int(n_target_text_tokens * min_ratio), int(n_target_text_tokens * max_ratio)


@runtime_checkable
class SpeechTokenEngine(Protocol):
    supports_bistream: bool  # whether generate_bistream works (else it raises Unsupported)
    # busy-time counters of the engine's step thread (steps, rows, seconds); None when the engine
    # steps where we cannot time it
    stage_stats: StageStats | None
    # of those, the steps that fed prompt rows (a prefill, alone or beside decode rows): their seconds and
    # prompt rows; None where stage_stats is
    prefill_stats: StageStats | None

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def generate(self, request: GenerationRequest) -> AsyncIterator[list[int]]:
        """Async iterator of token batches for one request. Cancelling the consumer aborts it."""
        ...

    def generate_bistream(self, request: BistreamRequest,
                          text: AsyncIterator[Sequence[int]]) -> AsyncIterator[list[int]]:
        """Async iterator of speech-token batches while `text` yields the target text as pieces of
        Qwen token ids (each client piece tokenized on its own); the end of `text` is the end of
        the text. An error raised by `text` ends the request and is raised to the consumer.
        Cancelling the consumer aborts the request."""
        ...

    async def abort(self, request_id: str) -> None: ...

    async def wait_dead(self) -> str:
        """Return (a one-line reason) once the engine has died and can serve no more; it never
        returns while the engine is healthy or after a deliberate stop()."""
        ...

    def stats(self) -> EngineStats: ...


async def first_death(*waits: Awaitable[str]) -> str:
    """The reason of whichever of several `wait_dead`s returns first (the others are cancelled)."""
    tasks = [asyncio.ensure_future(w) for w in waits]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        return done.pop().result()
    finally:
        for t in tasks:
            t.cancel()
