"""CosyVoice2 / CosyVoice3 text tokenizer: the Qwen2 byte-level BPE of `CosyVoice-BlankEN` plus the
model's special tokens (CosyVoice2: 17 new ones; CosyVoice3: those and 261 more, 278 in all).

Built directly with the `tokenizers` library, the same pipeline transformers' Qwen2 tokenizer builds
(NFC, Qwen2 pre-tokenize regex, byte-level BPE, no BOS/EOS). The base special tokens come from
`tokenizer_config.json` (`added_tokens_decoder`) at their stated ids; then `<|endoftext|>` (eos/pad) and
the kind's list are added in upstream order, so new ones get consecutive ids after the base vocab
(facts sheet §2.3: `<|endofprompt|>` = 151646 ... `[mn]` = 151662 for the official BlankEN; CosyVoice3
goes on with `<|endofsystem|>` = 151663 ... `[ǜ]` = 151923).
"""
from __future__ import annotations

import functools
import json
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers
from tokenizers.models import BPE

from async_cosyvoice.errors import ModelDirError

QWEN2_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

EOS_TOKEN = "<|endoftext|>"  # eos and pad
COSYVOICE2_SPECIAL_TOKENS: tuple[str, ...] = (
    "<|im_start|>", "<|im_end|>", "<|endofprompt|>",
    "[breath]", "<strong>", "</strong>", "[noise]",
    "[laughter]", "[cough]", "[clucking]", "[accent]",
    "[quick_breath]", "<laughter>", "</laughter>",
    "[hissing]", "[sigh]", "[vocalized-noise]",
    "[lipsmack]", "[mn]",
)
# CosyVoice3Tokenizer adds these after CosyVoice2's (ids 151663..151923 for the official BlankEN):
# <|endofsystem|>, ARPAbet phones and pinyin finals for pronunciation hints such as "[j][ǐ]"
COSYVOICE3_EXTRA_TOKENS: tuple[str, ...] = (
    "<|endofsystem|>", "[AA]", "[AA0]", "[AA1]", "[AA2]", "[AE]", "[AE0]", "[AE1]", "[AE2]", "[AH]", "[AH0]",
    "[AH1]", "[AH2]", "[AO]", "[AO0]", "[AO1]", "[AO2]", "[AW]", "[AW0]", "[AW1]", "[AW2]", "[AY]", "[AY0]",
    "[AY1]", "[AY2]", "[B]", "[CH]", "[D]", "[DH]", "[EH]", "[EH0]", "[EH1]", "[EH2]", "[ER]", "[ER0]",
    "[ER1]", "[ER2]", "[EY]", "[EY0]", "[EY1]", "[EY2]", "[F]", "[G]", "[HH]", "[IH]", "[IH0]", "[IH1]",
    "[IH2]", "[IY]", "[IY0]", "[IY1]", "[IY2]", "[JH]", "[K]", "[L]", "[M]", "[N]", "[NG]", "[OW]", "[OW0]",
    "[OW1]", "[OW2]", "[OY]", "[OY0]", "[OY1]", "[OY2]", "[P]", "[R]", "[S]", "[SH]", "[T]", "[TH]", "[UH]",
    "[UH0]", "[UH1]", "[UH2]", "[UW]", "[UW0]", "[UW1]", "[UW2]", "[V]", "[W]", "[Y]", "[Z]", "[ZH]", "[a]",
    "[ai]", "[an]", "[ang]", "[ao]", "[b]", "[c]", "[ch]", "[d]", "[e]", "[ei]", "[en]", "[eng]", "[f]",
    "[g]", "[h]", "[i]", "[ian]", "[in]", "[ing]", "[iu]", "[ià]", "[iàn]", "[iàng]", "[iào]", "[iá]",
    "[ián]", "[iáng]", "[iáo]", "[iè]", "[ié]", "[iòng]", "[ióng]", "[iù]", "[iú]", "[iā]", "[iān]", "[iāng]",
    "[iāo]", "[iē]", "[iě]", "[iōng]", "[iū]", "[iǎ]", "[iǎn]", "[iǎng]", "[iǎo]", "[iǒng]", "[iǔ]", "[j]",
    "[k]", "[l]", "[m]", "[n]", "[o]", "[ong]", "[ou]", "[p]", "[q]", "[r]", "[s]", "[sh]", "[t]", "[u]",
    "[uang]", "[ue]", "[un]", "[uo]", "[uà]", "[uài]", "[uàn]", "[uàng]", "[uá]", "[uái]", "[uán]", "[uáng]",
    "[uè]", "[ué]", "[uì]", "[uí]", "[uò]", "[uó]", "[uā]", "[uāi]", "[uān]", "[uāng]", "[uē]", "[uě]",
    "[uī]", "[uō]", "[uǎ]", "[uǎi]", "[uǎn]", "[uǎng]", "[uǐ]", "[uǒ]", "[vè]", "[w]", "[x]", "[y]", "[z]",
    "[zh]", "[à]", "[ài]", "[àn]", "[àng]", "[ào]", "[á]", "[ái]", "[án]", "[áng]", "[áo]", "[è]", "[èi]",
    "[èn]", "[èng]", "[èr]", "[é]", "[éi]", "[én]", "[éng]", "[ér]", "[ì]", "[ìn]", "[ìng]", "[í]", "[ín]",
    "[íng]", "[ò]", "[òng]", "[òu]", "[ó]", "[óng]", "[óu]", "[ù]", "[ùn]", "[ú]", "[ún]", "[ā]", "[āi]",
    "[ān]", "[āng]", "[āo]", "[ē]", "[ēi]", "[ēn]", "[ēng]", "[ě]", "[ěi]", "[ěn]", "[ěng]", "[ěr]", "[ī]",
    "[īn]", "[īng]", "[ō]", "[ōng]", "[ōu]", "[ū]", "[ūn]", "[ǎ]", "[ǎi]", "[ǎn]", "[ǎng]", "[ǎo]", "[ǐ]",
    "[ǐn]", "[ǐng]", "[ǒ]", "[ǒng]", "[ǒu]", "[ǔ]", "[ǔn]", "[ǘ]", "[ǚ]", "[ǜ]",
)
SPECIAL_TOKENS: dict[str, tuple[str, ...]] = {
    "cosyvoice2": COSYVOICE2_SPECIAL_TOKENS,
    "cosyvoice3": COSYVOICE2_SPECIAL_TOKENS + COSYVOICE3_EXTRA_TOKENS,
}
ENDOFPROMPT = "<|endofprompt|>"


def qwen2_pipeline(model: BPE) -> Tokenizer:
    """A `Tokenizer` with Qwen2's normalizer / pre-tokenizer / decoder around `model`."""
    tok = Tokenizer(model)
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    return tok


def _read_json(path: Path, what: str) -> dict:
    if not path.is_file():
        raise ModelDirError(path.name, f"missing (expected {what} at {path})")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelDirError(path.name, f"not valid JSON ({e})") from e
    if not isinstance(data, dict):
        raise ModelDirError(path.name, f"expected a JSON object, got {type(data).__name__}")
    return data


def _read_merges(path: Path) -> list[tuple[str, str]]:
    if not path.is_file():
        raise ModelDirError(path.name, f"missing (expected BPE merges at {path})")
    merges = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line or (n == 1 and line.startswith("#version")):
            continue
        parts = line.split(" ")
        if len(parts) != 2:
            raise ModelDirError(path.name, f"line {n} is not a 'left right' merge: {line!r}")
        merges.append((parts[0], parts[1]))
    return merges


def _base_tokenizer(d: Path) -> Tokenizer:
    if (d / "tokenizer.json").is_file():  # what transformers would prefer, if present
        try:
            return Tokenizer.from_file(str(d / "tokenizer.json"))
        except Exception as e:  # noqa: BLE001 - tokenizers raises plain Exception
            raise ModelDirError("tokenizer.json", f"cannot be loaded ({e})") from e
    vocab = _read_json(d / "vocab.json", "the BPE vocabulary")
    merges = _read_merges(d / "merges.txt")
    try:
        model = BPE(vocab=vocab, merges=merges, dropout=None, unk_token=None,
                    continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False,
                    byte_fallback=False)
    except Exception as e:  # noqa: BLE001
        raise ModelDirError("vocab.json", f"not a valid BPE together with merges.txt ({e})") from e
    return qwen2_pipeline(model)


def _add_special(tok: Tokenizer, content: str, flags: dict | None = None, expect_id: int | None = None,
                 source: str = "") -> None:
    flags = flags or {}
    tok.add_special_tokens([AddedToken(
        content, special=True, normalized=bool(flags.get("normalized", False)),
        lstrip=bool(flags.get("lstrip", False)), rstrip=bool(flags.get("rstrip", False)),
        single_word=bool(flags.get("single_word", False)))])
    got = tok.token_to_id(content)
    if expect_id is not None and got != expect_id:
        raise ModelDirError(source, f"special token {content!r} is declared with id {expect_id} but lands "
                                     f"at id {got} (vocab.json has {tok.get_vocab_size(False)} entries)")


@functools.lru_cache(maxsize=8)
def _load(dir_str: str, kind: str = "cosyvoice2") -> Tokenizer:
    d = Path(dir_str)
    if not d.is_dir():
        raise ModelDirError(d.name, f"missing (expected the CosyVoice-BlankEN tokenizer directory at {d})")
    tok = _base_tokenizer(d)
    cfg = _read_json(d / "tokenizer_config.json", "the tokenizer config") \
        if (d / "tokenizer_config.json").is_file() else {}
    declared = cfg.get("added_tokens_decoder", {}) or {}
    try:
        entries = sorted((int(i), v) for i, v in declared.items())
    except (TypeError, ValueError) as e:
        raise ModelDirError("tokenizer_config.json", f"bad added_tokens_decoder ({e})") from e
    for i, spec in entries:
        if not isinstance(spec, dict) or "content" not in spec:
            raise ModelDirError("tokenizer_config.json", f"added_tokens_decoder[{i}] has no 'content'")
        _add_special(tok, spec["content"], spec, expect_id=i, source="tokenizer_config.json")
    for content in (EOS_TOKEN, *SPECIAL_TOKENS[kind]):
        _add_special(tok, content)
    return tok


class TextTokenizer:
    """Text -> Qwen2 token ids exactly as upstream `CosyVoice2Tokenizer` / `CosyVoice3Tokenizer`
    (no BOS/EOS added)."""

    def __init__(self, tokenizer: Tokenizer, source: Path | None = None, kind: str = "cosyvoice2"):
        self._tok = tokenizer
        self.source = source
        self.kind = kind

    @classmethod
    def from_dir(cls, blank_en_dir: str | Path, kind: str = "cosyvoice2") -> "TextTokenizer":
        """Load from a `CosyVoice-BlankEN` directory (vocab.json + merges.txt + tokenizer_config.json,
        or tokenizer.json) with the special tokens of model `kind`. Cached per (directory, kind)."""
        if kind not in SPECIAL_TOKENS:
            raise ValueError(f"unknown model kind {kind!r}; one of {sorted(SPECIAL_TOKENS)}")
        d = Path(blank_en_dir).resolve()
        return cls(_load(str(d), kind), d, kind)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_id(self, token: str) -> int:
        i = self._tok.token_to_id(token)
        if i is None:
            raise KeyError(f"token {token!r} is not in the tokenizer ({self.source})")
        return i

    @property
    def eos_id(self) -> int:
        return self.token_id(EOS_TOKEN)

    @property
    def special_ids(self) -> dict[str, int]:
        """`<|endoftext|>` and the kind's special tokens with their ids, in upstream order."""
        return {t: self.token_id(t) for t in (EOS_TOKEN, *SPECIAL_TOKENS[self.kind])}

    def __len__(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def __repr__(self) -> str:
        return f"TextTokenizer(len={len(self)}, source={self.source})"
