"""Incremental stop-string matching for streamed text.

A slot feeds each newly detokenized piece of text to its `StopMatcher` and emits only what
`feed` returns, so a client never sees the beginning of a stop string that later completes.

Invariants:
- `_held` is the longest suffix of the text fed so far (and not yet emitted) that is a proper
  prefix of some stop string; it never contains a whole stop. So it is shorter than the longest
  stop, and each `feed` scans only `_held + text`, never the whole history.
- The match reported is the first stop string to *complete* when the text is read left to right
  (earliest end; on a tie, the longest one, i.e. the one that starts first). This makes the result
  independent of how the text is split into pieces: with stops ("abc", "b") the text "abc"
  stops at "b", whether it arrives as "abc" or as "a", "b", "c". Everything before the start of
  that match is emitted; the stop itself and anything after it are dropped.
- After a match the matcher is finished: further `feed` calls return ("", None) and `flush`
  returns "" (the slot stops generating on a match, so this only guards against stray calls).

Cost per feed: one `str.find` per stop over `_held + text` (C speed), plus a hold-back check over
at most `max_stop_len - 1` tail positions, each a `startswith` per stop sharing that first char.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopMatcher:
    """Finds stop strings in text that arrives piece by piece; see the module docstring."""

    def __init__(self, stops: Sequence[str]) -> None:
        # Empty stops would match everywhere; duplicates only cost time.
        self.stops: tuple[str, ...] = tuple(dict.fromkeys(s for s in stops if s))
        self._max_hold = max((len(s) for s in self.stops), default=1) - 1
        self._by_first_char: dict[str, tuple[str, ...]] = {}
        for stop in self.stops:
            self._by_first_char[stop[0]] = (*self._by_first_char.get(stop[0], ()), stop)
        self._held = ""
        self.matched: str | None = None

    @property
    def is_done(self) -> bool:
        """True once a stop string has matched."""
        return self.matched is not None

    def feed(self, text: str) -> tuple[str, str | None]:
        """Add `text`; return (text safe to emit now, the stop string that matched or None)."""
        if not self.stops:
            return text, None
        if self.matched is not None:
            return "", None
        buf = self._held + text
        match = self._first_match(buf)
        if match is not None:
            start, stop = match
            self._held = ""
            self.matched = stop
            return buf[:start], stop
        keep = self._held_suffix_len(buf)
        self._held = buf[len(buf) - keep :]
        return buf[: len(buf) - keep], None

    def flush(self) -> str:
        """End of stream: return the held-back text (it never became a stop string)."""
        held, self._held = self._held, ""
        return held

    def _first_match(self, buf: str) -> tuple[int, str] | None:
        best: tuple[int, int, str] | None = None  # (end, -len, stop): earliest end, then longest
        for stop in self.stops:
            i = buf.find(stop)
            if i >= 0:
                key = (i + len(stop), -len(stop), stop)
                if best is None or key < best:
                    best = key
        if best is None:
            return None
        end, neg_len, stop = best
        return end + neg_len, stop

    def _held_suffix_len(self, buf: str) -> int:
        """Length of the longest suffix of `buf` that is a proper prefix of some stop."""
        n = len(buf)
        for i in range(max(0, n - self._max_hold), n):  # longest candidate first
            candidates = self._by_first_char.get(buf[i])
            if candidates is not None:
                tail = buf[i:]
                if any(stop.startswith(tail) for stop in candidates):
                    return n - i
        return 0
