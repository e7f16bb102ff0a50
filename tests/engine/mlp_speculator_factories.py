"""Tiny MLP speculators for the tiny target (hidden 64, vocabulary 512), written as the authors' fms-extras saves
them, and a float64 reference of what they draft, written from the recipe on HF's hidden states:

    s = the target's last hidden state (after its final norm) at position n - 2 of n tokens; t = token n - 1
    s = rms(s) / sqrt(2) with scale_input
    stage i: s = GELU(LN_i(P_i s + (w_e / w_s) E_i[t])); t = argmax(H_i s)
    w_s = 0.5 ** (0.5 / n_predict), w_e = sqrt((1 - w_s^2) * inner / 2)
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Optional

import torch

HIDDEN, VOCAB = 64, 512


def random_speculator_tensors(n_predict: int = 3, inner: int = 48, seed: int = 0, tied: bool = False):
    """The tensors of `n_predict` stages (tied: stage 0's and proj.1 alone), LN weights and biases random."""
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(2 if tied else n_predict):
        tensors[f"proj.{i}.weight"] = torch.randn(inner, HIDDEN if i == 0 else inner, generator=g) * 0.3
        if tied and i == 1:
            break
        tensors[f"emb.{i}.weight"] = torch.randn(VOCAB, inner, generator=g) * 0.5
        tensors[f"ln.{i}.weight"] = 1 + torch.randn(inner, generator=g) * 0.2
        tensors[f"ln.{i}.bias"] = torch.randn(inner, generator=g) * 0.2
        tensors[f"head.{i}.weight"] = torch.randn(VOCAB, inner, generator=g) * 0.5
    return tensors


def make_mlp_speculator(
    path: Path,
    tensors: Optional[dict[str, torch.Tensor]] = None,
    *,
    n_predict: int = 3,
    inner: int = 48,
    tied: bool = False,
    scale_input: bool = False,
    prefix: str = "",
    **config_keys,
) -> Path:
    """A speculator of `tensors` (random by default) in `path`: the authors' config.json and model.safetensors
    (each name behind `prefix`, e.g. vLLM's "speculator.")."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    if tensors is None:
        tensors = random_speculator_tensors(n_predict, inner, tied=tied)
    save_file({prefix + k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    config = {
        "architectures": ["MLPSpeculatorPreTrainedModel"],
        "model_type": "mlp_speculator",
        "emb_dim": HIDDEN,
        "inner_dim": inner,
        "vocab_size": VOCAB,
        "n_predict": n_predict,
        "top_k_tokens_per_head": [1] * n_predict,
        "n_candidates": 1,
        "tie_weights": tied,
        "scale_input": scale_input,
    }
    config.update(config_keys)
    (path / "config.json").write_text(json.dumps(config))
    return path


def reference_drafts(
    target,
    tensors: dict[str, torch.Tensor],
    token_ids: list[int],
    k: int,
    n_predict: int,
    tied: bool = False,
    scale_input: bool = False,
) -> list[int]:
    """The k drafts after `token_ids` of a speculator of `tensors` on the HF `target` (float64)."""
    t = {name: tensor.double() for name, tensor in tensors.items()}
    inner = t["emb.0.weight"].shape[1]
    state_weight = 0.5 ** (0.5 / n_predict)
    scale = math.sqrt((1 - state_weight**2) * inner / 2) / state_weight

    def rms(x):
        return x / torch.sqrt(x.pow(2).mean() + 1e-6)

    with torch.no_grad():
        states = target(torch.tensor([token_ids]), output_hidden_states=True).hidden_states
        s = states[-1][0, len(token_ids) - 2].double()  # after the final norm, position n - 2
        if scale_input:
            s = rms(s) / math.sqrt(2)
        token = token_ids[-1]
        drafts = []
        for i in range(k):
            j = 0 if tied else i
            proj = t[f"proj.{min(i, 1) if tied else i}.weight"]
            mixed = proj @ s + scale * t[f"emb.{j}.weight"][token]
            s = torch.nn.functional.gelu(rms(mixed) * t[f"ln.{j}.weight"] + t[f"ln.{j}.bias"])
            token = int((t[f"head.{j}.weight"] @ s).argmax())
            drafts.append(token)
    return drafts


def successor_speculator(embed: torch.Tensor, perm: torch.Tensor, inner: int = HIDDEN) -> dict[str, torch.Tensor]:
    """Tied stages that guess what the successor target (tests/engine/medusa_factories.successor_target_state)
    says next: the projections add nothing, so a stage's state is g(u) = GELU(normalised embedding row of the
    token u it reads), and the head's row perm[u] is g(u) normalised: the argmax is perm[u], the token after u."""
    emb = embed[:, :inner].clone()
    states = torch.nn.functional.gelu(emb / torch.sqrt(emb.pow(2).mean(-1, keepdim=True) + 1e-6))
    head = torch.empty_like(states)
    head[perm] = states / states.norm(dim=-1, keepdim=True)
    return {
        "emb.0.weight": emb,
        "proj.0.weight": torch.zeros(inner, HIDDEN),
        "proj.1.weight": torch.zeros(inner, inner),
        "ln.0.weight": torch.ones(inner),
        "ln.0.bias": torch.zeros(inner),
        "head.0.weight": head,
    }
