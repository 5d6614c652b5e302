"""`stop` sequences, watched by the gateway rather than by vLLM.

The gateway checks the text of the tokens as they arrive, so a stop string that straddles a
weight-sync cut (two upstream requests) is still found. When one appears, the call ends with
`finish_reason: "stop"` at the token that completed it; the tokens up to there stay recorded as
sampled, and the answer's text ends before the stop string, as OpenAI's does.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

# A byte-level BPE token holds at least one byte and a character at most four: a stop string of
# n characters completes within the last 4n tokens that have text (+1 for a token it starts in
# the middle of). Special tokens have none in the answer (they decode to nothing).
_BYTES_PER_CHAR = 4


class StopScanner:
    def __init__(
        self,
        stops: Sequence[str],
        decode: Callable[[list[int]], str],
        silent: Collection[int] = frozenset(),
    ) -> None:
        """`decode` turns ids into the answer's text; `silent` are the ids it turns into
        nothing (the special tokens it skips)."""
        self.stops = [s for s in stops if s]
        self._decode = decode
        self._silent = silent
        self._window = _BYTES_PER_CHAR * max((len(s) for s in self.stops), default=0) + 1

    def scan(self, ids: Sequence[int], start: int) -> int | None:
        """The number of tokens to keep if a stop string completes in ids[start:], else None."""
        for end in range(max(start, 0) + 1, len(ids) + 1):
            if ids[end - 1] in self._silent:
                continue  # no text added: no stop string completed here
            text = self._decode(list(ids[self._window_start(ids, end) : end]))
            if any(stop in text for stop in self.stops):
                return end
        return None

    def _window_start(self, ids: Sequence[int], end: int) -> int:
        """Where the window of the last `_window` tokens with text before `end` begins.

        Silent tokens inside a stop string do not count: nine of them between "a" and "b"
        hid the stop string "ab" from a window counted in tokens (found by property tests,
        issue 18). Walking back over them costs no more than decoding them, which the window
        does anyway.
        """
        begin, counted = end, 0
        while begin > 0 and counted < self._window:
            begin -= 1
            if ids[begin] not in self._silent:
                counted += 1
        return begin


def cut_at_stop(text: str, stops: Sequence[str]) -> tuple[str, bool]:
    """`text` up to its first stop string, and whether one was found."""
    found = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    return (text[: min(found)], True) if found else (text, False)


def as_list(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)
