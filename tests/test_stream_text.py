"""Streamed text normalized up to safe boundaries (frontend/stream_text.py).

The property: for any split of a text into pieces, what the stream releases (feed each piece,
then end) concatenates to the normalization of the whole text, and its tokens (each release
tokenized on its own, as bistream feeds them) are the whole text's tokens; the releases also
line up with Qwen2's pre-tokenizer pieces, so this holds for any BPE vocabulary, not only the
fixture's.
"""
from __future__ import annotations

import pytest
from tokenizers import Regex, pre_tokenizers

from async_cosyvoice.frontend.stream_text import (
    MAX_HELD_CHARS,
    StreamTextNormalizer,
    safe_boundary,
)
from async_cosyvoice.frontend.text import TextFrontend
from async_cosyvoice.frontend.tokenizer import QWEN2_PRETOKENIZE_REGEX, TextTokenizer
from async_cosyvoice.request import FLUSH

hypothesis = pytest.importorskip("hypothesis", reason="hypothesis is in the dev extra: pip install -e '.[dev]'")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

QWEN2_SPLIT = pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated")

# numbers, dates, times, money, abbreviations, roman numerals, units, contractions, symbols,
# quotes, newlines, Chinese with numbers and every clause mark, Chinese with English inside
CORPUS = [
    "Hello there, this is a sentence that keeps going on and on for a while.",
    "On Nov 24, 2026 we met Dr. Smith at 10:30 am in St. Louis, and it cost $5 million.",
    "World War II ended in 1945; Henry VIII had six wives. I'm sure it's true, isn't it?",
    "I have 2 cats and 3 dogs, and they weigh 5 kg each: about 11 lbs in total!",
    "Mr Smith said the U.S. army uses 3.14 as pi, e.g. in training, vs. 22/7 elsewhere.",
    "The 1st place went to cats & dogs; the 2nd to the mid-century modern chair.",
    "Version 2.0 is out now and it works, I paid 20% more for the 3rd one, sadly.",
    'He wrote "hello world" (twice) and left.\nThen he came back on Mon morning',
    "Our meeting is at 3 pm. Then we go home, and we rest; café au lait is nice.",
    "今天是2025年11月24日，天气很好。我们去公园散步吧！",
    "价格是3.5元，一共买了12个、总共42元：你觉得贵吗？不贵；很便宜。",
    "我用 iPhone 15 Pro 拍照，效果不错；下午3点再说。",
]


@pytest.fixture(scope="module")
def tokenizer(tiny_dir):
    return TextTokenizer.from_dir(tiny_dir / "CosyVoice-BlankEN")


@pytest.fixture(scope="module")
def frontend(tokenizer):
    frontend = TextFrontend(tokenizer)
    frontend.preload()
    return frontend


def pretokens(text: str) -> list[str]:
    return [piece for piece, _ in QWEN2_SPLIT.pre_tokenize_str(text)]


def stream(frontend: TextFrontend, pieces, enabled: bool = True) -> list[str]:
    normalizer = StreamTextNormalizer(frontend, enabled=enabled)
    out = [normalizer.flush() if p is FLUSH else normalizer.feed(p) for p in pieces]
    return [o for o in out + [normalizer.end()] if o]


@st.composite
def split_text(draw):
    text = draw(st.sampled_from(CORPUS))
    cuts = sorted(draw(st.sets(st.integers(1, len(text) - 1), max_size=len(text) - 1)))
    return text, [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(split_text())
def test_any_split_gives_the_whole_texts_normalization_and_tokens(frontend, tokenizer, case):
    text, pieces = case
    whole = frontend.normalize(text, split=False)
    released = stream(frontend, pieces)
    assert "".join(released) == whole
    assert [t for r in released for t in tokenizer.encode(r)] == tokenizer.encode(whole)
    assert [p for r in released for p in pretokens(r)] == pretokens(whole)


@pytest.mark.parametrize("text", CORPUS)
def test_word_by_word_and_char_by_char(frontend, tokenizer, text):
    whole = frontend.normalize(text, split=False)
    words = text.split(" ")
    for pieces in ([words[0]] + [" " + w for w in words[1:]], list(text)):
        released = stream(frontend, pieces)
        assert "".join(released) == whole
        assert [t for r in released for t in tokenizer.encode(r)] == tokenizer.encode(whole)


def test_normalization_off_releases_the_text_as_sent(frontend):
    text = CORPUS[1]
    released = stream(frontend, list(text), enabled=False)
    assert "".join(released) == text and len(released) > 3
    assert [p for r in released for p in pretokens(r)] == pretokens(text)


def test_english_holds_back_one_word(frontend):
    """An LLM's pieces (" word") are released one word late; the first 5 words are out after 6."""
    normalizer = StreamTextNormalizer(frontend)
    words = "Hello there, this is a sentence that keeps going on".split(" ")
    released = []
    for i, word in enumerate(words):
        released.append(normalizer.feed(word if i == 0 else " " + word))
        assert normalizer.held == (word if i == 0 else " " + word)
    assert "".join(released[:6]) == "Hello there, this is a"


@pytest.mark.parametrize("text,before", [
    ("Dr. Smith", ""),             # no cut after an abbreviation with a dot
    ("Dr. smith", ""),
    ("World War II", ""),          # nor before a capitalized / all-caps word (roman numerals)
    ("we paid 12", "we"),          # nor next to a number
    ("about 12 kg", ""),
    ("meet at 10 am", "meet"),
    ("cats & dogs", ""),           # nor next to a symbol
    ("say hel", "say"),            # "hel" may still grow: the cut is before it, never inside
    ("one, two; three: four", "one, two; three:"),
    ("it's done", "it's"),
    ("Hello there", "Hello"),
    ("Hello\nthere", ""),          # only a single space ends a word (wetext joins lines)
    ("a  b", ""),
    ("今天很好，明天", "今天很好"),    # before a CJK clause mark after a CJK character
    ("今天很好", ""),
    ("价格3，元", ""),               # the mark follows a digit
])
def test_safe_boundary_cases(text, before):
    assert text[:safe_boundary(text, zh=any("\u4e00" <= c <= "\u9fff" for c in text))] == before


def test_flush_releases_everything_and_long_runs_are_cut(frontend):
    normalizer = StreamTextNormalizer(frontend)
    assert normalizer.feed("We paid 12") == "We"
    assert normalizer.flush() == " paid twelve" and normalizer.held == ""
    long_run = "ABC " * (MAX_HELD_CHARS // 4 + 1)   # all-caps words: no safe boundary
    out = normalizer.feed(long_run)
    assert out and len(normalizer.held) < MAX_HELD_CHARS


def test_english_before_the_first_cjk_character_is_read_as_english(frontend):
    """The documented limit: a whole mixed text is normalized as Chinese; a stream has already
    released its English start as English."""
    text = "I have 2 apples and some pears, 还有三个橙子。"
    released = "".join(stream(frontend, text.split(" ")[:1] + [" " + w for w in text.split(" ")[1:]]))
    assert released.startswith("I have two apples")
    assert frontend.normalize(text, split=False) != released
