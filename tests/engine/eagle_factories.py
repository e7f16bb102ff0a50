"""Tiny EAGLE and EAGLE-3 heads for a tiny target, written as the EAGLE authors' checkpoints are, and a float64
reference of what a head drafts, written from the papers' recipe (and vLLM's layout) on HF's hidden states.

    eagle    fc [H, 2H], layers.0.* without an input norm (a stored one is not read), the target's embedding
             and LM head; out = the layer's residual stream, logits = lm_head(out) (no norm)
    eagle3   fc [H, 3H], midlayer.* with hidden_norm and q/k/v over [norm(embed); norm(feature)] (2H), norm,
             lm_head over a draft vocabulary, d2t (target id - draft id)
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Optional

import torch

from tests.engine.factories import tiny_config_dict

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE = 64, 4, 2, 16, 128


def make_eagle_head(
    path: Path,
    method: str,
    *,
    seed: int = 0,
    feature_layers: Optional[list[int]] = None,
    draft_vocab: Optional[int] = None,
    vocab: int = 512,
    tensors: Optional[dict[str, torch.Tensor]] = None,
) -> Path:
    """A random head (or `tensors` as given) with its Llama config in `path`."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    if tensors is None:
        tensors = random_head_tensors(method, seed, draft_vocab, vocab)
    config = tiny_config_dict("llama", num_hidden_layers=1)
    if method == "eagle3":
        config["architectures"] = ["LlamaForCausalLMEagle3"]
        config["draft_vocab_size"] = draft_vocab or vocab
        if feature_layers is not None:
            config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": feature_layers}
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config))
    return path


def random_head_tensors(method: str, seed: int, draft_vocab: Optional[int], vocab: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.15

    eagle3 = method == "eagle3"
    width = 2 * HIDDEN if eagle3 else HIDDEN
    p = "midlayer." if eagle3 else "layers.0."
    tensors = {
        p + "self_attn.q_proj.weight": w(HEADS * HEAD_DIM, width),
        p + "self_attn.k_proj.weight": w(KV_HEADS * HEAD_DIM, width),
        p + "self_attn.v_proj.weight": w(KV_HEADS * HEAD_DIM, width),
        p + "self_attn.o_proj.weight": w(HIDDEN, HEADS * HEAD_DIM),
        p + "mlp.gate_proj.weight": w(INTERMEDIATE, HIDDEN),
        p + "mlp.up_proj.weight": w(INTERMEDIATE, HIDDEN),
        p + "mlp.down_proj.weight": w(HIDDEN, INTERMEDIATE),
        p + "post_attention_layernorm.weight": 1 + w(HIDDEN),
        "embed_tokens.weight": w(vocab, HIDDEN),  # stored as the authors store it, and never read: the target's serves
    }
    if not eagle3:
        tensors["fc.weight"] = w(HIDDEN, 2 * HIDDEN)
        return tensors
    rows = draft_vocab or vocab
    targets = torch.sort(torch.randperm(vocab, generator=g)[:rows]).values  # the draft ids' target ids, in order
    tensors.update(
        {
            p + "input_layernorm.weight": 1 + w(HIDDEN),
            p + "hidden_norm.weight": 1 + w(HIDDEN),
            "norm.weight": 1 + w(HIDDEN),
            "fc.weight": w(HIDDEN, 3 * HIDDEN),
            "lm_head.weight": w(rows, HIDDEN),
            "d2t": targets - torch.arange(rows),
            "t2d": torch.zeros(vocab, dtype=torch.bool).index_fill_(0, targets, True),
        }
    )
    return tensors


def reference_drafts(
    target, tensors: dict[str, torch.Tensor], method: str, token_ids: list[int], k: int, layers: list[int]
) -> list[int]:
    """The k greedy drafts after `token_ids` of a head of `tensors` on the HF `target` (float64), computed over
    the whole sequence each time (no cache)."""
    eagle3 = method == "eagle3"
    p = "midlayer." if eagle3 else "layers.0."
    t = {name: tensor.double() if tensor.is_floating_point() else tensor for name, tensor in tensors.items()}
    with torch.no_grad():
        out = target(torch.tensor([token_ids]), output_hidden_states=True)
        states = out.hidden_states  # [i]: the stream entering layer i; [-1]: after the final norm
        if eagle3:
            features = torch.cat([states[i][0] for i in layers], dim=-1) @ t["fc.weight"].T
        else:
            features = states[-1][0]
        embed = target.model.embed_tokens.weight.double()
        n = len(token_ids)
        inputs = list(token_ids[1:])  # token p + 1 at position p = 0 .. n - 2
        feats = [features[i] for i in range(n - 1)]
        drafts: list[int] = []
        for _ in range(k):
            outs = _head_forward(t, p, eagle3, embed[torch.tensor(inputs)], torch.stack(feats))
            last = outs[-1]
            if eagle3:
                logits = _rms(last, t["norm.weight"]) @ t["lm_head.weight"].T
                draft = int(logits.argmax()) + int(t["d2t"][int(logits.argmax())])
            else:
                draft = int((last @ target.lm_head.weight.double().T).argmax())
            drafts.append(draft)
            inputs.append(draft)
            feats.append(last)  # the head's own output is the next position's feature
    return drafts


def _head_forward(t, p: str, eagle3: bool, embeds: torch.Tensor, feats: torch.Tensor) -> torch.Tensor:
    """[T, H] outputs of the head's layer over positions 0 .. T - 1, causal, RoPE at theta 10000."""
    if eagle3:
        normed = _rms(feats, t[p + "hidden_norm.weight"])
        residual = feats
        x = torch.cat([_rms(embeds, t[p + "input_layernorm.weight"]), normed], dim=-1)
    else:
        x = residual = torch.cat([embeds, feats], dim=-1) @ t["fc.weight"].T
    T = x.shape[0]
    q = (x @ t[p + "self_attn.q_proj.weight"].T).view(T, HEADS, HEAD_DIM)
    k = (x @ t[p + "self_attn.k_proj.weight"].T).view(T, KV_HEADS, HEAD_DIM)
    v = (x @ t[p + "self_attn.v_proj.weight"].T).view(T, KV_HEADS, HEAD_DIM)
    q, k = _rope(q), _rope(k)
    group = HEADS // KV_HEADS
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(HEAD_DIM)
    scores = scores.masked_fill(torch.triu(torch.ones(T, T, dtype=torch.bool), 1), float("-inf"))
    attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(T, HEADS * HEAD_DIM)
    residual = residual + attn @ t[p + "self_attn.o_proj.weight"].T
    x = _rms(residual, t[p + "post_attention_layernorm.weight"])
    gate, up = x @ t[p + "mlp.gate_proj.weight"].T, x @ t[p + "mlp.up_proj.weight"].T
    return residual + (torch.nn.functional.silu(gate) * up) @ t[p + "mlp.down_proj.weight"].T


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _rope(x: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    T = x.shape[0]
    inv = theta ** (-torch.arange(0, HEAD_DIM, 2, dtype=torch.float64) / HEAD_DIM)
    angles = torch.arange(T, dtype=torch.float64)[:, None] * inv[None]  # [T, D/2]
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    a, b = x[..., : HEAD_DIM // 2], x[..., HEAD_DIM // 2 :]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


def mimic_head_tensors(target_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """An EAGLE head that computes what a one-layer target computes at the next position (fc passes the token's
    embedding through; the layer is the target's), for a target whose embedding rows have an RMS of 1 and whose
    norms are ones: it drafts the target's own tokens but for the first token, which its context lacks."""
    prefix = "model.layers.0."
    tensors = {
        "layers.0." + name[len(prefix) :]: tensor
        for name, tensor in target_state.items()
        if name.startswith(prefix) and "input_layernorm" not in name
    }
    tensors["fc.weight"] = torch.cat([torch.eye(HIDDEN), torch.zeros(HIDDEN, HIDDEN)], dim=1)
    return tensors


def record_proposals(llm) -> list:
    """Each proposal's (query tokens, drafts), recorded as the scheduler receives them."""
    proposer = llm.engine.scheduler.proposer
    calls: list = []
    propose = proposer.propose_batch

    def recorded(queries):
        drafts = propose(queries)
        calls.extend((list(q.token_ids), list(d)) for q, d in zip(queries, drafts))
        return drafts

    proposer.propose_batch = recorded
    return calls
