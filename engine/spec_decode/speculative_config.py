"""`--speculative-config`: which proposer guesses draft tokens, and how many (vLLM's JSON spelling)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from engine.spec_decode.ngram import NgramProposer
from engine.spec_decode.suffix import SuffixProposer

METHODS = ("ngram", "suffix", "draft_model", "eagle", "eagle3", "mtp", "medusa", "mlp_speculator")
MODEL_METHODS = ("draft_model", "eagle", "eagle3", "medusa", "mlp_speculator")
"""Methods whose proposer is a model named by `model`."""
HEAD_MODEL_TYPES = ("medusa", "mlp_speculator")
"""The methods a draft directory's config.json names by its model_type, where `model` comes without `method` (vLLM
picks the method so)."""
MTP_ALIASES = ("deepseek_mtp", "glm4_moe_mtp")
"""vLLM's earlier names of `mtp`, read as it."""


class SpeculativeConfig(BaseModel):
    """`{"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2, "prompt_lookup_max": 5}`, or
    `{"method": "suffix", "num_speculative_tokens": k, ...}` with the `suffix_decoding_*` keys, or
    `{"method": "draft_model", "model": PATH_OR_GGUF, "num_speculative_tokens": k}`: a smaller model of the same
    vocabulary proposes k tokens greedily (engine/spec_decode/draft_model.py), or
    `{"method": "eagle" | "eagle3", "model": HEAD_DIR, "num_speculative_tokens": k}`: an EAGLE / EAGLE-3 head
    trained on the target reads its hidden states beside the tokens (engine/spec_decode/eagle.py), or
    `{"method": "mtp", "num_speculative_tokens": k}`: the target checkpoint's own multi-token-prediction layer
    does (DeepSeek-V3, GLM-4.5: engine/spec_decode/mtp.py), or
    `{"method": "medusa", "model": HEADS_DIR, "num_speculative_tokens": k}`: k Medusa heads on the target's last
    hidden state each guess one token further ahead (engine/spec_decode/medusa.py), or
    `{"method": "mlp_speculator", "model": DIR, "num_speculative_tokens": k}`: IBM's MLP speculator, a chain of
    stages on the target's last hidden state and the token each stage before guessed
    (engine/spec_decode/mlp_speculator.py).

    Each decoding request verifies up to k draft tokens per step; a request opts out with `speculative: false`
    or asks for fewer with its own `num_speculative_tokens`. A constrained request's drafts are checked by its
    grammar before verification (engine/structured/grammar_decoder.py).
    """

    model_config = ConfigDict(extra="forbid")

    method: str = Field(
        "ngram",
        description="the proposer (default: draft_model when model is given, else ngram): ngram (prompt lookup over "
        "the request's own tokens), "
        "suffix (a suffix trie over recent requests' outputs, and the request's own tokens) "
        "draft_model (a smaller model of the same vocabulary, greedy), "
        "eagle or eagle3 (a draft head trained on the target, reading its hidden states), "
        "mtp (the target checkpoint's own multi-token-prediction layer: DeepSeek-V3, GLM-4.5), "
        "medusa (heads trained on the target's last hidden state, head i guessing the token i + 1 ahead), "
        "mlp_speculator (IBM's: MLP stages on the target's last hidden state, each fed the token guessed before)",
    )
    model: Optional[str] = Field(
        None,
        description="the draft model (draft_model): a checkpoint directory or a .gguf file, same vocabulary; the "
        "head's checkpoint directory (eagle, eagle3), the Medusa heads' (medusa), the speculator's (mlp_speculator); "
        "without a method, a directory whose config.json says model_type medusa or mlp_speculator is read as one",
    )
    quantization: Literal["auto", "none", "gguf"] = Field(
        "auto",
        description="the draft's weights (draft_model): gguf keeps a .gguf draft's blocks on the native "
        "quantized kernels (CPU), none dequantizes it; auto: gguf where it can run, else none",
    )
    num_speculative_tokens: int = Field(ge=1, le=32, description="draft tokens a request verifies per step at most")
    draft_tensor_parallel_size: Optional[Literal[1]] = Field(
        None,
        description="vLLM's key: the draft, head or speculator runs whole on rank 0 beside tensor-parallel ranks, so "
        "1 is taken and changes nothing; another size is refused",
    )
    prompt_lookup_min: int = Field(
        2, ge=1, description="shortest n-gram looked up (ngram; with only prompt_lookup_max given, 2 or that max)"
    )
    prompt_lookup_max: Optional[int] = Field(
        None, ge=1, description="longest n-gram looked up (ngram; default: prompt_lookup_min + 3)"
    )
    suffix_decoding_max_tree_depth: int = Field(
        24, ge=2, le=256, description="longest substring the suffix trie holds (suffix)"
    )
    suffix_decoding_max_cached_requests: int = Field(
        1000, ge=0, description="finished requests whose outputs the trie holds (suffix)"
    )
    suffix_decoding_max_tree_nodes: Optional[int] = Field(
        1_000_000,
        ge=1,
        description="nodes the suffix trie holds at most, ~0.3 KB each (suffix): past it the oldest outputs leave "
        "first, whole; an output alone over it keeps its first max_tree_nodes / max_tree_depth tokens; None: no cap",
    )
    suffix_decoding_max_spec_factor: float = Field(
        1.0, gt=0, description="draft tokens per matched token at most (suffix)"
    )
    suffix_decoding_min_token_prob: float = Field(
        0.1, ge=0, le=1, description="lowest probability of a draft's path in the trie (suffix)"
    )
    adaptive: bool = Field(True, description="each request's k follows the share of its recent drafts accepted")
    disable_by_batch_size: Optional[int] = Field(
        None,
        ge=1,
        description="no drafts in a step with more decoding "
        "requests than this (vLLM's name); None: drafts at any batch size",
    )
    step_cost_model: bool = Field(
        True,
        description="time decode steps of 1 to 64 rows at start-up and keep only "
        "the drafts expected to raise a step's tokens per second (from each request's "
        "recent acceptance): speculation pauses itself in batches where rows cost more "
        "than they save",
    )

    @model_validator(mode="before")
    @classmethod
    def _method_of_a_model(cls, data: Any) -> Any:
        """A `model` without a `method` is a draft model, as vLLM reads it (`{"model": PATH, "num_speculative_tokens":
        k}`, its spelling before `method` existed), unless its local config.json names a Medusa or MLP speculator
        checkpoint (vLLM reads the draft's config so: IBM's accelerators are served with a model alone); a method
        given with a model is checked below."""
        if isinstance(data, dict) and data.get("model") is not None and "method" not in data:
            return {**data, "method": _method_of_a_directory(str(data["model"]))}
        return data

    @field_validator("method")
    @classmethod
    def _known_method(cls, method: str) -> str:
        if method in MTP_ALIASES:
            return "mtp"
        if method in METHODS:
            return method
        raise ValueError(f"unknown speculative method {method!r} (expected one of: {', '.join(METHODS)})")

    @model_validator(mode="after")
    def _draft_model(self) -> "SpeculativeConfig":
        if self.method == "draft_model" and self.model is None:
            raise ValueError('method "draft_model" needs "model": the draft\'s checkpoint directory or .gguf file')
        if self.method in MODEL_METHODS and self.model is None:  # (draft_model's own message above)
            raise ValueError(f'method "{self.method}" needs "model": the head\'s checkpoint directory')
        if self.method not in MODEL_METHODS and self.model is not None:
            raise ValueError(
                f'"model" names a draft model: it goes with method "draft_model", "eagle", "eagle3", "medusa" or '
                f'"mlp_speculator", not {self.method!r}'
            )
        return self

    @model_validator(mode="after")
    def _lookup_range(self) -> "SpeculativeConfig":
        if self.prompt_lookup_max is None:
            self.prompt_lookup_max = self.prompt_lookup_min + 3
        elif "prompt_lookup_min" not in self.model_fields_set:  # a max alone below the default min is taken
            self.prompt_lookup_min = min(self.prompt_lookup_min, self.prompt_lookup_max)
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"prompt_lookup_min ({self.prompt_lookup_min}) must be <= prompt_lookup_max ({self.prompt_lookup_max})"
            )
        return self

    def make_proposer(self) -> Union[NgramProposer, SuffixProposer]:
        """The proposer of a method that needs no model (draft_model's is built with its weights:
        engine/spec_decode/draft_loading.py)."""
        if self.method in MODEL_METHODS:
            raise ValueError(f"{self.method}'s proposer is built with its weights (engine/builder.py)")
        if self.method == "suffix":
            return SuffixProposer(
                self.num_speculative_tokens,
                self.suffix_decoding_max_tree_depth,
                self.suffix_decoding_max_cached_requests,
                self.suffix_decoding_max_spec_factor,
                self.suffix_decoding_min_token_prob,
                self.suffix_decoding_max_tree_nodes,
            )
        assert self.prompt_lookup_max is not None  # set by the validator
        return NgramProposer(self.num_speculative_tokens, self.prompt_lookup_min, self.prompt_lookup_max)


def _method_of_a_directory(model: str) -> str:
    """The method a local draft directory's config.json model_type names (HEAD_MODEL_TYPES), else draft_model."""
    config = Path(model).expanduser() / "config.json"
    try:
        model_type = json.loads(config.read_text()).get("model_type") if config.is_file() else None
    except (OSError, ValueError, AttributeError):
        model_type = None  # (read again, and refused by name, where the draft loads)
    return model_type if model_type in HEAD_MODEL_TYPES else "draft_model"
