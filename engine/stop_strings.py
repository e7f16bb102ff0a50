"""Stop strings over streamed text: find the first one, hold back what could start one.

The output ends at the first moment any stop string is complete: the occurrence
with the smallest end position in the text (of those ending there, the longest).
That moment does not depend on how the text was split into deltas, so neither
does the result. The final text is the output up to the start of that occurrence
(up to its end with `include_stop_str_in_output`); nothing after it is emitted.

While streaming, the longest suffix of the text that is a proper prefix of some
stop string is held back until later text completes or rules it out:

    emitted          held
    "The answer is " "##"        stop = ["###"]: "##" may become "###"

Any occurrence not yet complete starts inside the held suffix, so each delta is
searched together with the held text only: the cost per delta is
O((longest stop string + len(delta)) * number of stop strings).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence


@dataclass(frozen=True, slots=True)
class StopMatch:
    """What `StopStringMatcher.add_text` found: text safe to emit now, and the stop hit if any."""

    text: str = ""
    stop: Optional[str] = None


class StopStringMatcher:
    """Finds stop strings in streamed text and holds back text that could be the start of one.

    Feed text deltas with `add_text`; once it reports a stop, the request is done
    and later text is ignored. If the request finishes for another reason, `flush`
    releases the held-back text. Across all calls, the emitted text is the output
    text cut as described in the module docstring.
    """

    __slots__ = ("_stops", "_prefixes", "_max_held", "_include_stop", "_held", "_stopped")

    def __init__(self, stop: Sequence[str], include_stop_str_in_output: bool = False):
        if isinstance(stop, str):
            raise TypeError("stop must be a sequence of strings, not a string")
        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty")
        self._stops = tuple(dict.fromkeys(stop))
        self._prefixes = frozenset(s[:n] for s in self._stops for n in range(1, len(s)))
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
        prefixes = self._prefixes
        for n in range(min(len(text), self._max_held), 0, -1):
            if text[len(text) - n :] in prefixes:
                return n
        return 0
