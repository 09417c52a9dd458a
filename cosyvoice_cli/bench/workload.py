"""What a sweep sends: every request's text, speaker (and the prompt it is registered from), seed
and forced token count, and how many requests each concurrency level sends."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Mapping, Sequence

import numpy as np

if TYPE_CHECKING:
    from async_cosyvoice.request import Audio

SECONDS_PER_TOKEN = 0.04  # 25 speech tokens per second
DEFAULT_TEXT = ("The quick brown fox jumps over the lazy dog, and the morning train "
                "leaves the station on time.")
DEFAULT_PROMPT_TEXT = "This is a synthetic prompt recorded for the benchmark, nothing more."
DEFAULT_SPEAKER = "bench"


@dataclass(frozen=True)
class Workload:
    text: str = DEFAULT_TEXT
    speaker_id: str = DEFAULT_SPEAKER
    tokens: int | None = None     # forced speech tokens per request (EOS ignored), None: model decides
    stream: bool = True
    seed: int = 0                 # request i of a level uses seed + i
    first_hop: int | None = None  # None: the synthesizer's default

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def requests_per_level(levels: Sequence[int], requests: int | Sequence[int] | Mapping[int, int]) -> dict[int, int]:
    """An int (the same for every level), a list matching `levels`, or a mapping level -> count;
    a level always gets at least `concurrency` requests."""
    if isinstance(requests, int):
        counts = {c: requests for c in levels}
    elif isinstance(requests, Mapping):
        counts = {c: int(requests[c]) for c in levels}
    else:
        requests = list(requests)
        if len(requests) != len(levels):
            raise ValueError(f"{len(requests)} request counts for {len(levels)} concurrency levels")
        counts = dict(zip(levels, requests))
    return {c: max(int(n), c) for c, n in counts.items()}


def synthetic_prompt(seconds: float = 6.0, sample_rate: int = 16000, seed: int = 0) -> "Audio":
    """A speech-like test signal: a harmonic voice with a wandering pitch, syllable-rate
    amplitude bursts and a little noise. Deterministic for a seed."""
    from async_cosyvoice.request import Audio

    rng = np.random.default_rng(seed)
    n = int(round(seconds * sample_rate))
    t = np.arange(n) / sample_rate
    f0 = 150 + 30 * np.sin(2 * np.pi * 0.7 * t) + 10 * np.sin(2 * np.pi * 3.1 * t + 1.0)
    phase = 2 * np.pi * np.cumsum(f0) / sample_rate
    voice = sum(np.sin(k * phase) / k for k in range(1, 12))
    envelope = np.clip(np.sin(2 * np.pi * 4.0 * t + rng.uniform(0, 2 * np.pi)), 0, None) ** 0.5
    x = 0.25 * voice * envelope + 0.01 * rng.standard_normal(n)
    x = 0.5 * x / max(1e-6, float(np.abs(x).max()))
    return Audio(x.astype(np.float32), sample_rate)


@dataclass(frozen=True)
class SpeakerSpec:
    speaker_id: str = DEFAULT_SPEAKER
    register: bool = True            # False: use a speaker already in the store / on the server
    prompt_wav: Path | None = None   # None: a generated prompt of prompt_seconds
    prompt_text: str = DEFAULT_PROMPT_TEXT
    prompt_seconds: float = 6.0
    seed: int = 0

    def audio(self) -> "Audio":
        if self.prompt_wav is not None:
            from async_cosyvoice.frontend.audio import load_audio
            return load_audio(self.prompt_wav)
        return synthetic_prompt(self.prompt_seconds, seed=self.seed)
