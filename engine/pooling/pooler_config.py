"""Which runner a model gets (generate or pooling), and a pooling model's pooler: the pooling type and whether
vectors are normalized, from `--pooler-config`, else the checkpoint's Sentence Transformers files, else vLLM's
default for embedding (the last token, normalized)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field

from engine.errors import InvalidParameterError, SettingsConflictError
from engine.pooling.params import Pooling, PoolingParams, PoolingType

# HF architecture names that say what a checkpoint is for (vLLM's suffix rules, the embedding ones): a base model
# saved without its LM head ("LlamaModel", "Qwen2Model") is an embedding model.
_POOLING_SUFFIXES = ("EmbeddingModel", "ForTextEncoding", "Model")
_GENERATE_SUFFIXES = ("ForCausalLM", "ForConditionalGeneration", "LMHeadModel", "ChatModel")

# Sentence Transformers' Pooling module flags -> our pooling types (the others, max and weighted mean, are refused)
_ST_MODES = {
    "pooling_mode_lasttoken": PoolingType.LAST,
    "pooling_mode_mean_tokens": PoolingType.MEAN,
    "pooling_mode_cls_token": PoolingType.CLS,
}
_ST_POOLING = "sentence_transformers.models.Pooling"
_ST_NORMALIZE = "sentence_transformers.models.Normalize"
_ST_TRANSFORMER = "sentence_transformers.models.Transformer"


class PoolerConfig(BaseModel):
    """vLLM's `--pooler-config` (`--override-pooler-config`): overrides of the model's pooler, each field None to
    keep the model's."""

    model_config = ConfigDict(extra="forbid")

    pooling_type: Optional[Literal["LAST", "MEAN", "CLS"]] = Field(
        None, description="LAST (the last token's hidden state), MEAN (over the prompt) or CLS (the first token's)"
    )
    normalize: Optional[bool] = Field(None, description="scale each vector to unit length (L2)")
    dimensions: Optional[int] = Field(
        None, ge=1, description="the components returned when a request names none (a Matryoshka model's)"
    )


@dataclass(frozen=True, slots=True)
class ModelPooler:
    """A pooling model's pooler: its type, whether it normalizes, its Matryoshka dimensions (None: a model not
    trained for shorter embeddings; () any number up to the hidden size)."""

    type: PoolingType
    normalize: bool
    hidden_size: int
    matryoshka: Optional[tuple[int, ...]] = None
    default_dimensions: Optional[int] = None

    def resolve(self, params: PoolingParams, model: Optional[str]) -> Pooling:
        """The request's settings against the model's: `dimensions` only for a Matryoshka model, at most its
        hidden size, one of its listed sizes where it lists them (InvalidParameterError, vLLM's wording; `model`
        names the model in it, None: "the model", as at start-up)."""
        who = "the model" if model is None else f"model {model!r}"
        dimensions = params.dimensions if params.dimensions is not None else self.default_dimensions
        if dimensions is not None and dimensions != self.hidden_size:
            if self.matryoshka is None:
                raise InvalidParameterError(
                    "dimensions",
                    f"cannot be set: {who} does not support matryoshka representation, and changing "
                    "the output dimensions would give poor results",
                )
            if self.matryoshka and dimensions not in self.matryoshka:
                raise InvalidParameterError(
                    "dimensions", f"must be one of the matryoshka dimensions {list(self.matryoshka)} of {who}"
                )
            if dimensions > self.hidden_size:
                raise InvalidParameterError(
                    "dimensions", f"must be at most the model's hidden size {self.hidden_size}, got {dimensions}"
                )
        normalize = self.normalize if params.normalize is None else params.normalize
        return Pooling(self.type, normalize, None if dimensions == self.hidden_size else dimensions)


def resolve_runner(runner: str, convert: str, hf_config: Any) -> str:
    """ "generate" or "pooling" for `--runner` / `--convert` (vLLM's): "auto" reads the config's architectures."""
    if convert == "embed":
        if runner == "generate":
            raise SettingsConflictError("--convert embed needs --runner pooling (or auto), not generate")
        return "pooling"
    if runner != "auto":
        return runner
    architectures = list(getattr(hf_config, "architectures", None) or [])
    if any(a.endswith(_GENERATE_SUFFIXES) for a in architectures):
        return "generate"
    if any(a.endswith(_POOLING_SUFFIXES) for a in architectures):
        return "pooling"
    return "generate"


def model_pooler(hf_config: Any, checkpoint_dir: Path, overrides: Optional[PoolerConfig]) -> ModelPooler:
    """The pooler of a model served for pooling: `overrides` field by field over the checkpoint's Sentence
    Transformers configuration, over vLLM's embedding default (LAST, normalized)."""
    pooling_type, normalize = _sentence_transformers_pooler(checkpoint_dir) or (PoolingType.LAST, True)
    default_dimensions = None
    if overrides is not None:
        if overrides.pooling_type is not None:
            pooling_type = PoolingType(overrides.pooling_type)
        if overrides.normalize is not None:
            normalize = overrides.normalize
        default_dimensions = overrides.dimensions
    hidden_size = int(hf_config.hidden_size)
    listed = getattr(hf_config, "matryoshka_dimensions", None)
    matryoshka: Optional[tuple[int, ...]] = None
    if listed is not None:
        matryoshka = tuple(int(d) for d in listed)
    elif getattr(hf_config, "is_matryoshka", False):
        matryoshka = ()
    pooler = ModelPooler(pooling_type, normalize, hidden_size, matryoshka, default_dimensions)
    if default_dimensions is not None:
        try:
            pooler.resolve(PoolingParams(), None)
        except InvalidParameterError as error:
            raise SettingsConflictError(f"--pooler-config dimensions {default_dimensions}: {error.problem}") from None
    return pooler


def _sentence_transformers_pooler(checkpoint_dir: Path) -> Optional[tuple[PoolingType, bool]]:
    """(pooling type, normalize) from a Sentence Transformers checkpoint's modules.json and its Pooling module's
    config; None when the checkpoint has no modules.json. A module this server does not apply (a Dense projection,
    a max or weighted-mean pooling) is a SettingsConflictError: its vectors would not be the model's."""
    modules_file = checkpoint_dir / "modules.json"
    if not modules_file.is_file():
        return None
    try:
        modules = json.loads(modules_file.read_text())
        kinds = [(str(m["type"]), str(m.get("path", ""))) for m in modules]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise SettingsConflictError(f"{modules_file.name} cannot be read: {error}") from None
    pooling_type = PoolingType.LAST
    for kind, path in kinds:
        if kind == _ST_POOLING:
            pooling_type = _st_pooling_type(checkpoint_dir / path / "config.json")
        elif kind not in (_ST_NORMALIZE, _ST_TRANSFORMER):
            raise SettingsConflictError(
                f"the Sentence Transformers module {kind} ({path or 'modules.json'}) is not applied by this "
                "server: its embeddings would not be the model's"
            )
    return pooling_type, any(kind == _ST_NORMALIZE for kind, _ in kinds)


def _st_pooling_type(config_file: Path) -> PoolingType:
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as error:
        raise SettingsConflictError(f"the Sentence Transformers pooling config cannot be read: {error}") from None
    chosen = [flag for flag, on in config.items() if flag.startswith("pooling_mode_") and on]
    if len(chosen) != 1 or chosen[0] not in _ST_MODES:
        raise SettingsConflictError(
            f"the Sentence Transformers pooling {chosen or 'with no mode'} is not served: one of "
            f"{', '.join(sorted(_ST_MODES))} is"
        )
    return _ST_MODES[chosen[0]]
