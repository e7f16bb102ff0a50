"""Suffix decoding (after Arctic's): drafts from a suffix trie over recent requests' outputs, and from the request's
own prompt and output.

    trie     every substring of up to `max_depth` tokens of the last `max_cached_requests` outputs, each node
             counting how often its path occurred (a request's output joins when it finishes, the oldest leaves)
    memory   at most `max_tree_nodes` nodes: past it the oldest outputs leave, whole (as Arctic evicts), and an
             output that alone could exceed it joins with only its first max_tree_nodes // max_depth tokens
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
        max_tree_nodes: Optional[int] = 1_000_000,
    ):
        self.num_speculative_tokens = num_speculative_tokens
        self.max_depth = max_depth
        self.max_cached_requests = max_cached_requests
        self.max_spec_factor = max_spec_factor
        self.min_token_prob = min_token_prob
        self.max_tree_nodes = max_tree_nodes
        self.num_nodes = 0  # in the trie, its root not counted
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
        """Cache a finished request's output, evicting the oldest beyond `max_cached_requests` or
        `max_tree_nodes` (never this one: it is cut to fit on its own)."""
        output = tuple(output_token_ids[: self._max_tokens_per_output])
        if self.max_cached_requests <= 0 or not output:
            return
        self._cached.append(output)
        self._add(output)
        while len(self._cached) > self.max_cached_requests or (
            self.max_tree_nodes is not None and self.num_nodes > self.max_tree_nodes and len(self._cached) > 1
        ):
            self._remove(self._cached.popleft())

    @property
    def _max_tokens_per_output(self) -> Optional[int]:
        # n tokens add at most n x max_depth nodes (a path per start): this many fit in an empty trie
        return None if self.max_tree_nodes is None else self.max_tree_nodes // self.max_depth

    def _add(self, tokens: tuple[int, ...]) -> None:
        """Count every substring of up to max_depth tokens of `tokens`."""
        for start in range(len(tokens)):
            node = self._root
            for token_id in tokens[start : start + self.max_depth]:
                child = node.children.get(token_id)
                if child is None:
                    child = node.children[token_id] = _Node()
                    self.num_nodes += 1
                child.count += 1
                node = child

    def _remove(self, tokens: tuple[int, ...]) -> None:
        """Uncount what `_add(tokens)` counted: the trie is then the one that never held `tokens`."""
        for start in range(len(tokens)):
            node = self._root
            for token_id in tokens[start : start + self.max_depth]:
                child = node.children[token_id]
                child.count -= 1
                if child.count == 0:
                    # a path's extensions occur only where it does: none of the subtree is counted any more
                    del node.children[token_id]
                    self.num_nodes -= _subtree_size(child)
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


def _subtree_size(node: _Node) -> int:
    size = 0
    stack = [node]
    while stack:
        top = stack.pop()
        size += 1
        stack.extend(top.children.values())
    return size
