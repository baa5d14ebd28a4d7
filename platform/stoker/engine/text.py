"""Turning a growing list of generated tokens into text deltas, honouring stop strings.

Two things make this more than `decode`: a token may end halfway through a UTF-8 character (the
tokenizer then yields U+FFFD, which must not reach the client), and a stop string may arrive split
across tokens, so the text that could be the start of one is held back until it is either
completed (generation stops, the stop string is not returned, as OpenAI does) or ruled out.

Until `min_tokens` are generated stop strings do not count (`check_stop=False`), as in vLLM: a stop
string wholly inside that text is never matched later, one that ends after it is.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

REPLACEMENT = "\ufffd"


class TextTracker:
    def __init__(self, decode: Callable[[Sequence[int]], str], stop: Sequence[str] = ()) -> None:
        self._decode = decode
        self._stop = tuple(stop)
        self._emitted = 0  # characters of the decoded text already handed out
        self._stop_from = 0  # stop strings must end after this many characters (min_tokens' text)
        self.text = ""
        self.stopped = False

    def update(self, tokens: Sequence[int], check_stop: bool = True) -> str:
        """Decode `tokens` (all generated so far) and return the new text that is safe to send."""
        text = self._decode(tokens)
        if not check_stop:  # nothing stops yet, but what could begin a stop string still waits
            self._stop_from = len(text.rstrip(REPLACEMENT))
            self.text = text
            return self._take(len(text) - self._held_back(text))
        earliest = -1
        for s in self._stop:
            at = text.find(s, max(0, self._emitted - len(s) + 1, self._stop_from - len(s) + 1))
            if at != -1 and (earliest == -1 or at < earliest):
                earliest = at
        if earliest != -1:
            text = text[:earliest]
            self.stopped = True
        self.text = text
        if self.stopped:
            return self._take(len(text))
        safe = len(text) - self._held_back(text)
        return self._take(safe)

    def flush(self) -> str:
        """The rest of the text once generation has ended for another reason than a stop string."""
        return self._take(
            len(self.text.rstrip(REPLACEMENT)) if self.text.endswith(REPLACEMENT) else len(self.text)
        )

    def _take(self, upto: int) -> str:
        if upto <= self._emitted:
            return ""
        delta = self.text[self._emitted : upto]
        self._emitted = upto
        return delta

    def _held_back(self, text: str) -> int:
        """How many trailing characters must wait: a partial character, or a possible stop-string start."""
        hold = 0
        if text.endswith(REPLACEMENT):
            hold = len(text) - len(text.rstrip(REPLACEMENT))
        for s in self._stop:
            for k in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:k]):
                    hold = max(hold, k)
                    break
        return hold
