"""Loading an MLP speculator for `{"method": "mlp_speculator", "model": DIR}` and checking it against the target.

The directory holds the authors' (fms-extras') `config.json` (model_type "mlp_speculator": n_predict, emb_dim,
inner_dim (0: emb_dim), vocab_size, tie_weights, scale_input) and its tensors, a "speculator." prefix dropped:

    emb.{i}.weight    [vocab, inner]      the embedding of the token stage i reads
    proj.{i}.weight   [inner, emb_dim]    stage 0's projection of the target's state; [inner, inner] after
    ln.{i}.weight     [inner]             the norm's weight and bias
    ln.{i}.bias       [inner]
    head.{i}.weight   [vocab, inner]      the LM head

for i < n_predict; with tie_weights stage 0's serve every stage but the projections after the first (proj.1). A
checkpoint saved with the tied names repeated is read where each repeat equals its first. The stages run in the
target's process, on rank 0 with tensor parallelism, as Medusa's heads.
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any, Optional

import torch

from engine.errors import SettingsConflictError
from engine.loading.loader import CheckpointError, iter_weights, prepare_checkpoint
from engine.spec_decode.mlp_speculator import MlpSpeculator, MlpStage
from engine.spec_decode.speculative_config import SpeculativeConfig

logger = logging.getLogger(__name__)

_TENSOR = re.compile(r"(emb|proj|head|ln)\.(\d+)\.(weight|bias)")


def load_mlp_speculator(
    speculative: SpeculativeConfig, target: Any, *, download_dir: Optional[str] = None
) -> MlpSpeculator:
    """The speculator of `speculative.model` on the target's device and dtype; SettingsConflictError when it cannot
    be read or does not fit the target (its hidden width, its vocabulary) or the tokens asked of it."""
    assert speculative.model is not None  # the config's validator requires it for mlp_speculator
    name = speculative.model
    try:
        path = prepare_checkpoint(name, download_dir=download_dir).path
        config = json.loads((path / "config.json").read_text())
        tensors = {key.removeprefix("speculator."): tensor for key, tensor in iter_weights(path)}
    except (CheckpointError, OSError, ValueError) as error:
        raise SettingsConflictError(
            f"--speculative-config: the MLP speculator {name!r} cannot be read: {error}"
        ) from error
    try:
        speculator = _build(config, tensors, target, speculative.num_speculative_tokens)
    except ValueError as error:
        raise SettingsConflictError(f"the MLP speculator {name!r} cannot serve this target: {error}") from error
    logger.info(
        "mlp_speculator %s: %d stages%s, %.1f MB of weights",
        name,
        speculator.n_predict,
        " (tied)" if len(speculator.stages) < speculator.n_predict else "",
        speculator.weight_bytes() / 1e6,
    )
    return speculator


def _build(config: Any, tensors: dict[str, torch.Tensor], target: Any, num_tokens: int) -> MlpSpeculator:
    if not isinstance(config, dict):
        raise ValueError("its config.json is not a JSON object")
    hidden, vocab = target.arch.hidden_size, target.arch.vocab_size
    n_predict = int(config.get("n_predict", 0))
    emb_dim = int(config.get("emb_dim", hidden))
    inner = int(config.get("inner_dim", 0)) or emb_dim
    tied = bool(config.get("tie_weights", False))
    if n_predict < 1:
        raise ValueError(f"its config's n_predict is {config.get('n_predict')!r}; 1 or more stages expected")
    if emb_dim != hidden:
        raise ValueError(f"it reads {emb_dim}-wide states (emb_dim); the target's hidden states are {hidden} wide")
    if int(config.get("vocab_size", vocab)) != vocab:
        raise ValueError(f"its vocabulary is {config['vocab_size']} tokens; the target's is {vocab}")
    if tied and n_predict < 2:
        raise ValueError("tie_weights ties the stages after the first: it needs n_predict 2 or more")
    if not tied and num_tokens > n_predict:
        raise ValueError(
            f"num_speculative_tokens {num_tokens} is more than its {n_predict} stages (n_predict; a speculator "
            "with tie_weights runs any number)"
        )
    stored: dict[tuple[str, int, str], torch.Tensor] = {}
    unused = []
    for key, tensor in tensors.items():
        match = _TENSOR.fullmatch(key)
        if match is None or int(match[2]) >= n_predict:
            unused.append(key)
        else:
            stored[match[1], int(match[2]), match[3]] = tensor
    count = 2 if tied else n_predict

    def first(kind: str, index: int) -> int:
        """The stage whose tensor stage `index` reads: itself, or with tie_weights stage 0's (the projections
        after the first: stage 1's)."""
        return index if not tied else min(index, 1) if kind == "proj" else 0

    def take(kind: str, index: int, part: str, shape: tuple[int, ...]) -> torch.Tensor:
        name = f"{kind}.{first(kind, index)}.{part}"
        tensor = stored.get((kind, first(kind, index), part))
        if tensor is None:
            raise ValueError(f"it lacks {name} (n_predict {n_predict}{', tie_weights' if tied else ''})")
        if tuple(tensor.shape) != shape:
            raise ValueError(f"{name} is {list(tensor.shape)}; {list(shape)} expected")
        return tensor.to(dtype=target.dtype, device=target.device)

    stages = [
        MlpStage(
            embedding=take("emb", i, "weight", (vocab, inner)),
            projection=target.linear.prepare(take("proj", i, "weight", (inner, emb_dim if i == 0 else inner))),
            norm_weight=take("ln", i, "weight", (inner,)),
            norm_bias=take("ln", i, "bias", (inner,)),
            head=target.linear.prepare(take("head", i, "weight", (vocab, inner))),
        )
        for i in range(count)
    ]
    for (kind, index, part), tensor in stored.items():
        if part == "bias" and kind != "ln":  # (the embeddings, projections and heads have none)
            unused.append(f"{kind}.{index}.{part}")
        elif first(kind, index) != index and not torch.equal(tensor, stored[kind, first(kind, index), part]):
            raise ValueError(
                f"tie_weights is set and {kind}.{index}.{part} differs from {kind}.{first(kind, index)}.{part}"
            )
    if unused:
        raise ValueError(f"{len(unused)} of its tensors are not read: {', '.join(sorted(unused)[:8])}")
    return MlpSpeculator(
        stages,
        n_predict=n_predict,
        max_tokens=max(num_tokens, n_predict) if tied else n_predict,
        inner_dim=inner,
        scale_input=bool(config.get("scale_input", False)),
        linear=target.linear,
        device=target.device,
        dtype=target.dtype,
    )
