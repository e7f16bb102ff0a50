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

# HF architecture names that say what a checkpoint is for (vLLM's suffix rules, the pooling ones): a base model
# saved without its LM head ("LlamaModel", "Qwen2Model") is an embedding model, a "...ForSequenceClassification" a
# classifier (its `score` matrix over the last token's hidden state: rerankers, reward and label models).
_CLASSIFY_SUFFIXES = ("ForSequenceClassification",)
_POOLING_SUFFIXES = (*_CLASSIFY_SUFFIXES, "EmbeddingModel", "ForTextEncoding", "Model")
# Sentence Transformers' CrossEncoder activations (config.json's sentence_transformers.activation_fn)
_ST_ACTIVATIONS = {
    "torch.nn.modules.activation.Sigmoid": "sigmoid",
    "torch.nn.modules.activation.Softmax": "softmax",
    "torch.nn.modules.linear.Identity": None,
}
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
    use_activation: Optional[bool] = Field(
        None, description="a classification model's: false returns its raw logits, not probabilities"
    )


@dataclass(frozen=True, slots=True)
class ModelPooler:
    """A pooling model's pooler: its type, whether it normalizes, its Matryoshka dimensions (None: a model not
    trained for shorter embeddings; () any number up to the hidden size); a classification model's (`task`
    "classify") class names, one per row of its classifier, and the activation of its logits."""

    type: PoolingType
    normalize: bool
    hidden_size: int
    matryoshka: Optional[tuple[int, ...]] = None
    default_dimensions: Optional[int] = None
    task: Literal["embed", "classify"] = "embed"
    labels: tuple[str, ...] = ()
    activation: Optional[str] = None  # "sigmoid", "softmax", None: the raw logits

    def resolve(self, params: PoolingParams, model: Optional[str]) -> Pooling:
        """The request's settings against the model's: `dimensions` only for a Matryoshka model, at most its
        hidden size, one of its listed sizes where it lists them (InvalidParameterError, vLLM's wording; `model`
        names the model in it, None: "the model", as at start-up); a classification model takes
        `use_activation` only, an embedding model all but it."""
        who = "the model" if model is None else f"model {model!r}"
        if self.task == "classify":
            for name in ("dimensions", "normalize"):
                if getattr(params, name) is not None:
                    raise InvalidParameterError(name, f"applies to embeddings; {who} classifies")
            activation = None if params.use_activation is False else self.activation
            return Pooling(self.type, False, classify=True, activation=activation)
        if params.use_activation is not None:
            raise InvalidParameterError("use_activation", f"applies to classification; {who} embeds")
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
    if convert in ("embed", "classify"):
        if runner == "generate":
            raise SettingsConflictError(f"--convert {convert} needs --runner pooling (or auto), not generate")
        return "pooling"
    if runner != "auto":
        return runner
    architectures = list(getattr(hf_config, "architectures", None) or [])
    if any(a.endswith(_GENERATE_SUFFIXES) for a in architectures):
        return "generate"
    if any(a.endswith(_POOLING_SUFFIXES) for a in architectures):
        return "pooling"
    return "generate"


def resolve_task(convert: str, hf_config: Any) -> Literal["embed", "classify"]:
    """What a pooling model computes: "classify" for `--convert classify` or a "...ForSequenceClassification"
    architecture, else "embed"."""
    if convert == "classify":
        return "classify"
    architectures = list(getattr(hf_config, "architectures", None) or [])
    if convert != "embed" and any(a.endswith(_CLASSIFY_SUFFIXES) for a in architectures):
        return "classify"
    return "embed"


def model_pooler(
    hf_config: Any, checkpoint_dir: Path, overrides: Optional[PoolerConfig], task: str = "embed"
) -> ModelPooler:
    """The pooler of a model served for pooling: `overrides` field by field over the checkpoint's Sentence
    Transformers configuration, over vLLM's defaults (an embedding: LAST, normalized; a classifier: LAST, its
    logits through the activation its config names)."""
    if task == "classify":
        return _classifier_pooler(hf_config, overrides)
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


def _classifier_pooler(hf_config: Any, overrides: Optional[PoolerConfig]) -> ModelPooler:
    """A sequence classifier's pooler: the last token (or --pooler-config's type), its labels from id2label, its
    activation from the Sentence Transformers CrossEncoder config, else from problem_type, else sigmoid for one
    label (a relevance score) and softmax for several (vLLM's choices; one label is never a softmax)."""
    num_labels = int(getattr(hf_config, "num_labels", 0) or 0)
    id2label = dict(getattr(hf_config, "id2label", None) or {})
    labels = tuple(str(id2label.get(i, id2label.get(str(i), f"LABEL_{i}"))) for i in range(num_labels))
    st = getattr(hf_config, "sentence_transformers", None)
    problem = getattr(hf_config, "problem_type", None)
    if isinstance(st, dict) and st.get("activation_fn") in _ST_ACTIVATIONS:
        activation = _ST_ACTIVATIONS[st["activation_fn"]]
    elif problem == "regression":
        activation = None
    elif problem == "multi_label_classification" or (problem is None and num_labels == 1):
        activation = "sigmoid"
    else:
        activation = "softmax"
    if activation == "softmax" and num_labels < 2:
        activation = "sigmoid"  # a softmax over one label is always 1 (vLLM's PoolerClassify takes a sigmoid too)
    pooling_type = PoolingType.LAST
    if overrides is not None:
        if overrides.normalize or overrides.dimensions is not None:
            raise SettingsConflictError(
                "--pooler-config: normalize and dimensions apply to embeddings, not classifiers"
            )
        if overrides.pooling_type is not None:
            pooling_type = PoolingType(overrides.pooling_type)
        if overrides.use_activation is False:
            activation = None
    return ModelPooler(
        pooling_type, False, int(hf_config.hidden_size), task="classify", labels=labels, activation=activation
    )


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
