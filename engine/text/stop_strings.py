"""Stop strings over streamed text: find the first one, hold back what could start one.

The output ends at the first moment any stop string is complete: the occurrence
with the smallest end position in the text (of those ending there, the longest).
That moment does not depend on how the text was split into deltas, so neither
does the result (vLLM, which checks per token, takes the first stop string in list
order among those found in one token's text; the two agree except on such ties).
The final text is the output up to the start of that occurrence
(up to its end with `include_stop_str_in_output`); nothing after it is emitted.

While streaming, the longest suffix of the text that is a proper prefix of some
stop string is held back until later text completes or rules it out:

    emitted          held
    "The answer is " "##"        stop = ["###"]: "##" may become "###"

Any occurrence not yet complete starts inside the held suffix, so each delta is
searched together with the held text only: the cost per delta is
O((longest stop string + len(delta)) * number of stop strings) for the search, plus
one regex search over the last (longest - 1) characters for the suffix to hold,
whatever the output length.
"""

from __future__ import annotations

import re
from typing import NamedTuple, Optional, Sequence


class StopMatch(NamedTuple):
    """What `StopStringMatcher.add_text` found: text safe to emit now, and the stop hit if any."""

    text: str = ""
    stop: Optional[str] = None


class StopStringMatcher:
    """Finds stop strings in streamed text and holds back text that could be the start of one.

    Feed text deltas with `add_text`; once it reports a stop, the request is done
    and later text is ignored. If the request finishes for another reason, pass the
    detokenizer's `flush()` through `add_text` first (it may still complete a stop
    string), then `flush` releases the held-back text. Across all calls, the emitted
    text is the output text cut as described in the module docstring.
    """

    __slots__ = ("_stops", "_prefix_at_end", "_max_held", "_include_stop", "_held", "_stopped")

    def __init__(self, stop: Sequence[str], include_stop_str_in_output: bool = False):
        if isinstance(stop, str):
            raise TypeError("stop must be a sequence of strings, not a string")
        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty")
        self._stops = tuple(dict.fromkeys(stop))
        prefixes = sorted({s[:n] for s in self._stops for n in range(1, len(s))}, key=len, reverse=True)
        # leftmost match = longest suffix of the text that is a proper prefix of a stop string
        self._prefix_at_end = re.compile("(?:%s)\\Z" % "|".join(map(re.escape, prefixes))) if prefixes else None
        self._max_held = max((len(s) - 1 for s in self._stops), default=0)
        self._include_stop = include_stop_str_in_output
        self._held = ""
        self._stopped = False

    @property
    def stopped(self) -> bool:
        """Whether a stop string has been hit."""
        return self._stopped

    @property
    def held_text(self) -> str:
        """Text received but not yet emitted (a possible start of a stop string)."""
        return self._held

    def add_text(self, delta: str) -> StopMatch:
        """Take the next piece of output text; return what can be emitted and any stop hit."""
        if self._stopped:
            return StopMatch()
        if not self._stops:
            return StopMatch(delta)
        text = self._held + delta
        hit = self._first_stop(text)
        if hit is not None:
            start, stop = hit
            self._held = ""
            self._stopped = True
            end = start + len(stop) if self._include_stop else start
            return StopMatch(text[:end], stop)
        keep = self._held_suffix_len(text)
        self._held = text[len(text) - keep :] if keep else ""
        return StopMatch(text[: len(text) - keep])

    def flush(self) -> str:
        """At a finish for another reason: release (and forget) the held-back text."""
        held, self._held = self._held, ""
        return held

    def _first_stop(self, text: str) -> Optional[tuple[int, str]]:
        """(start, stop string) of the occurrence in `text` that ends first, longest on a tie."""
        best: Optional[tuple[int, str]] = None
        best_end = 0
        for stop in self._stops:
            start = text.find(stop)
            if start < 0:
                continue
            end = start + len(stop)
            if best is None or end < best_end or (end == best_end and start < best[0]):
                best, best_end = (start, stop), end
        return best

    def _held_suffix_len(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        if self._prefix_at_end is None:
            return 0
        match = self._prefix_at_end.search(text, max(0, len(text) - self._max_held))
        return 0 if match is None else len(text) - match.start()
