"""Text normalisation and sentence splitting, with the semantics of upstream CosyVoice2 `text_normalize`.

`TextFrontend.normalize(text)` turns raw input into the segments the LLM synthesises one by one
(facts sheet §6.2; `golden/text_frontend.json` holds 32 reference cases):

1. Skip: `enabled=False`, empty text, or text holding both `<|` and `|>` (markup such as
   `<|endofprompt|>`) comes back unchanged (unstripped); `[text]` when splitting.
2. Strip, then pick the language: zh if any character is in U+4E00-U+9FFF, else en.
3. Text normalisation (TN) with wetext: the zh instance (`remove_erhua=False`) for zh, the default
   instance for en. Both keep wetext's own language detection, so digits-only "en" text gets zh TN
   ("2025" -> "两千零二十五"), as upstream.
4. zh rules: drop newlines, drop spaces not between two ASCII non-space characters, ² -> 平方,
   ³ -> 立方, "." -> "。", " - " -> "，", drop （）【】 and backticks, "——" -> " ", trailing
   [，,、]+ -> "。". en rule: every run of `str.isdigit()` characters -> inflect `number_to_words`.
5. Split (only when `split=True`): cut after sentence punctuation (a closing quote right after it stays
   with the sentence), greedily merge sentences up to 80 length units (flush only once the current
   segment exceeds 60), fold a tail shorter than 20 into the previous segment, drop segments made of
   punctuation/symbols only. Length is characters for zh and text-tokenizer tokens for en.

Where upstream crashes, this module does something defined instead:
- whitespace-only text raises `TextFrontendError` (upstream: IndexError);
- text the wetext tagger cannot parse (e.g. "#7", or a blank line in English text; upstream:
  AssertionError) is normalised line by line, and a line that still fails is kept as written, which is
  what upstream does for all text when no TN engine is installed. A warning is logged;
- a closing quote after punctuation that has no sentence before it starts the next sentence;
- an English digit run too long for inflect (37 digits or more) is read digit by digit.
"""
from __future__ import annotations

import importlib.util
import json
import logging
import re
import threading
import unicodedata
from collections.abc import Callable, Iterable
from itertools import groupby
from pathlib import Path
from typing import Any, Literal, Protocol, overload

from async_cosyvoice.errors import InvalidRequest

log = logging.getLogger(__name__)

Lang = Literal["zh", "en"]

SEGMENT_MAX_LEN = 80  # upstream token_max_n
SEGMENT_FLUSH_LEN = 60  # upstream token_min_n: a segment is closed only once longer than this
TAIL_MERGE_LEN = 20  # upstream merge_len: a last segment shorter than this joins the previous one

SENTENCE_END: dict[Lang, frozenset[str]] = {
    "zh": frozenset("。？！；：、.?!;"),
    "en": frozenset(".?!;:"),
}
DEFAULT_SENTENCE_END: dict[Lang, str] = {"zh": "。", "en": "."}
CLOSING_QUOTES = frozenset('"”')

_ZH_DELETED = ("（", "）", "【", "】", "`")
_TRAILING_COMMAS = re.compile(r"[，,、]+\Z")


class TextFrontendError(InvalidRequest):
    """The text cannot be turned into speakable segments (e.g. it is only whitespace)."""


class Encoder(Protocol):
    def encode(self, text: str) -> list[int]: ...


def contains_chinese(text: str) -> bool:
    return any("\u4e00" <= c <= "\u9fff" for c in text)


def has_markup(text: str) -> bool:
    """Text with `<|...|>` markup bypasses the frontend entirely."""
    return "<|" in text and "|>" in text


def is_punctuation_only(text: str) -> bool:
    """True if every character is Unicode punctuation (P*) or a symbol (S*); True for ""."""
    return all(unicodedata.category(c)[0] in "PS" for c in text)


class _Backends:
    """The wetext normalisers and the inflect engine, shared by every `TextFrontend` in the process.

    Importing wetext loads all its FSTs (~0.5 s, ~50 MiB), so it happens once, on first use. Calls go
    through one lock: inflect's `number_to_words` keeps per-call state on the engine, and kaldifst
    makes no thread-safety promise (it holds the GIL anyway, so the lock costs no parallelism).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._wetext: dict[Lang, Any] | None = None
        self._inflect: Any = None  # the module, imported on first use
        self._engine: Any = None

    def _load_wetext(self) -> dict[Lang, Any]:
        if self._wetext is None:
            from wetext import Normalizer

            self._wetext = {"zh": Normalizer(remove_erhua=False), "en": Normalizer()}
        return self._wetext

    def _load_inflect(self) -> None:
        if self._inflect is None:
            import inflect  # ~1-2 s: typeguard instruments it on import

            self._inflect = inflect
            self._engine = inflect.engine()

    def load(self, wetext: bool) -> None:
        with self._lock:
            self._load_inflect()
            if wetext:
                self._load_wetext()

    def text_normalize(self, text: str, instance: Lang, force_lang: bool = False) -> str:
        """Run the zh or en wetext instance; `force_lang` overrides wetext's own language detection."""
        with self._lock:
            normalizer = self._load_wetext()[instance]
            return normalizer.normalize(text, lang=instance) if force_lang else normalizer.normalize(text)

    def number_to_words(self, digits: str) -> str:
        """inflect's reading of a digit run; digit by digit past inflect's range (37+ digits)."""
        with self._lock:
            self._load_inflect()
            try:
                return self._engine.number_to_words(digits)
            except self._inflect.NumOutOfRangeError:
                return " ".join(self._engine.number_to_words(d) for d in digits)


_BACKENDS = _Backends()


def drop_spaces(text: str) -> str:
    """Keep a space only between two ASCII non-space characters ("iPhone 15 Pro" keeps its spaces,
    "我 今天" loses them)."""
    def ascii_word(c: str) -> bool:
        return c.isascii() and c != " "

    last = len(text) - 1
    return "".join(
        c for i, c in enumerate(text)
        if c != " " or (0 < i < last and ascii_word(text[i - 1]) and ascii_word(text[i + 1]))
    )


def apply_zh_rules(text: str) -> str:
    """The rule chain upstream applies to Chinese text after TN."""
    text = drop_spaces(text.replace("\n", ""))
    text = text.replace("²", "平方").replace("³", "立方")
    text = text.replace(".", "。").replace(" - ", "，")
    for ch in _ZH_DELETED:
        text = text.replace(ch, "")
    text = text.replace("——", " ")
    return _TRAILING_COMMAS.sub("。", text)


def spell_out_numbers(text: str, number_to_words: Callable[[str], str]) -> str:
    """Replace every run of `str.isdigit()` characters (which include ５ and ²) with words."""
    return "".join(
        number_to_words(run) if is_digit else run
        for is_digit, run in ((k, "".join(g)) for k, g in groupby(text, key=str.isdigit))
    )


def split_sentences(text: str, lang: Lang) -> list[str]:
    """Cut after each sentence punctuation mark; a closing quote right after the mark stays with that
    sentence. A mark with nothing before it (since the last cut) is dropped."""
    ends = SENTENCE_END[lang]
    if text and text[-1] not in ends:
        text += DEFAULT_SENTENCE_END[lang]
    sentences: list[str] = []
    start = 0
    for i, c in enumerate(text):
        if c not in ends:
            continue
        if i > start:
            sentences.append(text[start:i + 1])
        start = i + 1
        if start < len(text) and text[start] in CLOSING_QUOTES and sentences:
            sentences[-1] += text[start]
            start += 1
    return sentences


def merge_sentences(sentences: Iterable[str], length: Callable[[str], int]) -> list[str]:
    """Greedy merge into segments of about `SEGMENT_MAX_LEN` length units, measuring whole strings
    (for tokens, `length(a + b)` may differ from `length(a) + length(b)`)."""
    segments: list[str] = []
    current = ""
    for sentence in sentences:
        if length(current) > SEGMENT_FLUSH_LEN and length(current + sentence) > SEGMENT_MAX_LEN:
            segments.append(current)
            current = ""
        current += sentence
    if current:
        if segments and length(current) < TAIL_MERGE_LEN:
            segments[-1] += current
        else:
            segments.append(current)
    return segments


class TextFrontend:
    """Upstream-compatible text normalisation. Thread-safe; blocking (1-2 ms of wetext per call, more
    for long English text), so call it from an executor in async code.

    `tokenizer` (anything with `encode(text) -> list[int]`, e.g. `TextTokenizer`) measures English
    segment length; use the model's own tokenizer, since English segment boundaries depend on it.
    `use_wetext=False` skips TN (upstream's behaviour with no TN engine installed); the rules and the
    splitting still run.
    """

    def __init__(self, tokenizer: Encoder, *, use_wetext: bool = True):
        if use_wetext and importlib.util.find_spec("wetext") is None:
            raise ImportError("wetext is not installed: `pip install wetext==0.1.8` "
                              "(or pass use_wetext=False to skip text normalisation)")
        self._tokenizer = tokenizer
        self._use_wetext = use_wetext

    def preload(self) -> None:
        """Import wetext (its FSTs) and inflect now instead of on the first call, e.g. at start-up."""
        _BACKENDS.load(wetext=self._use_wetext)

    @overload
    def normalize(self, text: str, split: Literal[True] = ..., enabled: bool = ...,
                  lang: Lang | None = ...) -> list[str]: ...

    @overload
    def normalize(self, text: str, split: Literal[False], enabled: bool = ..., lang: Lang | None = ...) -> str: ...

    @overload
    def normalize(self, text: str, split: bool, enabled: bool = ..., lang: Lang | None = ...) -> list[str] | str: ...

    def normalize(self, text: str, split: bool = True, enabled: bool = True,
                  lang: Lang | None = None) -> list[str] | str:
        """`split=False`: the normalised text (upstream's prompt-text form). `split=True`: the segments to
        synthesise, possibly none (e.g. for "?!..."). `enabled=False` returns the text unchanged
        (`[text]` when splitting). Raises `TextFrontendError` for whitespace-only text.
        `lang` forces the language (rules and wetext instance) instead of picking it from `text`: a
        piece of a longer text (frontend/stream_text.py) takes the language of the whole."""
        if not enabled or text == "" or has_markup(text):
            return [text] if split else text
        stripped = text.strip()
        if not stripped:
            raise TextFrontendError("text is only whitespace; there is nothing to synthesize")
        forced = lang is not None
        lang = lang or ("zh" if contains_chinese(stripped) else "en")
        normalized = self._text_normalize(stripped, lang, forced)
        if lang == "zh":
            normalized = apply_zh_rules(normalized)
        else:
            normalized = spell_out_numbers(normalized, _BACKENDS.number_to_words)
        if not split:
            return normalized
        segments = merge_sentences(split_sentences(normalized, lang), self._length(lang))
        return [s for s in segments if not is_punctuation_only(s)]

    def _length(self, lang: Lang) -> Callable[[str], int]:
        if lang == "zh":
            return len
        return lambda s: len(self._tokenizer.encode(s))

    def _text_normalize(self, text: str, lang: Lang, force_lang: bool = False) -> str:
        if not self._use_wetext:
            return text
        try:
            return _BACKENDS.text_normalize(text, lang, force_lang)
        except Exception as e:  # noqa: BLE001 - wetext asserts on input its tagger cannot parse
            log.warning("wetext cannot normalise this %d-character %s text (%s); normalising it line by line",
                        len(text), lang, type(e).__name__)
        lines = []
        for line in (ln.strip() for ln in text.splitlines()):
            if not line:
                continue
            try:
                lines.append(_BACKENDS.text_normalize(line, lang, force_lang=True))
            except Exception as e:  # noqa: BLE001
                log.warning("wetext cannot normalise a %d-character line (%s); keeping it as written",
                            len(line), type(e).__name__)
                lines.append(line)
        return ("" if lang == "zh" else " ").join(lines)


def text_golden_entries(texts: Iterable[str], tokenizer: Encoder,
                        frontend: TextFrontend | None = None) -> list[dict[str, Any]]:
    """Entries in the layout of `golden/text_frontend.json`: text, normalized (split=False), segments
    (split=True) and each segment's token ids."""
    frontend = frontend or TextFrontend(tokenizer)
    entries = []
    for text in texts:
        segments = frontend.normalize(text, split=True)
        entries.append({
            "text": text,
            "normalized": frontend.normalize(text, split=False),
            "segments": segments,
            "segment_token_ids": [list(tokenizer.encode(s)) for s in segments],
        })
    return entries


def golden_json(value: Any, indent: int = 1) -> str:
    """JSON as `json.dumps(value, ensure_ascii=False, indent=indent)` writes it, except that lists of
    integers stay on one line; with a trailing newline. This is the byte layout of the golden files."""
    def emit(v: Any, depth: int) -> str:
        inner, outer = " " * indent * (depth + 1), " " * indent * depth
        if isinstance(v, dict) and v:
            items = (f"{inner}{json.dumps(str(k), ensure_ascii=False)}: {emit(x, depth + 1)}"
                     for k, x in v.items())
            return "{\n" + ",\n".join(items) + "\n" + outer + "}"
        if isinstance(v, list) and v:
            if all(isinstance(x, int) and not isinstance(x, bool) for x in v):
                return "[" + ", ".join(str(x) for x in v) + "]"
            return "[\n" + ",\n".join(inner + emit(x, depth + 1) for x in v) + "\n" + outer + "]"
        return json.dumps(v, ensure_ascii=False)

    return emit(value, 0) + "\n"


def write_text_golden(texts: Iterable[str], tokenizer: Encoder, out_path: str | Path) -> list[dict[str, Any]]:
    """Write `text_frontend.json` for `texts` (same structure and byte layout as the golden file) and
    return its entries."""
    entries = text_golden_entries(texts, tokenizer)
    Path(out_path).write_text(golden_json(entries), encoding="utf-8")
    return entries
