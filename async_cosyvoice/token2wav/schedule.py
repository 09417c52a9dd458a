"""The streaming chunk schedule: hop sizes in speech tokens, the HiFT carry sizes, and the
service's adaptive hop (pure arithmetic; see `stream.py` for how a stream applies it)."""
from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["ChunkSchedule", "adaptive_hop"]


@dataclass(frozen=True)
class ChunkSchedule:
    """Streaming chunk sizes in speech tokens, and the HiFT cache sizes.

    Upstream: first_hop 25, max_hop 100 (4 x 25), doubling after each chunk; our service
    starts at 15 for a faster first chunk.
    """
    first_hop: int = 25
    max_hop_multiple: int = 4
    hop_scale: int = 2
    pre_lookahead: int = 3        # flow.pre_lookahead_len
    prompt_align: int | None = None  # pad the first hop so P + hop is a multiple of this; None: first_hop
    token_mel_ratio: int = 2
    mel_cache_len: int = 8        # mel frames carried between HiFT calls
    samples_per_frame: int = 480  # HiFT samples per mel frame

    def __post_init__(self):
        for name in ("first_hop", "max_hop_multiple", "hop_scale", "token_mel_ratio", "mel_cache_len",
                     "samples_per_frame"):
            if getattr(self, name) < 1:
                raise ValueError(f"ChunkSchedule.{name} must be >= 1, got {getattr(self, name)}")
        if self.pre_lookahead < 0:
            raise ValueError(f"ChunkSchedule.pre_lookahead must be >= 0, got {self.pre_lookahead}")
        if self.prompt_align is not None and self.prompt_align < 1:
            raise ValueError(f"ChunkSchedule.prompt_align must be >= 1 or None, got {self.prompt_align}")

    @property
    def max_hop(self) -> int:
        return self.first_hop * self.max_hop_multiple

    @property
    def source_cache_len(self) -> int:
        return self.mel_cache_len * self.samples_per_frame

    def first_hop_pad(self, n_prompt_tokens: int) -> int:
        align = self.prompt_align or self.first_hop
        return math.ceil(n_prompt_tokens / align) * align - n_prompt_tokens




def adaptive_hop(schedule: ChunkSchedule, grown_hop: int, pending: int, lead_s: float, chunk_s: float,
                 token_s: float) -> int:
    """The service's next streaming hop (tokens), chosen from how far ahead of the listener we are.

    grown_hop: what upstream's rule would take next (the previous hop doubled, capped).
    pending: target tokens generated but not yet rendered. lead_s: audio already sent that has
    not been played yet. chunk_s: recent compute time of one chunk; token_s: recent time per LLM token.

    When the buffer is comfortable (it covers twice the wait for the grown hop's tokens plus a
    chunk) take the grown hop; otherwise render what is already pending at once (at least
    first_hop, at most max_hop) instead of waiting for more tokens. (This rule was tuned when every
    chunk re-ran the flow over the whole prefix; with the flow cache a chunk costs its new frames,
    and the rule has not been re-measured since.)
    """
    wait_s = max(0, grown_hop + schedule.pre_lookahead - pending) * token_s
    if lead_s > 2 * (wait_s + chunk_s):
        return grown_hop
    ready = pending - schedule.pre_lookahead
    return max(schedule.first_hop, min(schedule.max_hop, ready))
