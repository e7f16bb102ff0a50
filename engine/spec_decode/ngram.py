"""N-gram prompt lookup: the draft is what followed the latest earlier occurrence of the sequence's last n tokens.

    tokens   ... a b c d e ... x y a b c            (n = 3: the suffix "a b c" occurred before)
                     ^^^^^ ^^^                      draft: "d e ..." (up to k tokens)

Longer n-grams are tried first (from `prompt_lookup_max` down to `prompt_lookup_min`); among the occurrences of one,
the latest wins, as the most likely to continue the way the text goes now; a continuation that reaches the end of
the sequence goes on with the period the two occurrences imply (a loop keeps looping). Pure Python: the search is a `bytes.rfind`
over the token ids packed as 32-bit integers, so the scheduler asks it for every decoding request at C speed.
"""

from __future__ import annotations

from array import array
from typing import Optional, Sequence

_ITEM = 4  # bytes per packed token id


class NgramProposer:
    """The `DraftProposer` of `{"method": "ngram"}`: drafts copied from the request's own prompt and output."""

    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int):
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(
                f"need 1 <= prompt_lookup_min ({prompt_lookup_min}) <= prompt_lookup_max ({prompt_lookup_max})"
            )
        self.num_speculative_tokens = num_speculative_tokens
        self.prompt_lookup_min = prompt_lookup_min
        self.prompt_lookup_max = prompt_lookup_max

    def propose(self, token_ids: Sequence[int], max_num_tokens: int) -> list[int]:
        num_tokens = len(token_ids)
        if max_num_tokens <= 0 or num_tokens <= self.prompt_lookup_min:
            return []
        packed = array("i", token_ids).tobytes()
        for n in range(min(self.prompt_lookup_max, num_tokens - 1), self.prompt_lookup_min - 1, -1):
            start = self._latest_earlier(packed, num_tokens, n)
            if start is not None:
                # Continued periodically past the end: an occurrence that ran into the end repeats itself
                # (in "a b a b a", the suffix "b a" occurs at 1, followed by one token only, then "b a b ...").
                follow = start + n
                period = num_tokens - follow
                return [token_ids[follow + i % period] for i in range(max_num_tokens)]
        return []

    def on_request_finished(self, output_token_ids: Sequence[int]) -> None:
        """Nothing: the n-gram lookup reads the request's own tokens only."""

    @staticmethod
    def _latest_earlier(packed: bytes, num_tokens: int, n: int) -> Optional[int]:
        """The start of the latest occurrence of the last n tokens that ends before the sequence does."""
        suffix = packed[(num_tokens - n) * _ITEM :]
        end = (num_tokens - 1) * _ITEM  # an occurrence must leave at least one token after it
        while True:
            found = packed.rfind(suffix, 0, end)
            if found < 0:
                return None
            if found % _ITEM == 0:
                return found // _ITEM
            end = found + len(suffix) - 1  # matched across token boundaries: look further left
