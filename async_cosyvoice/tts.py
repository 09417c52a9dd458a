"""Synthesizer: one async generator per request, every mode as data.

(Interface first; the implementation lands with the synthesizer issue.)
"""
from __future__ import annotations

import enum
import uuid
from dataclasses import dataclass, field

import numpy as np


class Mode(str, enum.Enum):
    ZERO_SHOT = "zero_shot"                      # prompt text + prompt audio
    CROSS_LINGUAL = "cross_lingual"              # prompt audio
    INSTRUCT2 = "instruct2"                      # instruction + prompt audio
    SFT = "sft"                                  # stored speaker embedding only
    ZERO_SHOT_BY_SPK_ID = "zero_shot_by_spk_id"  # stored zero-shot speaker
    INSTRUCT2_BY_SPK_ID = "instruct2_by_spk_id"  # instruction + stored speaker
    VC = "vc"                                    # source audio + prompt audio, no LLM


@dataclass(frozen=True)
class Audio:
    """Mono float32 samples in [-1, 1] at `sample_rate`."""
    samples: np.ndarray
    sample_rate: int

    @property
    def seconds(self) -> float:
        return len(self.samples) / self.sample_rate


@dataclass(frozen=True)
class SynthesisOptions:
    stream: bool = False
    speed: float = 1.0           # non-streaming only (upstream rule)
    text_frontend: bool = True   # normalize + split the text like upstream
    seed: int | None = None
    first_hop: int = 15          # speech tokens in the first streamed chunk (upstream: 25)
    top_k: int | None = None     # RAS override (1 = greedy)
    max_tokens: int | None = None  # benchmarks: force a token count (EOS ignored until then)


@dataclass(frozen=True)
class SynthesisRequest:
    mode: Mode
    text: str = ""
    prompt_text: str = ""
    prompt_audio: Audio | None = None
    instruct_text: str = ""
    speaker_id: str = ""
    source_audio: Audio | None = None
    options: SynthesisOptions = field(default_factory=SynthesisOptions)
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)


@dataclass
class AudioChunk:
    samples: np.ndarray          # float32 mono
    sample_rate: int
    index: int                   # 0, 1, 2, ... across all text segments
    is_final: bool
    sample_offset: int           # samples emitted before this chunk
    segment_index: int = 0
    n_tokens: int = 0            # speech tokens this chunk covers (final chunk: total of the request)
    elapsed_s: float = 0.0       # seconds since the request started when this chunk was ready
