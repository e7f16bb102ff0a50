"""Loading Medusa heads for `{"method": "medusa", "model": DIR}` and checking them against the target.

The directory holds a `config.json` and the heads' tensors, in either of two layouts:

    vLLM's          blocks.{i}.layers.{j}.weight / .bias, lm_heads.{i}.weight (a "medusa_heads." prefix dropped);
                    config: num_heads, num_hidden_layers, hidden_size, vocab_size, and optionally
                    truncated_vocab_size with a stored token_map (the heads guess among those target ids),
                    original_lm_head (one LM head for every head: lm_head.weight or lm_heads.0.weight, else the
                    target's), medusa_fc_bias (the blocks' biases required)
    the authors'    {i}.{j}.linear.weight / .bias and {i}.{L}.weight (head i's LM head after its L blocks), in
                    model.safetensors, medusa_lm_head.safetensors or medusa_lm_head.pt (a "medusa_head." prefix
                    dropped); config: medusa_num_heads, medusa_num_layers

Config keys are read as vLLM reads them: any key with "num" and "heads" in it is the head count, any other with
"num" and "layers" the blocks per head. A block's bias is read wherever it is stored (the authors' blocks all have
one; vLLM builds them only where the config sets medusa_fc_bias: one stored beside medusa_fc_bias false is
refused). The heads run in the target's process, on rank 0 with tensor parallelism (their LM heads are whole:
their own, or the target's read from its checkpoint).
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any, Optional

import torch

from engine.errors import SettingsConflictError
from engine.loading.loader import CheckpointError, iter_weights, prepare_checkpoint, weight_files
from engine.spec_decode.medusa import MedusaHead, MedusaHeads
from engine.spec_decode.speculative_config import SpeculativeConfig

logger = logging.getLogger(__name__)

AUTHORS_PT = "medusa_lm_head.pt"
_VLLM_BLOCK = re.compile(r"blocks\.(\d+)\.layers\.(\d+)\.(weight|bias)")
_VLLM_LM_HEAD = re.compile(r"lm_heads\.(\d+)\.weight")
_AUTHORS = re.compile(r"(\d+)\.(\d+)\.(linear\.weight|linear\.bias|weight)")


def load_medusa_heads(
    speculative: SpeculativeConfig,
    target: Any,
    *,
    download_dir: Optional[str] = None,
    target_checkpoint: Optional[Path] = None,
) -> MedusaHeads:
    """The heads of `speculative.model` on the target's device and dtype; SettingsConflictError when they cannot
    be read, do not fit the target (its hidden width, its vocabulary) or hold what is not served."""
    assert speculative.model is not None  # the config's validator requires it for medusa
    name = speculative.model
    try:
        path = _checkpoint_dir(name, download_dir)
        config = _read_config(path)
        tensors = _read_tensors(path)
    except CheckpointError as error:
        raise SettingsConflictError(
            f"--speculative-config: the medusa heads {name!r} cannot be read: {error}"
        ) from error
    try:
        heads = _build(config, tensors, target, target_checkpoint)
    except ValueError as error:
        raise SettingsConflictError(f"the medusa heads {name!r} cannot serve this target: {error}") from error
    if speculative.num_speculative_tokens > len(heads):
        raise SettingsConflictError(
            f"--speculative-config: num_speculative_tokens {speculative.num_speculative_tokens} is more than the "
            f"{len(heads)} medusa heads of {name!r} (head i guesses the token i + 1 ahead)"
        )
    logger.info(
        "medusa %s: %d heads of %d block(s), %.1f MB of weights%s",
        name,
        len(heads),
        len(heads.heads[0].blocks),
        heads.weight_bytes() / 1e6,
        "" if heads.token_map is None else f", guessing among {heads.token_map.numel()} target ids",
    )
    return heads


def _checkpoint_dir(name: str, download_dir: Optional[str]) -> Path:
    local = Path(name).expanduser()
    if local.is_file():
        raise CheckpointError("Medusa heads are a directory (config.json and safetensors, .bin or .pt weights)")
    if local.is_dir() and (local / AUTHORS_PT).is_file() and not weight_files(local):
        return local  # the authors' torch file, which a model checkpoint's checks do not look for
    return prepare_checkpoint(name, download_dir=download_dir).path


def _read_config(path: Path) -> dict[str, Any]:
    try:
        raw = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as error:
        raise CheckpointError(f"cannot read its config.json: {error}") from error
    if not isinstance(raw, dict):
        raise CheckpointError("its config.json is not a JSON object")
    config: dict[str, Any] = {}
    for key, value in raw.items():
        if "num" in key and "heads" in key:
            key = "num_heads"  # (medusa_num_heads: the authors')
        elif "num" in key and "layers" in key:
            key = "num_hidden_layers"  # (medusa_num_layers)
        config[key] = value
    return config


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    if weight_files(path):
        stored = dict(iter_weights(path))
    else:
        try:
            stored = torch.load(path / AUTHORS_PT, map_location="cpu", weights_only=True)
        except (OSError, RuntimeError, ValueError, EOFError) as error:
            raise CheckpointError(f"cannot read {AUTHORS_PT}: {error}") from error
    tensors = {}
    for name, tensor in stored.items():
        tensors[name.removeprefix("medusa_heads.").removeprefix("medusa_head.")] = tensor
    return tensors


def _layout(tensors: dict[str, torch.Tensor]) -> tuple[dict[tuple[int, int, str], torch.Tensor], dict[int, Any]]:
    """The blocks' tensors by (head, block, "weight" | "bias") and the LM heads by head, of either layout (the
    tensors read are taken out of `tensors`)."""
    blocks: dict[tuple[int, int, str], torch.Tensor] = {}
    lm_heads: dict[int, Any] = {}
    authors: dict[tuple[int, int, str], torch.Tensor] = {}
    for name in list(tensors):
        if match := _VLLM_BLOCK.fullmatch(name):
            blocks[int(match[1]), int(match[2]), match[3]] = tensors.pop(name)
        elif match := _VLLM_LM_HEAD.fullmatch(name):
            lm_heads[int(match[1])] = tensors.pop(name)
        elif match := _AUTHORS.fullmatch(name):
            authors[int(match[1]), int(match[2]), match[3]] = tensors.pop(name)
    for (head, index, kind), tensor in authors.items():  # head i's last index is its LM head, after its blocks
        if kind == "weight":
            lm_heads[head] = tensor
        else:
            blocks[head, index, kind.removeprefix("linear.")] = tensor
    return blocks, lm_heads


def _build(
    config: dict[str, Any], tensors: dict[str, torch.Tensor], target: Any, target_checkpoint: Optional[Path]
) -> MedusaHeads:
    hidden = target.arch.hidden_size
    if int(config.get("hidden_size", hidden)) != hidden:
        raise ValueError(f"the heads are {config['hidden_size']} wide; the target's hidden states are {hidden} wide")
    blocks, lm_heads = _layout(tensors)
    num_heads = int(config.get("num_heads") or 1 + max((h for h, _, _ in blocks), default=-1))
    num_layers = int(config.get("num_hidden_layers", 1 + max((j for h, j, _ in blocks if h == 0), default=-1)))
    if num_heads < 1:
        raise ValueError("it stores no heads (blocks.{i}.layers.{j}.weight)")
    layers = _blocks(blocks, num_heads, num_layers, config.get("medusa_fc_bias"), target)
    token_map = _token_map(config, tensors, target.arch.vocab_size)
    target_lm_head = None
    if config.get("original_lm_head", False):  # one LM head for every head (vLLM reads lm_heads.0 alone then)
        matrix = tensors.pop("lm_head.weight", None)
        matrix = lm_heads.get(0) if matrix is None else matrix
        lm_heads.clear()
        if matrix is None and token_map is not None:
            raise ValueError("a truncated vocabulary (token_map) needs the heads' own LM head (lm_head.weight)")
        if matrix is None and target.vocab_parallel is not None:  # the target's, whole on this rank
            assert target_checkpoint is not None  # (the builder passes it)
            target_lm_head = _target_lm_head(target_checkpoint, target)
        shared = None if matrix is None else _lm_head(matrix, token_map, target)
        matrices = [shared] * num_heads
    else:
        missing = [f"lm_heads.{i}.weight" for i in range(num_heads) if i not in lm_heads]
        if missing:
            raise ValueError(f"it lacks {', '.join(missing)} (or original_lm_head: one LM head for every head)")
        matrices = [_lm_head(lm_heads.pop(i), token_map, target) for i in range(num_heads)]
    unused = [f"blocks.{h}.layers.{j}.{k}" for h, j, k in blocks] + [f"lm_heads.{i}.weight" for i in lm_heads]
    unused += list(tensors)
    if unused:
        raise ValueError(f"{len(unused)} tensors of the heads were not used: {', '.join(sorted(unused)[:8])}")
    heads = [MedusaHead(head_blocks, matrix) for head_blocks, matrix in zip(layers, matrices)]
    if token_map is not None:
        token_map = token_map.to(target.device)  # (kept on the host until the LM heads' rows were taken)
    return MedusaHeads(heads, target, target.linear, token_map=token_map, target_lm_head=target_lm_head)


def _target_lm_head(checkpoint: Path, target: Any) -> torch.Tensor:
    """The target's whole LM head, read from its checkpoint (its ranks each hold a slice) by the family's names:
    GPT-J's and Falcon's embedding is transformer.wte / word_embeddings, GPT-NeoX's head embed_out. The heads need
    the head alone; the embedding where the model ties them or stores no head, as the model itself takes it."""
    renames = getattr(target.arch, "renames", ())

    def llama_name(name: str) -> str:
        for old, new in renames:
            name = name.replace(old, new)
        return name.removeprefix("model.")

    wanted = ("lm_head.weight", "embed_tokens.weight")
    rows: dict[str, torch.Tensor] = {}
    try:
        for name, tensor in iter_weights(checkpoint, keep=lambda n: llama_name(n) in wanted):
            rows[llama_name(name)] = tensor
    except CheckpointError as error:
        raise ValueError(f"the target's LM head cannot be read: {error}") from error
    head = rows.get("lm_head.weight")
    if target.arch.tie_word_embeddings or head is None:
        head = rows.get("embed_tokens.weight")
    if head is None:
        raise ValueError("the target's checkpoint stores no LM head (nor an embedding tied to it) by its names")
    return head.to(dtype=target.dtype, device=target.device)


def _blocks(
    blocks: dict[tuple[int, int, str], torch.Tensor],
    num_heads: int,
    num_layers: int,
    bias: Optional[bool],
    target: Any,
) -> list[tuple[tuple[Any, Optional[torch.Tensor]], ...]]:
    """Each head's residual blocks, taken out of `blocks`: a bias where stored, required where `bias` (the config's
    medusa_fc_bias) is true; where it is false, vLLM builds none and would drop a stored one: refused."""
    hidden = target.arch.hidden_size

    def take(head: int, block: int, kind: str, required: bool) -> Optional[torch.Tensor]:
        tensor = blocks.pop((head, block, kind), None)
        name = f"blocks.{head}.layers.{block}.{kind}"
        if tensor is not None and kind == "bias" and bias is False:
            raise ValueError(f"it stores {name} and its config sets medusa_fc_bias false (vLLM would not read it)")
        if tensor is None:
            if required:
                raise ValueError(f"it lacks {name} (num_heads {num_heads}, num_hidden_layers {num_layers})")
            return None
        want = (hidden, hidden) if kind == "weight" else (hidden,)
        if tuple(tensor.shape) != want:
            raise ValueError(f"{name} is {list(tensor.shape)}; {list(want)} expected (the target's hidden width)")
        return tensor.to(dtype=target.dtype, device=target.device)

    return [
        tuple(
            (target.linear.prepare(take(i, j, "weight", True)), take(i, j, "bias", bool(bias)))
            for j in range(num_layers)
        )
        for i in range(num_heads)
    ]


def _token_map(config: dict[str, Any], tensors: dict[str, torch.Tensor], vocab_limit: int) -> Optional[torch.Tensor]:
    """The target id of each LM-head row, where the config's truncated_vocab_size is below its vocab_size."""
    stored = tensors.pop("token_map", None)
    vocab = config.get("vocab_size")
    truncated = config.get("truncated_vocab_size")
    if truncated is None or vocab is None or int(truncated) >= int(vocab):
        return None  # (a token_map stored beside the whole vocabulary is not read, as vLLM does)
    if stored is None:
        raise ValueError(f"truncated_vocab_size {truncated} < vocab_size {vocab} needs a stored token_map")
    token_map = stored.to(torch.int64).flatten()
    if token_map.numel() != int(truncated):
        raise ValueError(f"token_map holds {token_map.numel()} ids; truncated_vocab_size is {truncated}")
    if token_map.numel() and (int(token_map.min()) < 0 or int(token_map.max()) >= vocab_limit):
        raise ValueError(f"token_map names ids outside the target's vocabulary of {vocab_limit}")
    return token_map


def _lm_head(matrix: torch.Tensor, token_map: Optional[torch.Tensor], target: Any) -> Any:
    hidden = target.arch.hidden_size
    if matrix.dim() != 2 or matrix.shape[1] != hidden:
        raise ValueError(f"an LM head is {list(matrix.shape)}; [vocab, {hidden}] expected")
    if token_map is not None and matrix.shape[0] != token_map.numel():
        if matrix.shape[0] <= int(token_map.max()):
            raise ValueError(f"an LM head has {matrix.shape[0]} rows; token_map names ids up to {int(token_map.max())}")
        matrix = matrix[token_map]  # a whole-vocabulary head: the rows of the mapped ids, as vLLM takes them
    return target.linear.prepare(matrix.to(dtype=target.dtype, device=target.device))
