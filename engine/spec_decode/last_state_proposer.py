"""The proposer of the methods that draft from the target's last hidden state alone, with no KV cache of their own:
Medusa's heads (engine/spec_decode/medusa.py) and IBM's MLP speculator (engine/spec_decode/mlp_speculator.py).

After a step the request holds n tokens, the last sampled from the target's final hidden state at position n - 2
(after its final norm: what its LM head reads). The drafter reads that state, and the token it sampled (token
n - 1), and guesses tokens n, n + 1, ... The features arrive as EAGLE's do: the runner puts each step's final hidden
states in its output (`draft_features = "final"`) and the scheduler hands them to `observe`, before the step's tokens
are known; the proposer keeps the rows that sampled a token (the request's last position before the step, and its
drafts'), one of which is position n - 2 once the accepted ones are appended.
"""

from __future__ import annotations

from typing import Mapping, Protocol, Sequence, cast

import torch

from scheduler import DraftQuery


class LastStateDrafter(Protocol):
    """What drafts from the target's last hidden state: `len` the most tokens it guesses."""

    def __len__(self) -> int: ...

    def draft(
        self, features: torch.Tensor, last_tokens: torch.Tensor, num_heads: int, vocab_limit: int
    ) -> list[list[int]]:
        """features [n, hidden] at position n - 2 and last_tokens [n] (token n - 1) -> each row's `num_heads`
        guesses (target ids below `vocab_limit`)."""
        ...


class LastStateProposer:
    """The `FeatureDraftProposer` of `{"method": "medusa"}` and `{"method": "mlp_speculator"}`: it keeps, per
    request, the target's final hidden states of the rows that sampled a token in the request's last step, and
    drafts from the one at position n - 2."""

    def __init__(self, drafter: LastStateDrafter, num_speculative_tokens: int, vocab_limit: int):
        if num_speculative_tokens > len(drafter):
            raise ValueError(f"{num_speculative_tokens} draft tokens asked of a drafter of {len(drafter)}")
        self.drafter = drafter
        self.num_speculative_tokens = num_speculative_tokens
        self.vocab_limit = vocab_limit
        self._features: dict[str, tuple[int, torch.Tensor]] = {}  # request -> (first position, [rows, hidden])

    @property
    def num_requests(self) -> int:
        """Requests the proposer holds features of."""
        return len(self._features)

    def observe(self, features: Mapping[str, object], requests: Sequence[DraftQuery]) -> None:
        """Keep each request's rows at positions from its last token on (before the step's: the rows that
        sampled). A prompt chunk short of the prompt's end sampled nothing: none kept."""
        for request in requests:
            start, rows = cast(tuple[int, torch.Tensor], features[request.request_id])
            skip = max(len(request.token_ids) - 1 - start, 0)
            if skip < rows.shape[0]:
                # a copy: a view would keep the step's whole [tokens, hidden] output alive
                self._features[request.request_id] = (start + skip, rows[skip:].clone())
            else:
                self._features.pop(request.request_id, None)

    @torch.inference_mode()
    def propose_batch(self, queries: Sequence[DraftQuery]) -> list[Sequence[int]]:
        drafts: list[Sequence[int]] = [[] for _ in queries]
        picked, rows, last_tokens = [], [], []
        for index, query in enumerate(queries):
            kept = self._features.get(query.request_id)
            if kept is None or query.max_num_tokens <= 0:
                continue
            start, features = kept
            row = len(query.token_ids) - 2 - start  # position n - 2: its next token is the last one sampled
            if 0 <= row < features.shape[0]:
                picked.append(index)
                rows.append(features[row])
                last_tokens.append(query.token_ids[-1])
        if not rows:
            return drafts
        num_heads = min(self.num_speculative_tokens, max(queries[i].max_num_tokens for i in picked))
        tokens = torch.tensor(last_tokens, dtype=torch.int64, device=rows[0].device)
        guesses = self.drafter.draft(torch.stack(rows), tokens, num_heads, self.vocab_limit)
        for index, guessed in zip(picked, guesses):
            drafts[index] = guessed[: queries[index].max_num_tokens]
        return drafts

    def release(self, request_id: str) -> None:
        self._features.pop(request_id, None)

    def on_request_finished(self, output_token_ids: Sequence[int]) -> None:
        """Nothing: the drafters learn nothing from outputs."""

    def shutdown(self) -> None:
        self._features.clear()
