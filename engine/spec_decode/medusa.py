"""Medusa speculation (`{"method": "medusa", "model": DIR}`): k heads over the target's last hidden state each
guess one token further ahead, all at once, with no cache and no recurrence (Cai et al. 2024; vLLM's layout).

After a step the request holds n tokens, the last sampled from the target's final hidden state at position
n - 2 (after its final norm: what its LM head reads). Head i reads that state alone and guesses token n + i:

    h   = feature                                   [hidden]: the target's, position n - 2
    h   = h + SiLU(W_ij h + b_ij)   for each of head i's residual blocks j
    d_i = argmax(lm_head_i(h))                      head 0: token n (after the one just sampled), head 1: n + 1, ...

The drafts are each head's top-1 token, a chain verified as any proposer's (the Medusa authors' tree of top-k
candidates is not run, nor by vLLM). The features arrive as EAGLE's do (engine/spec_decode/eagle.py): the runner
puts each step's final hidden states in its output and the scheduler hands them to `observe`, before the step's
tokens are known; the proposer (engine/spec_decode/last_state_proposer.py) keeps the rows that sampled a token (the
request's last position before the step, and its drafts'), one of which is position n - 2 once the accepted ones are
appended.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class MedusaHead:
    """One head: its residual blocks' (weight [hidden, hidden] as `linear` prepared it, bias [hidden] or None),
    and its LM head [vocab rows, hidden] (None: the target's serves)."""

    blocks: tuple[tuple[Any, Optional[torch.Tensor]], ...]
    lm_head: Any


class MedusaHeads:
    """The heads of a Medusa checkpoint beside the target they read."""

    def __init__(
        self,
        heads: Sequence[MedusaHead],
        target: Any,
        linear: Any,
        *,
        token_map: Optional[torch.Tensor] = None,
        target_lm_head: Optional[torch.Tensor] = None,
    ):
        """`linear`: the product the weights were prepared for (the target's); `token_map` [rows]: the target id
        of each LM-head row, where the heads guess among a truncated vocabulary (None: row r is id r);
        `target_lm_head`: the target's whole LM head for heads that share it, where the target holds a slice."""
        self.heads = tuple(heads)
        self.target = target
        self.linear = linear
        self.token_map = token_map
        self.target_lm_head = target_lm_head
        self.device = target.device
        self.dtype = target.dtype

    def __len__(self) -> int:
        return len(self.heads)

    def weight_bytes(self) -> int:
        own = [t for head in self.heads for block in head.blocks for t in block]
        own += [head.lm_head for head in self.heads]
        unique = {id(t): t for t in own if isinstance(t, torch.Tensor)}  # (one LM head may serve every head)
        return sum(t.numel() * t.element_size() for t in unique.values())

    @torch.inference_mode()
    def draft(
        self, features: torch.Tensor, last_tokens: torch.Tensor, num_heads: int, vocab_limit: int
    ) -> list[list[int]]:
        """features [n, hidden] -> each row's guesses of the first `num_heads` heads (target ids below
        `vocab_limit`); the heads read no token (`last_tokens` is the MLP speculator's)."""
        x = features.to(device=self.device, dtype=self.dtype)
        guesses = []
        for head in self.heads[:num_heads]:
            h = x
            for weight, bias in head.blocks:
                h = h + F.silu(self.linear(h, weight, bias))
            guesses.append(self._argmax(h, head.lm_head, vocab_limit))
        return torch.stack(guesses, dim=1).tolist()  # [n, num_heads]

    def _argmax(self, h: torch.Tensor, lm_head: Any, vocab_limit: int) -> torch.Tensor:
        if lm_head is not None:
            logits = self.linear(h, lm_head, None).float()  # [n, rows]
        else:
            if self.target_lm_head is not None:
                logits = F.linear(h, self.target_lm_head).float()
            else:
                logits = self.target.head_logits(h)
            # The target's LM head as the target reads it: its bias (Phi-2's) moves the argmax; the family's
            # divisor, scale and soft-cap do not.
            bias = getattr(self.target, "lm_head_bias", None)
            if bias is not None:
                logits = logits + bias.float()
        if self.token_map is not None:  # (its ids are checked below vocab_limit at load)
            return self.token_map[logits.argmax(dim=-1)]
        return logits[:, :vocab_limit].argmax(dim=-1)
