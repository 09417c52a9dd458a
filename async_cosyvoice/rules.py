"""The request rule book: every check a synthesis request must pass, in one place.

`RequestRules.check(request)` rejects what no mode can serve with an `InvalidRequest` the caller
can act on, and returns the request with every unset option resolved from the configuration.
Transports only check the shape of their own messages (a missing oneof, an unknown enum value,
undecodable audio) and map the library's errors to their status codes.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from .config import Config
from .errors import InvalidRequest
from .frontend.audio import check_sample_rate
from .frontend.model_input import ENDOFPROMPT, MODE_SPECS
from .request import SEED_MAX, Audio, Mode, SynthesisOptions, SynthesisRequest
from .speakers import validate_speaker_id

SPEED_RANGE = (0.5, 2.0)
MAX_FIRST_HOP = 200


@dataclass(frozen=True)
class RequestRules:
    max_text_chars: int
    max_stream_text_chars: int
    max_prompt_seconds: float
    max_source_seconds: float
    max_forced_tokens: int
    first_hop: int  # the configured default

    @classmethod
    def from_config(cls, config: Config) -> "RequestRules":
        lim = config.limits
        return cls(lim.max_text_chars, lim.max_stream_text_chars, lim.max_prompt_seconds, lim.max_source_seconds,
                   lim.max_forced_tokens, config.token2wav.first_hop)

    def check(self, request: SynthesisRequest, *, streamed_text: bool = False) -> SynthesisRequest:
        """The request with its options resolved, or InvalidRequest. streamed_text: the text
        arrives later (synthesize_stream), so `request.text` must be empty instead."""
        if not isinstance(request.mode, Mode):
            raise InvalidRequest(f"unknown mode {request.mode!r}; one of {[m.value for m in Mode]}")
        spec = MODE_SPECS[request.mode]
        if streamed_text:
            if not spec.runs_lm:
                raise InvalidRequest(f"mode {request.mode.value} takes no text, so it cannot stream text")
            if request.text:
                raise InvalidRequest("a text stream takes its text from the stream; leave the request's text empty")
        elif spec.runs_lm:
            self.check_text(request.text)
        elif request.text:
            raise InvalidRequest(f"{request.mode.value} converts source_audio and takes no text; leave text empty")
        if spec.voice == "audio":
            self.check_audio(request.prompt_audio, "prompt_audio", self.max_prompt_seconds, "max_prompt_seconds")
        else:
            validate_speaker_id(request.speaker_id)
        if request.mode == Mode.ZERO_SHOT and not request.prompt_text.strip():
            raise InvalidRequest("zero_shot needs the prompt audio's transcript (prompt_text)")
        if request.prompt_text and len(request.prompt_text) > self.max_text_chars:
            raise InvalidRequest(f"prompt_text is {len(request.prompt_text)} characters long; the limit is "
                                 f"{self.max_text_chars} (limits.max_text_chars)")
        if spec.lm_prompt_text == "instruction":
            self.check_text(request.instruct_text.replace(ENDOFPROMPT, ""), "instruct_text")
        if request.mode == Mode.VC:
            self.check_audio(request.source_audio, "source_audio", self.max_source_seconds, "max_source_seconds")
        return dataclasses.replace(request, options=self.resolve(request.options))

    def resolve(self, opts: SynthesisOptions) -> SynthesisOptions:
        if not (isinstance(opts.speed, (int, float)) and math.isfinite(opts.speed)
                and SPEED_RANGE[0] <= opts.speed <= SPEED_RANGE[1]):
            raise InvalidRequest(f"speed must be in [{SPEED_RANGE[0]}, {SPEED_RANGE[1]}], got {opts.speed}")
        if opts.stream and opts.speed != 1.0:
            raise InvalidRequest("speed != 1 needs stream = false: speed is applied to the mel of a whole utterance")
        first_hop = self.first_hop if opts.first_hop is None else opts.first_hop
        if not 1 <= first_hop <= MAX_FIRST_HOP:
            raise InvalidRequest(f"first_hop must be in [1, {MAX_FIRST_HOP}], got {first_hop}")
        if opts.seed is not None and not (isinstance(opts.seed, int) and 0 <= opts.seed <= SEED_MAX):
            raise InvalidRequest(f"seed must be an integer in 0..{SEED_MAX} (2^64 - 1), got {opts.seed}")
        if opts.top_k is not None and opts.top_k < 1:
            raise InvalidRequest(f"top_k must be >= 1, got {opts.top_k}")
        if opts.max_tokens is not None and not 1 <= opts.max_tokens <= self.max_forced_tokens:
            raise InvalidRequest(f"max_tokens must be in 1..{self.max_forced_tokens} "
                                 f"(limits.max_forced_tokens), got {opts.max_tokens}")
        return dataclasses.replace(opts, first_hop=first_hop)

    def check_text(self, text: str, what: str = "text") -> None:
        if not isinstance(text, str) or not text.strip():
            raise InvalidRequest(f"{what} is empty")
        if len(text) > self.max_text_chars:
            raise InvalidRequest(f"{what} is {len(text)} characters long; the limit is {self.max_text_chars} "
                                 "(limits.max_text_chars)")

    def check_piece(self, piece: str, received: int) -> int:
        """One piece of a text stream (StreamSynthesize, the WebSocket), after `received` characters
        of that stream; returns the stream's characters so far."""
        if len(piece) > self.max_text_chars:
            raise InvalidRequest(f"a text piece is {len(piece)} characters long; the limit is {self.max_text_chars} "
                                 "(limits.max_text_chars)")
        total = received + len(piece)
        if total > self.max_stream_text_chars:
            raise InvalidRequest(f"the text stream is over {self.max_stream_text_chars} characters "
                                 f"({total} received; limits.max_stream_text_chars)")
        return total

    def check_prompt(self, audio: Audio | None, what: str = "prompt_audio") -> None:
        self.check_audio(audio, what, self.max_prompt_seconds, "max_prompt_seconds")

    @staticmethod
    def check_audio(audio: Audio | None, what: str, max_seconds: float, limit_name: str) -> None:
        if audio is None:
            raise InvalidRequest(f"{what} is missing")
        if not (audio.sample_rate > 0 and np.asarray(audio.samples).ndim == 1 and len(audio.samples) > 0):
            raise InvalidRequest(f"{what} must be non-empty mono samples with a positive sample rate")
        check_sample_rate(audio.sample_rate, what)  # before its length: a bogus rate makes a bogus length
        if audio.seconds > max_seconds:
            raise InvalidRequest(f"{what} is {audio.seconds:.2f} s long; the limit is {max_seconds:g} s "
                                 f"(limits.{limit_name})")
