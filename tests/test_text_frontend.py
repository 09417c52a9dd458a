"""Text frontend against upstream's `text_normalize` goldens (golden/README.md section (f))."""
import json
import logging
from concurrent.futures import ThreadPoolExecutor

import pytest

from async_cosyvoice.errors import InvalidRequest
from async_cosyvoice.frontend.text import (
    TextFrontend,
    TextFrontendError,
    merge_sentences,
    split_sentences,
    write_text_golden,
)
from async_cosyvoice.frontend.tokenizer import TextTokenizer

GOLDEN_NAME = "text_frontend.json"
GOLDEN_COUNT = 32


@pytest.fixture(scope="module")
def golden(golden_dir):
    return json.loads((golden_dir / GOLDEN_NAME).read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def tokenizer(tiny_dir):
    return TextTokenizer.from_dir(tiny_dir / "CosyVoice-BlankEN")


@pytest.fixture(scope="module")
def frontend(tokenizer):
    return TextFrontend(tokenizer)


def test_golden_file_has_every_case(golden):
    assert len(golden) == GOLDEN_COUNT


@pytest.mark.parametrize("index", range(GOLDEN_COUNT), ids=lambda i: f"{i:02d}")
def test_matches_upstream_golden(frontend, tokenizer, golden, index):
    entry = golden[index]
    text = entry["text"]
    assert frontend.normalize(text, split=False) == entry["normalized"]
    segments = frontend.normalize(text, split=True)
    assert segments == entry["segments"]
    assert [tokenizer.encode(s) for s in segments] == entry["segment_token_ids"]


def test_write_text_golden_reproduces_file(golden_dir, golden, tokenizer, tmp_path):
    out = tmp_path / GOLDEN_NAME
    entries = write_text_golden([e["text"] for e in golden], tokenizer, out)
    assert entries == golden
    assert json.loads(out.read_text(encoding="utf-8")) == golden
    assert out.read_bytes() == (golden_dir / GOLDEN_NAME).read_bytes()


@pytest.mark.parametrize("text", [
    "Read 3 items.<|endofprompt|>Then 4 more",
    "  你好<|x|>，2024年  ",
])
def test_markup_disables_frontend(frontend, text):
    assert frontend.normalize(text, split=False) == text
    assert frontend.normalize(text) == [text]


def test_half_markup_does_not_disable(frontend):
    assert frontend.normalize("Score <| 3", split=False).endswith(" three")


@pytest.mark.parametrize("text", ["  Hello 5 ", "今天3点.", "   ", ""])
def test_switch_off_returns_text_unchanged(frontend, text):
    assert frontend.normalize(text, split=False, enabled=False) == text
    assert frontend.normalize(text, enabled=False) == [text]


def test_empty_text_is_one_empty_segment(frontend):
    assert frontend.normalize("") == [""]
    assert frontend.normalize("", split=False) == ""


@pytest.mark.parametrize("text", [" ", "\n\t ", "\u3000"])
@pytest.mark.parametrize("split", [True, False])
def test_whitespace_only_raises(frontend, text, split):
    with pytest.raises(TextFrontendError, match="whitespace") as info:
        frontend.normalize(text, split=split)
    assert isinstance(info.value, ValueError) and isinstance(info.value, InvalidRequest)


def test_untaggable_text_keeps_the_line_as_written(frontend, caplog):
    # upstream: AssertionError inside wetext's token parser
    with caplog.at_level(logging.WARNING, logger="async_cosyvoice.frontend.text"):
        assert frontend.normalize("Call room #7 at 5 pm.") == ["Call room #seven at five pm."]
    assert "wetext cannot normalise" in caplog.text
    assert "room" not in caplog.text  # user text stays out of the log


def test_blank_line_in_english_is_normalised_line_by_line(frontend):
    text = "First paragraph has 2 lines.\n\nSecond one costs $5."
    expected = "First paragraph has two lines. Second one costs five dollars."
    assert frontend.normalize(text, split=False) == expected
    assert frontend.normalize(text) == [expected]


def test_number_beyond_inflect_range_is_read_digit_by_digit(frontend):
    text = "Code " + "12" * 40
    assert frontend.normalize(text, split=False) == "Code " + " ".join(["one", "two"] * 40)


def test_without_wetext_rules_and_numbers_still_apply(tokenizer):
    plain = TextFrontend(tokenizer, use_wetext=False)
    plain.preload()
    assert plain.normalize("I have 3 cats") == ["I have three cats."]
    assert plain.normalize("今天3点 开会.", split=False) == "今天3点开会。"


def test_quote_after_punctuation_joins_the_sentence_before():
    assert split_sentences("他说：“好。”走了", "zh") == ["他说：", "“好。”", "走了。"]
    # a mark with nothing before it is dropped, its quote still joins the previous sentence
    assert split_sentences("Stop!!” Go", "en") == ["Stop!”", " Go."]
    # upstream raises IndexError here (no sentence before the quote); we start the next one with it
    assert split_sentences("。”你好", "zh") == ["”你好。"]
    assert split_sentences("", "en") == []


def test_merge_flushes_past_max_only_when_current_exceeds_min():
    def sentence(n):
        return "x" * (n - 1) + "."

    # 61 + 20 > 80 and 61 > 60: flush
    assert [len(s) for s in merge_sentences([sentence(61), sentence(20)], len)] == [61, 20]
    # 60 + 30 > 80 but 60 is not > 60: keep growing
    assert [len(s) for s in merge_sentences([sentence(60), sentence(30)], len)] == [90]
    # a tail shorter than 20 joins the previous segment
    assert [len(s) for s in merge_sentences([sentence(70), sentence(19)], len)] == [89]


def test_concurrent_calls_match_serial(frontend, golden):
    texts = [e["text"] for e in golden] * 4
    serial = [frontend.normalize(t) for t in texts]
    with ThreadPoolExecutor(max_workers=8) as pool:
        assert list(pool.map(frontend.normalize, texts)) == serial
