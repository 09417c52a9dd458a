"""The protocol every speech-token engine implements (built-in and vLLM).

An engine turns one LM prompt into a stream of speech tokens (ids 0..6560). Stop ids
(6561/6562/6563) end the stream and are never yielded.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import AsyncIterator, Protocol, runtime_checkable

from ..models.dims import RASParams


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
class EngineStats:
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0  # fraction of KV capacity in use, 0..1


def length_limits(n_target_text_tokens: int, min_ratio: float = 2.0, max_ratio: float = 20.0) -> tuple[int, int]:
    """Upstream's rule: min/max speech tokens are 2x / 20x the target-text token count."""
    return int(n_target_text_tokens * min_ratio), int(n_target_text_tokens * max_ratio)


@runtime_checkable
class SpeechTokenEngine(Protocol):
    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def generate(self, request: GenerationRequest) -> AsyncIterator[list[int]]:
        """Async iterator of token batches for one request. Cancelling the consumer aborts it."""
        ...

    async def abort(self, request_id: str) -> None: ...

    async def wait_dead(self) -> str:
        """Return (a one-line reason) once the engine has died and can serve no more; it never
        returns while the engine is healthy or after a deliberate stop()."""
        ...

    def stats(self) -> EngineStats: ...
