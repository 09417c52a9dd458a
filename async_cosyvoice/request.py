"""The types that flow through the service: what a caller asks for and what it gets back.

A leaf module (it imports only `errors`), so every layer (frontend, engine, token2wav,
synthesizer, transports) can use these types without an import circle.

- `Mode` says which conditioning a request uses; `Audio` is mono float samples at a rate.
- `Voice` is a prepared voice (prompt speech tokens, 24 kHz prompt mel, speaker embedding, the
  prompt transcript and its token ids): the one type for an encoded prompt, a registered speaker
  and an imported `spk2info.pt` entry. It validates itself once, at construction.
- `SynthesisOptions` / `SynthesisRequest` go in, `AudioChunk`s come out.
"""
from __future__ import annotations

import enum
import uuid
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from .errors import InvalidRequest


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


VoiceKind = Literal["zero_shot", "sft"]
VOICE_KINDS: tuple[str, ...] = ("zero_shot", "sft")
N_MELS = 80


def _frozen(value, dtype, ndim: int, name: str) -> np.ndarray:
    arr = np.asarray(value)
    if arr.size == 0 and arr.ndim != ndim:
        arr = arr.reshape((0,) if ndim == 1 else (0, N_MELS))
    if arr.ndim != ndim:
        raise InvalidRequest(f"{name} must have {ndim} dimension(s), got shape {arr.shape}")
    if np.issubdtype(dtype, np.integer) and arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise InvalidRequest(f"{name} must be integer, got {arr.dtype}")
    arr = np.array(arr, dtype=dtype, order="C", copy=True)
    arr.flags.writeable = False
    return arr


@dataclass(frozen=True, eq=False)
class Voice:
    """What a voice contributes to synthesis.

    speech_tokens int32 [P] and speech_feat float32 [T, 80] (the 24 kHz prompt mel; T == 2P once
    `aligned`, which every LM mode uses), embedding float32 [192] (CAM++), prompt_text (the
    normalised transcript, "" when there is none) and its LM token ids. `kind` "sft" is an
    embedding-only voice (upstream sft speakers): no tokens, mel or transcript. Arrays are copied,
    coerced to their dtypes and made read-only.
    """
    speech_tokens: np.ndarray
    speech_feat: np.ndarray
    embedding: np.ndarray
    prompt_text: str = ""
    prompt_text_tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    kind: VoiceKind = "zero_shot"

    def __post_init__(self):
        if self.kind not in VOICE_KINDS:
            raise InvalidRequest(f"voice kind must be one of {VOICE_KINDS}, got {self.kind!r}")
        if not isinstance(self.prompt_text, str):
            raise InvalidRequest("prompt_text must be a string")
        for name, dtype, ndim in (("speech_tokens", np.int32, 1), ("speech_feat", np.float32, 2),
                                  ("embedding", np.float32, 1), ("prompt_text_tokens", np.int32, 1)):
            object.__setattr__(self, name, _frozen(getattr(self, name), dtype, ndim, name))
        if self.embedding.size == 0:
            raise InvalidRequest("embedding is empty")
        if not np.all(np.isfinite(self.embedding)):
            raise InvalidRequest("embedding has non-finite values")
        if not np.all(np.isfinite(self.speech_feat)):
            raise InvalidRequest("speech_feat has non-finite values")
        if self.kind == "zero_shot":
            if self.speech_tokens.size == 0 or self.speech_feat.shape[0] < 2:
                raise InvalidRequest("a zero_shot voice needs prompt speech tokens and mel frames")
        elif self.speech_tokens.size or self.speech_feat.size or self.prompt_text_tokens.size or self.prompt_text:
            raise InvalidRequest("an sft voice carries the embedding only")

    @classmethod
    def embedding_only(cls, embedding) -> "Voice":
        """A voice known only by its embedding (sft speakers)."""
        return cls(np.zeros(0, np.int32), np.zeros((0, N_MELS), np.float32), embedding, kind="sft")

    @property
    def n_tokens(self) -> int:
        return int(self.speech_tokens.shape[0])

    @property
    def is_aligned(self) -> bool:
        return self.speech_feat.shape[0] == 2 * self.n_tokens

    def aligned(self, token_mel_ratio: int = 2) -> "Voice":
        """Truncate to token_len = min(frames // ratio, P) tokens and ratio * token_len frames
        (upstream `frontend_zero_shot`: the flow needs exactly `ratio` frames per prompt token)."""
        n = min(self.speech_feat.shape[0] // token_mel_ratio, self.n_tokens)
        if n == self.n_tokens and self.speech_feat.shape[0] == token_mel_ratio * n:
            return self
        return Voice(self.speech_tokens[:n], self.speech_feat[: token_mel_ratio * n], self.embedding,
                     self.prompt_text, self.prompt_text_tokens, self.kind)

    def with_transcript(self, prompt_text: str, prompt_text_tokens) -> "Voice":
        return Voice(self.speech_tokens, self.speech_feat, self.embedding, prompt_text, prompt_text_tokens, self.kind)

    def same_data(self, other: "Voice") -> bool:
        return (self.kind == other.kind and self.prompt_text == other.prompt_text
                and all(np.array_equal(getattr(self, n), getattr(other, n))
                        for n in ("prompt_text_tokens", "speech_tokens", "speech_feat", "embedding")))


SEED_MAX = 2**64 - 1  # seeds are unsigned 64-bit integers (RequestRules refuses others)


def derived_seed(seed: int, stride: int, offset: int) -> int:
    """`seed * stride + offset` folded to 64 bits: the seed of one generator of a request (one per
    text segment, chunk, ...) for any request seed up to SEED_MAX; torch generators take 64 bits."""
    return (seed * stride + offset) & SEED_MAX


@dataclass(frozen=True)
class SynthesisOptions:
    """Per-request options. None means: the service's configured default."""
    stream: bool = False
    speed: float = 1.0             # non-streaming only (upstream rule)
    text_frontend: bool = True     # normalize + split the text like upstream
    seed: int | None = None        # 0..SEED_MAX
    first_hop: int | None = None   # speech tokens in the first streamed chunk (config token2wav.first_hop)
    top_k: int | None = None       # RAS override (1 = greedy)
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


class _Flush:
    """Marker in a text stream: synthesize what is buffered now, without waiting for a sentence end."""

    def __repr__(self) -> str:
        return "FLUSH"


FLUSH = _Flush()


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
    segment_tokens: tuple[int, ...] = ()  # on a segment's last chunk: the speech tokens it rendered
    timeline: "Timeline | None" = None    # on a segment's last chunk: that segment's timeline

    @property
    def first_segment_timeline(self) -> "Timeline | None":
        """The first text segment's timeline, on that segment's last chunk (what a request's first
        chunk went through); None on every other chunk."""
        return self.timeline if self.segment_index == 0 else None


@dataclass
class ChunkTiming:
    """One chunk's trip through token2wav (time.monotonic seconds; 0 = not yet)."""
    queued: float = 0.0    # submitted to the device batcher
    started: float = 0.0   # its batch started on the device
    done: float = 0.0      # samples back on the event loop
    n_samples: int = 0


@dataclass(frozen=True)
class FirstChunkParts:
    """Where a first chunk's time went (seconds): `tokens` from submission until its speech tokens
    were there (LM prefill and steps), `wait` for a token2wav batch to take it, `t2w` its batch;
    the three add up to the first chunk. `first_token`, a part of `tokens`: until the first speech
    token reached the request (waiting for the LM, its prefill, the step that samples it); the rest
    of `tokens` is the decode steps to the first hop."""
    tokens: float
    wait: float
    t2w: float
    first_token: float

    def __str__(self) -> str:  # the request log lines' first_chunk_parts (ms)
        return (f"tokens:{self.tokens * 1e3:.1f},wait:{self.wait * 1e3:.1f},t2w:{self.t2w * 1e3:.1f},"
                f"first_token:{self.first_token * 1e3:.1f}")


@dataclass
class Timeline:
    """One utterance (text segment) from submission to its last chunk; metrics, logs and bench read it."""
    submitted: float
    first_token: float = 0.0
    finished: float = 0.0
    n_tokens: int = 0
    chunks: list[ChunkTiming] = field(default_factory=list)

    @property
    def first_chunk_s(self) -> float | None:
        return self.chunks[0].done - self.submitted if self.chunks and self.chunks[0].done else None

    def first_chunk_parts(self) -> FirstChunkParts | None:
        """Where the first chunk's time went; None if it was not rendered."""
        c = self.chunks[0] if self.chunks else None
        if c is None or not (c.queued and c.started and c.done):
            return None
        first_token = (self.first_token or c.queued) - self.submitted  # no LM (voice conversion): its tokens
        return FirstChunkParts(c.queued - self.submitted, c.started - c.queued, c.done - c.started, first_token)
