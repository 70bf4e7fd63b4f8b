"""Stop strings on streamed text: finding one, and holding back a partial one.

A streamed text must never show the start of a stop string that later completes, so the
text side holds back the longest suffix of the output that is a proper prefix of some stop
string. Recomputing that from scratch costs O(len(stop)^2) per stop and per step in the
worst case (32 stops of 1,000 characters: ~9 ms per output); :class:`PartialStopTracker`
keeps one Knuth-Morris-Pratt automaton state per stop string instead, so each new
character costs O(1) amortized per stop (Knuth, Morris, Pratt, "Fast pattern matching in
strings", SIAM J. Comput. 6(2), 1977).
"""

from __future__ import annotations


def find_stop(text: str, stops: list[str], start: int = 0) -> tuple[int, str] | None:
    """Earliest ``(index, stop_string)`` of any stop string in ``text[start:]``; at one
    index, the first in ``stops``."""
    best = None
    for s in stops:
        i = text.find(s, start)
        if i >= 0 and (best is None or i < best[0]):
            best = (i, s)
    return best


def hold_back(text: str, stops: list[str]) -> str:
    """``text`` without its longest suffix that is a proper prefix of a stop string."""
    tracker = PartialStopTracker(stops)
    tracker.feed(text)
    return text[:len(text) - tracker.held()]


def _failure(pattern: str) -> list[int]:
    """KMP failure function: ``f[i]`` is the length of the longest proper prefix of
    ``pattern[:i + 1]`` that is also its suffix."""
    f, k = [0] * len(pattern), 0
    for i in range(1, len(pattern)):
        while k and pattern[i] != pattern[k]:
            k = f[k - 1]
        if pattern[i] == pattern[k]:
            k += 1
        f[i] = k
    return f


class PartialStopTracker:
    """How much of a growing text to hold back for ``stops`` (non-empty strings).

    Feed it the whole text each time (it must usually extend the last one fed; a text that
    does not is re-read from the start). Building costs O(sum of stop lengths).
    """

    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self._fail = [_failure(s) for s in self.stops]
        self._state = [0] * len(self.stops)
        self._text = ""

    def feed(self, text: str) -> None:
        if not text.startswith(self._text):
            self._state, self._text = [0] * len(self.stops), ""
        new, self._text = text[len(self._text):], text
        if not new:
            return
        for k, (stop, fail) in enumerate(zip(self.stops, self._fail)):
            q, n = self._state[k], len(stop)
            for ch in new:
                if q == n:
                    q = fail[q - 1]
                while q and stop[q] != ch:
                    q = fail[q - 1]
                if stop[q] == ch:
                    q += 1
            self._state[k] = q

    def held(self) -> int:
        """Length of the longest suffix of the text fed that is a proper prefix of a stop."""
        best = 0
        for q, stop, fail in zip(self._state, self.stops, self._fail):
            best = max(best, fail[q - 1] if q == len(stop) else q)
        return best
