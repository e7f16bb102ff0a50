"""Tiny Medusa heads for the tiny target, written in vLLM's layout (or the Medusa authors'), and a float64
reference of what they draft, written from the recipe on HF's hidden states:

    h = the target's last hidden state (after its final norm) at position n - 2 of n tokens
    head i: h = h + SiLU(W_ij h + b_ij) for each block j; draft i = argmax(lm_head_i h) (a token_map's id)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import torch

HIDDEN, VOCAB = 64, 512


def random_medusa_tensors(num_heads: int = 3, num_layers: int = 1, seed: int = 0, rows: int = VOCAB):
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(num_heads):
        for j in range(num_layers):
            tensors[f"blocks.{i}.layers.{j}.weight"] = torch.randn(HIDDEN, HIDDEN, generator=g) * 0.2
            tensors[f"blocks.{i}.layers.{j}.bias"] = torch.randn(HIDDEN, generator=g) * 0.2
        tensors[f"lm_heads.{i}.weight"] = torch.randn(rows, HIDDEN, generator=g) * 0.5
    return tensors


def make_medusa_heads(
    path: Path,
    tensors: Optional[dict[str, torch.Tensor]] = None,
    *,
    num_heads: int = 3,
    num_layers: int = 1,
    seed: int = 0,
    authors: bool = False,
    **config_keys,
) -> Path:
    """Heads of `tensors` (vLLM's names; random ones by default) in `path`: vLLM's config and model.safetensors,
    or with `authors` the Medusa authors' (medusa_num_heads, medusa_num_layers; {i}.{j}.linear.*, {i}.{L}.weight
    in medusa_lm_head.pt)."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    if tensors is None:
        tensors = random_medusa_tensors(num_heads, num_layers, seed)
    if authors:
        renamed = {}
        for name, tensor in tensors.items():
            parts = name.split(".")
            if parts[0] == "blocks":  # blocks.i.layers.j.kind -> i.j.linear.kind
                renamed[f"{parts[1]}.{parts[3]}.linear.{parts[4]}"] = tensor
            else:  # lm_heads.i.weight -> i.L.weight
                renamed[f"{parts[1]}.{num_layers}.weight"] = tensor
        torch.save(renamed, path / "medusa_lm_head.pt")
        config = {"medusa_num_heads": num_heads, "medusa_num_layers": num_layers, "base_model_name_or_path": "tiny"}
    else:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
        config = {
            "model_type": "medusa",
            "architectures": ["MedusaModel"],
            "num_heads": num_heads,
            "num_hidden_layers": num_layers,
            "hidden_size": HIDDEN,
            "vocab_size": VOCAB,
            "medusa_fc_bias": True,
        }
    config.update(config_keys)
    (path / "config.json").write_text(json.dumps(config))
    return path


def reference_drafts(
    target,
    tensors: dict[str, torch.Tensor],
    token_ids: list[int],
    k: int,
    token_map: Optional[torch.Tensor] = None,
    shared_lm_head: Optional[torch.Tensor] = None,
    shared_lm_head_bias: Optional[torch.Tensor] = None,
) -> list[int]:
    """The k drafts after `token_ids` of heads of `tensors` on the HF `target` (float64). `shared_lm_head`: one
    LM head for every head (original_lm_head), with `shared_lm_head_bias` where it is the target's with a bias."""
    t = {name: tensor.double() for name, tensor in tensors.items() if tensor.is_floating_point()}
    with torch.no_grad():
        states = target(torch.tensor([token_ids]), output_hidden_states=True).hidden_states
        feature = states[-1][0, len(token_ids) - 2].double()  # after the final norm, position n - 2
        drafts = []
        for i in range(k):
            h = feature
            j = 0
            while f"blocks.{i}.layers.{j}.weight" in t:
                h = h + torch.nn.functional.silu(
                    t[f"blocks.{i}.layers.{j}.weight"] @ h + t[f"blocks.{i}.layers.{j}.bias"]
                )
                j += 1
            lm_head = shared_lm_head.double() if shared_lm_head is not None else t[f"lm_heads.{i}.weight"]
            if token_map is not None:
                lm_head = lm_head[token_map] if lm_head.shape[0] != token_map.numel() else lm_head
                drafts.append(int(token_map[int((lm_head @ h).argmax())]))
            else:
                logits = lm_head @ h
                drafts.append(int((logits if shared_lm_head_bias is None else logits + shared_lm_head_bias).argmax()))
    return drafts


def successor_target_state(state: dict[str, torch.Tensor], seed: int = 0) -> tuple[dict, torch.Tensor]:
    """A one-layer target's tensors changed so that its greedy next token is perm[token] whatever came before:
    its layer adds nothing (o_proj, down_proj zero), its norms are ones and its embedding rows have an RMS of 1
    (the final hidden state is the token's embedding row), and its LM head's row perm[u] is u's embedding row."""
    state = dict(state)
    embed = state["model.embed_tokens.weight"]
    embed = embed / embed.pow(2).mean(-1, keepdim=True).sqrt()
    state["model.embed_tokens.weight"] = embed
    for name in state:
        if "norm" in name:
            state[name] = torch.ones_like(state[name])
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            state[name] = torch.zeros_like(state[name])
    perm = torch.randperm(embed.shape[0], generator=torch.Generator().manual_seed(seed))
    lm_head = torch.empty_like(embed)
    lm_head[perm] = embed
    state["lm_head.weight"] = lm_head
    return state, perm


def successor_heads(embed: torch.Tensor, perm: torch.Tensor, num_heads: int) -> dict[str, torch.Tensor]:
    """Heads that guess what the successor target says next: head i reads the embedding row of token n - 2 (its
    blocks add nothing) and its LM head's row perm^(i + 2)[u] is u's, so it drafts token n + i."""
    tensors = {}
    step = perm.clone()  # perm applied twice: token n - 2 -> token n
    step = perm[step]
    for i in range(num_heads):
        tensors[f"blocks.{i}.layers.0.weight"] = torch.zeros(HIDDEN, HIDDEN)
        tensors[f"blocks.{i}.layers.0.bias"] = torch.zeros(HIDDEN)
        lm_head = torch.empty_like(embed)
        lm_head[step] = embed
        tensors[f"lm_heads.{i}.weight"] = lm_head
        step = perm[step]
    return tensors
