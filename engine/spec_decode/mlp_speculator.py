"""IBM's MLP speculator (`{"method": "mlp_speculator", "model": DIR}`; Wertheimer et al. 2024, "Accelerating
Production LLMs with Combined Token/Embedding Speculators"; the `ibm-ai-platform/*-accelerator` checkpoints): a
chain of small MLP stages over the target's last hidden state, each fed the token the stage before guessed.

After a step the request holds n tokens, the last (n - 1) sampled from the target's final hidden state at position
n - 2 (after its final norm). Stage i reads the state the stage before left and the embedding of the token it
guessed (stage 0: that hidden state, and token n - 1):

    s   = h                                         [emb_dim]: the target's, position n - 2
    s   = rms(s) / sqrt(2)                          where the config says scale_input (no weight)
    s_i = GELU(LN_i(P_i s_{i-1} + (w_e / w_s) E_i[t_{i-1}]))       [inner_dim]
    t_i = argmax(H_i s_i)                           stage 0: token n, stage 1: n + 1, ...

with LN_i(x) = x / sqrt(mean(x^2) + 1e-6) * weight_i + bias_i, w_s = 0.5 ** (0.5 / n_predict) and
w_e = sqrt((1 - w_s^2) * inner_dim / 2), as the authors' fms-extras and vLLM compute them. The drafts are each
stage's top-1 token (vLLM does not run the authors' top-k candidate tree either). With tie_weights every stage
shares one embedding, norm and head, and the stages after the first one projection, so the chain may run past
n_predict stages.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.nn.functional as F

NORM_EPS = 1e-6


@dataclass(frozen=True)
class MlpStage:
    """One stage: the guessed token's embedding [vocab, inner], the projection of the state before [inner, in] and
    the LM head [vocab, inner] as `linear` prepared them, the norm's weight and bias [inner]."""

    embedding: torch.Tensor
    projection: Any
    norm_weight: torch.Tensor
    norm_bias: torch.Tensor
    head: Any


class MlpSpeculator:
    """An MLP speculator's stages beside the target whose hidden states it reads."""

    def __init__(
        self,
        stages: Sequence[MlpStage],
        *,
        n_predict: int,
        max_tokens: int,
        inner_dim: int,
        scale_input: bool,
        linear: Any,
        device: torch.device,
        dtype: torch.dtype,
    ):
        """`stages`: the first `len(stages)` stages' weights, the last serving every later stage (tie_weights: two,
        the first projection reading the target's width); `max_tokens`: the most tokens it guesses (n_predict, or
        any with tied stages); `linear`: the product the weights were prepared for (the target's)."""
        self.stages = tuple(stages)
        self.n_predict = n_predict
        self.max_tokens = max_tokens
        self.scale_input = scale_input
        self.linear = linear
        self.device = device
        self.dtype = dtype
        state_weight = 0.5 ** (0.5 / n_predict)
        self.embedding_scale = math.sqrt((1 - state_weight**2) * (inner_dim / 2)) / state_weight

    def __len__(self) -> int:
        return self.max_tokens

    def weight_bytes(self) -> int:
        tensors = [t for stage in self.stages for t in vars(stage).values() if isinstance(t, torch.Tensor)]
        unique = {id(t): t for t in tensors}  # (tied stages share theirs)
        return sum(t.numel() * t.element_size() for t in unique.values())

    @torch.inference_mode()
    def draft(
        self, features: torch.Tensor, last_tokens: torch.Tensor, num_heads: int, vocab_limit: int
    ) -> list[list[int]]:
        """features [n, emb_dim] at position n - 2 and last_tokens [n] (token n - 1) -> each row's guesses of the
        first `num_heads` stages (target ids below `vocab_limit`)."""
        state = features.to(device=self.device, dtype=self.dtype)
        if self.scale_input:
            state = (_rms(state) / math.sqrt(2)).to(self.dtype)
        tokens = last_tokens.to(self.device)
        guesses = []
        for index in range(num_heads):
            stage = self.stages[min(index, len(self.stages) - 1)]
            mixed = self.linear(state, stage.projection, None) + stage.embedding[tokens] * self.embedding_scale
            normed = _rms(mixed) * stage.norm_weight.float() + stage.norm_bias.float()
            state = F.gelu(normed).to(self.dtype)
            tokens = self.linear(state, stage.head, None).float()[:, :vocab_limit].argmax(dim=-1)
            guesses.append(tokens)
        return torch.stack(guesses, dim=1).tolist()  # [n, num_heads]


def _rms(x: torch.Tensor) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) over the last axis, in float32."""
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + NORM_EPS)
