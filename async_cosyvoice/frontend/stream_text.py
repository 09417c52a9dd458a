"""Text that arrives in pieces, normalized only up to the last SAFE boundary (bistream's text).

Upstream's bistream feeds each client piece tokenized on its own, without text normalization.
`StreamTextNormalizer` buffers pieces and releases normalized text (`TextFrontend`, the same
normalizer as for whole texts) only up to a boundary after which later text can change neither
the normalization nor the tokenization of what precedes it:

- English (no CJK character seen in the stream yet): a boundary is the single space before a
  word that starts with a lowercase letter, where the word before the space is letters only
  (apostrophes inside allowed) with only its first letter possibly uppercase, optionally followed
  by one of `, ; :`. So nothing is cut next to a digit, a symbol, a '.', an abbreviation written
  with dots, an all-caps word (roman numerals, AM) or a word still arriving ("12" + "3",
  "Dr" + ".", "War" + " II", "hel" + "lo" all wait). The space goes with the next word, as it
  does in Qwen2's pre-tokenizer (" world"), so the released text's tokens are those of the whole.
- Chinese (once any CJK character has arrived, for the rest of the stream): a boundary is just
  before a CJK clause or sentence mark (，。！？；：、) that follows a CJK character. Between two
  CJK characters there is none: Qwen2's pre-tokenizer keeps a run of them in one piece, so a cut
  would change the tokens. Chinese text waits for the end of its clause.
- `FLUSH` (the client says: what I sent is complete) and the end of the text release everything.
  A buffer longer than `MAX_HELD_CHARS` without a boundary is cut at its last space (else whole):
  the one place where the result may differ from normalizing the whole text.

Each released chunk is normalized with the stream's language (`TextFrontend.normalize(lang=...)`),
and a chunk after the first keeps one space before it where English text has one.
Limits (the normalizer is not prefix-stable there; tests/test_stream_text.py shows the rest is):
the language of the whole text is zh if it holds any CJK character, so English chunks released
before the first CJK character of a mixed text are read as English; whole-text rules (text with
`<|...|>` markup is not normalized at all; text the wetext tagger rejects, e.g. with a double
space, is kept as written as a whole) apply per chunk. Text normalization off
(`options.text_frontend=False`) releases the same chunks unchanged.
"""
from __future__ import annotations

from .text import Lang, TextFrontend, contains_chinese

MAX_HELD_CHARS = 80  # a buffer this long without a safe boundary is cut anyway (latency bound)
ZH_BREAKS = frozenset("，。！？；：、")
EN_WORD_ENDS = frozenset(",;:")
APOSTROPHES = frozenset("'’")


def is_cjk(c: str) -> bool:
    return "\u4e00" <= c <= "\u9fff"


def _plain_word(word: str) -> bool:
    """Letters (apostrophes inside), only the first possibly uppercase, then at most one of , ; :"""
    if word and word[-1] in EN_WORD_ENDS:
        word = word[:-1]
    if not word or not word[0].isalpha() or word[-1] in APOSTROPHES:
        return False
    return all((c.isalpha() and c.islower()) or c in APOSTROPHES for c in word[1:])


def safe_boundary(text: str, zh: bool) -> int:
    """The last safe boundary in `text` (see the module docstring); 0 if there is none."""
    if zh:
        for i in range(len(text) - 1, 0, -1):
            if text[i] in ZH_BREAKS and is_cjk(text[i - 1]):
                return i
        return 0
    for i in range(len(text) - 2, 0, -1):
        if text[i] != " " or not (text[i + 1].isalpha() and text[i + 1].islower()):
            continue
        start = i
        while start > 0 and not text[start - 1].isspace():
            start -= 1
        if _plain_word(text[start:i]):
            return i
    return 0


def forced_boundary(text: str) -> int:
    """Where an over-long buffer is cut: before its last space that follows a non-space, else all."""
    for i in range(len(text) - 1, 0, -1):
        if text[i].isspace() and not text[i - 1].isspace():
            return i
    return len(text)


class StreamTextNormalizer:
    """One text stream: `feed(piece)`, `flush()`, `end()` each return the normalized text released
    now (maybe ""). Blocking (wetext), so call it from a worker thread in async code."""

    def __init__(self, frontend: TextFrontend, enabled: bool = True):
        self.frontend = frontend
        self.enabled = enabled
        self.zh = False  # sticky: a CJK character has arrived
        self._held = ""
        self._released_any = False
        self._last = ""  # the last released text (the zh space rule looks at its last character)

    @property
    def held(self) -> str:
        return self._held

    def feed(self, piece: str) -> str:
        self._held += piece
        self.zh = self.zh or contains_chinese(piece)
        cut = safe_boundary(self._held, self.zh)
        if not cut and len(self._held) > MAX_HELD_CHARS:
            cut = forced_boundary(self._held)
        return self._release(cut)

    def flush(self) -> str:
        return self._release(len(self._held))

    def end(self) -> str:
        return self._release(len(self._held))

    def _release(self, cut: int) -> str:
        if cut <= 0:
            return ""
        chunk, self._held = self._held[:cut], self._held[cut:]
        out = self._normalize(chunk)
        if out:
            self._released_any, self._last = True, out
        return out

    def _normalize(self, chunk: str) -> str:
        if not self.enabled:
            return chunk
        core = chunk.strip()
        if not core:
            return ""
        # zh is forced (a chunk may hold no CJK character, the whole text does); English is left to
        # the normalizer's own pick, which for text with letters is English as for the whole
        lang: Lang | None = "zh" if self.zh else None
        out = self.frontend.normalize(core, split=False, lang=lang)
        if not out or not self._released_any or not chunk[0].isspace():
            return out
        if lang is None or (_ascii_word_char(self._last[-1]) and _ascii_word_char(out[0])):
            return " " + out  # zh: upstream keeps a space only between two ASCII non-space characters
        return out


def _ascii_word_char(c: str) -> bool:
    return c.isascii() and not c.isspace()
