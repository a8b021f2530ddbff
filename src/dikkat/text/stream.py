"""Token ids → text, incrementally: whole characters only, and never past a stop string.

A byte-level tokenizer (dikkat's :class:`~dikkat.text.ByteTokenizer`, GPT-2's BPE) can end a
token in the middle of a multi-byte UTF-8 character; its ``decode`` then ends in U+FFFD, the
replacement character. :class:`TextStream` holds such a tail back until the next token completes
it (or the request ends), and holds back any tail that could still grow into a stop string, so a
streamed piece is never taken back.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

REPLACEMENT = "\ufffd"


class Decoder(Protocol):
    def decode(self, ids: list[int]) -> str: ...


class TextStream:
    """The text of a growing list of token ids, released piece by piece.

    ``push(token)`` returns the new text that is safe to show (possibly ``""``) and sets
    :attr:`stopped` when the text now holds one of ``stops``: the text is then cut before the
    first stop string, and later pushes are refused. ``finish()`` returns whatever was held back.
    """

    def __init__(self, tokenizer: Decoder, stops: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stops = tuple(stops)
        self.ids: list[int] = []
        self.text = ""  # the decoded text so far, cut at a stop string once one is found
        self.shown = 0  # characters of self.text already released
        self.stopped = False

    def push(self, token: int) -> str:
        if self.stopped:
            raise ValueError("the text already reached a stop string; no token can follow it")
        self.ids.append(token)
        self.text = self.tokenizer.decode(self.ids)
        cut = self._first_stop()
        if cut is not None:
            self.text, self.stopped = self.text[:cut], True
            return self._release(len(self.text))
        end = len(self.text)
        while end > self.shown and self.text[end - 1] == REPLACEMENT:
            end -= 1  # an incomplete character, or an invalid one: wait for the next token
        return self._release(end - self._stop_prefix(end))

    def finish(self) -> str:
        """The rest of the text (a held-back tail is final once no token follows)."""
        return self._release(len(self.text))

    def _first_stop(self) -> int | None:
        # a stop string can only end in the newly decoded tail, but it may begin anywhere after
        # the released text minus its own length, so search from there
        start = max(0, self.shown - max((len(s) for s in self.stops), default=0))
        found = [i for s in self.stops if (i := self.text.find(s, start)) >= 0]
        return min(found) if found else None

    def _stop_prefix(self, end: int) -> int:
        """How many characters before ``end`` could be the start of a stop string."""
        longest = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, end - self.shown), longest, -1):
                if self.text[end - k : end] == s[:k]:
                    longest = k
                    break
        return longest

    def _release(self, end: int) -> str:
        end = max(end, self.shown)
        piece = self.text[self.shown : end]
        self.shown = end
        return piece
