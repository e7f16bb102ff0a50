"""Suffix decoding (after Arctic's): drafts from a suffix trie over recent requests' outputs, and from the request's
own prompt and output.

    trie     every substring of up to `max_depth` tokens of the last `max_cached_requests` outputs, each node
             counting how often its path occurred (a request's output joins when it finishes, the oldest leaves)
    match    the longest suffix of the sequence (up to max_depth - 1 tokens) that is a path of the trie
    draft    from there the most frequent child, while the path's probability (the product of each child's
             share of its parent's count) stays >= `min_token_prob`, for at most max_spec_factor x the match
             length tokens (a long match earns a long draft) and k

The request's own tokens are searched as the n-gram proposer does (`NgramProposer`, n-grams up to max_depth - 1);
the longer of the two matches wins. Pure Python: a finished request costs O(output x max_depth) trie steps once.
"""

from __future__ import annotations

from collections import deque
from typing import Optional, Sequence

from engine.spec_decode.ngram import NgramProposer


class _Node:
    __slots__ = ("count", "children")

    def __init__(self) -> None:
        self.count = 0
        self.children: dict[int, _Node] = {}


class SuffixProposer:
    """The `DraftProposer` of `{"method": "suffix"}`."""

    def __init__(
        self,
        num_speculative_tokens: int,
        max_depth: int = 24,
        max_cached_requests: int = 1000,
        max_spec_factor: float = 1.0,
        min_token_prob: float = 0.1,
    ):
        self.num_speculative_tokens = num_speculative_tokens
        self.max_depth = max_depth
        self.max_cached_requests = max_cached_requests
        self.max_spec_factor = max_spec_factor
        self.min_token_prob = min_token_prob
        self._root = _Node()
        self._cached: deque[tuple[int, ...]] = deque()
        self._own = NgramProposer(num_speculative_tokens, 1, max(max_depth - 1, 1))

    def propose(self, token_ids: Sequence[int], max_num_tokens: int) -> list[int]:
        node, match = self._longest_match(token_ids)
        limit = min(max_num_tokens, int(self.max_spec_factor * match))
        own = self._own.propose(token_ids, max_num_tokens)  # its own tokens: a match of >= 1 (ngram's min)
        if node is None or limit <= 0:
            return own
        draft = self._follow(node, limit)
        return draft if len(draft) >= len(own) else own

    def on_request_finished(self, output_token_ids: Sequence[int]) -> None:
        """Cache a finished request's output (evicting the oldest beyond `max_cached_requests`)."""
        if self.max_cached_requests <= 0 or not output_token_ids:
            return
        output = tuple(output_token_ids)
        self._cached.append(output)
        self._update(output, +1)
        while len(self._cached) > self.max_cached_requests:
            self._update(self._cached.popleft(), -1)

    def _update(self, tokens: tuple[int, ...], delta: int) -> None:
        """Add (+1) or remove (-1) every substring of up to max_depth tokens of `tokens`."""
        for start in range(len(tokens)):
            node = self._root
            for token_id in tokens[start : start + self.max_depth]:
                child = node.children.get(token_id)
                if child is None:
                    child = node.children[token_id] = _Node()
                child.count += delta
                if child.count <= 0:
                    del node.children[token_id]  # its subtree counted only occurrences removed now
                    break
                node = child

    def _longest_match(self, token_ids: Sequence[int]) -> tuple[Optional[_Node], int]:
        """The trie node of the longest suffix of `token_ids` that is a path, and its length."""
        for length in range(min(self.max_depth - 1, len(token_ids)), 0, -1):
            node: Optional[_Node] = self._root
            for token_id in token_ids[len(token_ids) - length :]:
                assert node is not None  # the loop stops at the first missing child
                node = node.children.get(token_id)
                if node is None:
                    break
            if node is not None and node.children:
                return node, length
        return None, 0

    def _follow(self, node: _Node, limit: int) -> list[int]:
        draft: list[int] = []
        probability = 1.0
        while node.children and len(draft) < limit:
            token_id, child = max(node.children.items(), key=lambda item: item[1].count)
            probability *= child.count / sum(c.count for c in node.children.values())
            if probability < self.min_token_prob:
                break
            draft.append(token_id)
            node = child
        return draft
