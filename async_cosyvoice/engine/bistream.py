"""CosyVoice2's bistream input schedule (text-in streaming) for one request, as a pure object.

It mirrors upstream `Qwen2LM.inference_bistream` (facts §2.7) step for step, so that the engine
feeds the LM exactly what upstream would feed for the same text tokens, whatever the timing or
chunking of the text:

- `[sos]` starts the input; the prompt text starts the text cache.
- Text tokens are taken one at a time. After each one, (5 text, 15 prompt speech) pairs are
  appended while the cache holds >= 5 tokens. Once the prompt speech is used up, decoding starts:
  right away after the last prompt pair, or, with no prompt pair (`[sos]` alone) or after a
  fill, once 5 text tokens are cached; those 5 are then the whole next input (the input that
  produced the fill is dropped, the fill itself is never fed).
- While text streams, EOS is masked and a fill is forced when `len(out) == next_fill_index`,
  initially `(P // 15 + 1) * 15 - P` (15, not 0, when P % 15 == 0), then 16 outputs after each
  fill; a sampled fill counts the same. Decoding runs until a fill before the next text token is
  taken: tokens that arrive meanwhile wait.
- When the text ends, the next input is the last input upstream fed (it is fed a second time),
  then the rest of the cache, then `task`; decoding runs to EOS with nothing masked.
- Upstream raises on 6561/6562 while text streams and on 6562/6563 afterwards; so does `accept`.

CosyVoice3 (`ids` of kind cosyvoice3, upstream `CosyVoice3LM` through the same loop): the prompt text
up to and including `<|endofprompt|>` (its first `system_len` tokens, which the caller locates with
its tokenizer) follows `[sos]` in the first input and only the rest starts the text cache, so with
no prompt speech decoding starts at the first text token (upstream's `lm_input.size(1) == 1` test
no longer holds); the stop ids are 6561..6760, its fill 6564 and its
EOS 6562: while text streams every other stop id raises as above, after the text any stop id ends
the request (`SpeechIds.ends_bistream`: CosyVoice3's unistream rule; upstream would raise on all but
6562).

`training_consistent=True` is the layout the model was trained on instead: the fill is due at
once when the prompt fills whole 15-token groups, and the final input does not repeat the last
fed input.

The engine drives it: `next_input()` when the LM waits for input (at the start and after each
fill), `forces_fill` before each sampled token, `accept(token)` after it.
"""
from __future__ import annotations

from collections import deque
from enum import Enum, auto
from typing import Iterable

from ..models.dims import SpeechIds
from ..models.llm import Part, Table, sos_part, task_part


class Phase(Enum):
    TEXT = auto()   # text still streaming: decode until a fill
    FINAL = auto()  # text ended: decode until EOS
    DONE = auto()


class Verdict(Enum):
    EMIT = auto()  # a speech token for the caller; it is the next LM input
    FILL = auto()  # end of a 15-token group: the LM waits for `next_input()`
    END = auto()   # EOS after the text ended


class UnexpectedStopToken(RuntimeError):
    """The LM sampled a stop id that upstream's bistream loop treats as an error."""


class BistreamSchedule:
    def __init__(self, prompt_text_tokens: Iterable[int], prompt_speech_tokens: Iterable[int],
                 mix_ratio: tuple[int, int] = (5, 15), training_consistent: bool = False,
                 ids: SpeechIds = SpeechIds.of("cosyvoice2"), system_len: int = 0):
        self.n_text, self.n_speech = mix_ratio
        self.training_consistent = training_consistent
        self.ids = ids
        self._sos = sos_part(ids)
        self._text_cache: list[int] = list(prompt_text_tokens)
        self._prompt_speech: list[int] = list(prompt_speech_tokens)
        self._pending: deque[int] = deque()  # client text tokens not taken yet
        self._ended = False
        self._lm_input: list[Part] = [self._sos]  # upstream's `lm_input`: the next input, or the last fed one
        if ids.sos is not None:  # CosyVoice3: the system part of the prompt text goes in with sos
            if not 0 < system_len <= len(self._text_cache):
                raise ValueError("a CosyVoice3 bistream prompt text must begin with its system part, ending "
                                 f"in <|endofprompt|> (system_len {system_len} of {len(self._text_cache)} tokens)")
            self._lm_input.append((Table.TEXT, tuple(self._text_cache[:system_len])))
            del self._text_cache[:system_len]
        self.num_out = 0  # upstream's len(out_tokens): fills included
        self._last_out: int | None = None
        p = len(self._prompt_speech)
        self._next_fill = (p // self.n_speech + 1) * self.n_speech - p
        if training_consistent and p and p % self.n_speech == 0:
            self._next_fill = 0
        self.phase = Phase.TEXT
        self.wants_input = True  # the LM waits for `next_input()`

    # ------------------------------------------------------------------ text side

    def add_text(self, tokens: Iterable[int]) -> None:
        if self._ended:
            raise ValueError("text was already ended")
        self._pending.extend(tokens)

    def end_text(self) -> None:
        self._ended = True

    @property
    def text_ended(self) -> bool:
        return self._ended

    # ------------------------------------------------------------------ LM side

    def next_input(self) -> tuple[Part, ...] | None:
        """The next input rows once the LM waits for input; None while it needs more text."""
        if not self.wants_input:
            raise RuntimeError("next_input() called while the LM is decoding")
        while self._pending:
            self._text_cache.append(self._pending.popleft())
            self._take_prompt_pairs()
            if self._prompt_speech:
                continue
            after_fill = self.num_out > 0 and self._last_out == self.ids.fill
            if after_fill or (self.num_out == 0 and self._lm_input == [self._sos]):
                if len(self._text_cache) < self.n_text:
                    continue
                text = (Table.TEXT, tuple(self._text_cache[:self.n_text]))
                del self._text_cache[:self.n_text]
                self._lm_input = [text] if after_fill else self._lm_input + [text]
            return self._feed(self._lm_input)
        if not self._ended:
            return None
        # upstream: lm_input is the last input fed (fed again) once anything was decoded
        last = [] if self.training_consistent and self.num_out > 0 else self._lm_input
        rest = [(Table.TEXT, tuple(self._text_cache))] if self._text_cache else []
        self._text_cache = []
        self.phase = Phase.FINAL
        return self._feed(last + rest + [task_part(self.ids)])

    @property
    def forces_fill(self) -> bool:
        """Whether the next output is a forced fill rather than a sample."""
        return self.phase is Phase.TEXT and self.num_out == self._next_fill

    @property
    def fill_index(self) -> int | None:
        """The output index (len(out)) of the next forced fill; None once the text ended."""
        return self._next_fill if self.phase is Phase.TEXT else None

    @property
    def masks_eos(self) -> bool:
        """Whether EOS is masked for the next sample (upstream's ignore_eos)."""
        return self.phase is Phase.TEXT

    def accept(self, token: int) -> Verdict:
        """Record the LM's next output (a forced fill included)."""
        if self.wants_input or self.phase is Phase.DONE:
            raise RuntimeError("accept() called while the LM has no input")
        fill = self.ids.fill
        if self.phase is Phase.TEXT and self.forces_fill and token != fill:
            raise RuntimeError(f"output {self.num_out} must be the forced fill token, got {token}")
        index = self.num_out
        self.num_out += 1
        self._last_out = token
        if self.phase is Phase.TEXT:
            if token == fill:
                self._next_fill = index + self.n_speech + 1
                self.wants_input = True
                return Verdict.FILL
            if self.ids.is_stop(token):
                raise UnexpectedStopToken(f"the LM sampled stop id {token} while text was streaming "
                                          "(upstream's bistream loop raises here too)")
        else:
            if self.ids.ends_bistream(token):
                self.phase = Phase.DONE
                return Verdict.END
            if self.ids.is_stop(token):
                raise UnexpectedStopToken(f"the LM sampled stop id {token} after the text ended "
                                          "(upstream's bistream loop raises here too)")
        self._lm_input = [(Table.SPEECH, (token,))]
        return Verdict.EMIT

    # ------------------------------------------------------------------ internals

    def _take_prompt_pairs(self) -> None:
        while self._prompt_speech and len(self._text_cache) >= self.n_text:
            text = tuple(self._text_cache[:self.n_text])
            speech = tuple(self._prompt_speech[:self.n_speech])
            del self._text_cache[:self.n_text], self._prompt_speech[:self.n_speech]
            self._lm_input = self._lm_input + [(Table.TEXT, text), (Table.SPEECH, speech)]

    def _feed(self, parts: list[Part]) -> tuple[Part, ...]:
        self._lm_input = list(parts)
        self.wants_input = False
        return tuple(parts)
