"""StreamSynthesize input: text pieces as they arrive -> complete sentences to synthesize."""
from __future__ import annotations

from typing import AsyncIterable, AsyncIterator

from ..request import FLUSH

_SENTENCE_END = set("。！？；!?;…\n")
_TRAILING = set("。！？；!?;….\"'”’)）」』】》")
_SOFT_BREAK = set(",，、:：")


class SentenceSplitter:
    """Buffers text pieces and cuts complete sentences.

    A sentence ends at 。！？；!?;… or a newline (plus any closing quotes/brackets and repeated
    enders already received), or at '.' followed by whitespace (so "3.14" stays whole; a final
    '.' waits for the next piece or the end). Text longer than `max_chars` without an end is cut
    at the last comma or space (else hard) so latency stays bounded.
    """

    def __init__(self, max_chars: int = 200):
        self.max_chars = max(8, max_chars)
        self._buf = ""

    @property
    def pending(self) -> str:
        return self._buf

    def feed(self, piece: str) -> list[str]:
        self._buf += piece
        return self._cut()

    def flush(self) -> list[str]:
        out = self._cut()
        rest, self._buf = self._buf, ""
        return out + _keep([rest])

    def _end(self) -> int | None:
        buf = self._buf
        for i, ch in enumerate(buf):
            if ch in _SENTENCE_END or (ch == "." and i + 1 < len(buf) and buf[i + 1].isspace()):
                j = i + 1
                while j < len(buf) and buf[j] in _TRAILING:
                    j += 1
                return j
        return None

    def _cut(self) -> list[str]:
        out = []
        while (j := self._end()) is not None:
            out.append(self._buf[:j])
            self._buf = self._buf[j:]
        while len(self._buf) > self.max_chars:
            head = self._buf[:self.max_chars]
            cut = max((i + 1 for i, ch in enumerate(head) if ch in _SOFT_BREAK or ch.isspace()), default=0)
            if cut < self.max_chars // 2:
                cut = self.max_chars
            out.append(self._buf[:cut])
            self._buf = self._buf[cut:]
        return _keep(out)


def _keep(sentences: list[str]) -> list[str]:
    """Stripped sentences that have something to say (punctuation-only pieces are dropped)."""
    return [s.strip() for s in sentences if any(ch.isalnum() for ch in s)]


async def complete_sentences(pieces: AsyncIterable[str | object], max_chars: int = 200) -> AsyncIterator[str]:
    """Sentences as soon as they are complete, from text pieces (`FLUSH` cuts what is buffered);
    the rest when the pieces end."""
    splitter = SentenceSplitter(max_chars)
    async for piece in pieces:
        for sentence in splitter.flush() if piece is FLUSH else splitter.feed(piece):
            yield sentence
    for sentence in splitter.flush():
        yield sentence
