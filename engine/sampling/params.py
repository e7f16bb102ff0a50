"""Per-request sampling parameters (vLLM's names), validated on construction."""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass, field
from typing import Any, NoReturn, Optional

from engine.errors import InvalidParameterError, TokenIdOutOfVocabularyError
from engine.structured.constraint import StructuredOutputs

# (vLLM's sampling_params module has them too)
from engine.structured.vllm_params import GuidedDecodingParams, StructuredOutputsParams  # noqa: F401
from scheduler import InvalidMaxTokensError, MinTokensOutOfRangeError

MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_N = 128
"""The most alternatives `logprobs` / `prompt_logprobs` may ask for."""
MAX_BAD_WORDS = 128
MAX_BAD_WORD_CHARS = 256

GREEDY_TEMPERATURE = 1e-5
"""Temperatures below this sample greedily (argmax)."""

LOGIT_BIAS_LIMIT = 100.0
PENALTY_LIMIT = 2.0


@dataclass(slots=True)
class SamplingParams:
    """How to pick the tokens of one request, mirroring vLLM's `SamplingParams`.

    Normalised on construction: `top_k` 0 or -1 (vLLM's "disabled") becomes None,
    a `stop` string becomes a one-element list, `logit_bias` keys become ints
    (decimal strings, as JSON sends them, are accepted) and an empty bias None.
    Invalid values raise a `RequestRejectedError` naming the field (`InvalidParameterError`,
    or the scheduler's own error type where it has one).

    `max_tokens` None means "up to the context length" (the engine resolves it).
    `logprobs` is the number of top alternatives returned per sampled token (0:
    only the sampled token's own logprob); `prompt_logprobs` likewise per prompt
    token. Both are capped at `MAX_LOGPROBS`.

    `structured_outputs` constrains the output to a grammar (JSON Schema, regex, choice, EBNF, any JSON
    object); a dict or a StructuredOutputsParams in vLLM's spelling is parsed into a StructuredOutputs (also given as
    vLLM's older `guided_decoding`). The grammar ends the output with
    an eos token, so it cannot be combined with `ignore_eos`.

    `allowed_token_ids`: the only tokens the output may hold (every other one's logit -inf), as vLLM's.
    `bad_words`: words the output may not hold: their tokens (each word as it starts a text and after a space,
    tokenized by the engine into `bad_words_token_ids`, as vLLM's `update_from_tokenizer`) are masked wherever
    the output so far ends with all of a word's tokens but its last; a one-token word is masked always.

    `speculative` False keeps the request out of speculative decoding (when the engine runs it);
    `num_speculative_tokens` caps its draft tokens per step below the engine's (0: none).

    `seed` may be any int (its draws are a function of seed mod 2**64 and the output position). With `n` > 1
    the engine runs `n` children made by `for_child(i)`; when `seed` is set, child i
    samples with seed `seed + i`, so the children differ from one another yet the
    whole request is reproducible.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: Optional[int] = None
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Optional[dict[int, float]] = None
    allowed_token_ids: Optional[list[int]] = None
    bad_words: list[str] = field(default_factory=list)
    bad_words_token_ids: Optional[list[list[int]]] = None  # the engine's tokenization of bad_words
    seed: Optional[int] = None
    max_tokens: Optional[int] = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    structured_outputs: Optional[StructuredOutputs] = None
    speculative: bool = True
    num_speculative_tokens: Optional[int] = None
    guided_decoding: dataclasses.InitVar[Any] = None  # vLLM's older name of structured_outputs

    def __post_init__(self, guided_decoding: Any) -> None:
        if guided_decoding is not None:
            if self.structured_outputs is not None:
                _reject("guided_decoding", "is the older name of structured_outputs: give one of them")
            self.structured_outputs = guided_decoding
        self._check_counts()
        if self.num_speculative_tokens is not None:
            self.num_speculative_tokens = _as_int(self.num_speculative_tokens, "num_speculative_tokens")
            if self.num_speculative_tokens < 0:
                _reject("num_speculative_tokens", f"must be non-negative, got {self.num_speculative_tokens}")
        self._check_sampling()
        self._check_penalties()
        self._check_masks()
        self._check_stops()
        if self.structured_outputs is not None:
            self.structured_outputs = StructuredOutputs.parse(self.structured_outputs)
            if self.ignore_eos:
                _reject("ignore_eos", "cannot be combined with structured output (the grammar ends with eos)")

    # ------------------------------------------------------------------ derived

    @property
    def is_greedy(self) -> bool:
        """Temperature (near) zero: the token is the argmax of the processed logits."""
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def needs_penalties(self) -> bool:
        """Any of presence, frequency or repetition penalty is active."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def needs_top_k_top_p(self) -> bool:
        """The distribution is truncated to a few candidates (top-k and/or top-p)."""
        return self.top_k is not None or self.top_p < 1.0

    @property
    def needs_logprobs(self) -> bool:
        return self.logprobs is not None

    # ------------------------------------------------------------------ copies

    def replace(self, **changes: Any) -> "SamplingParams":
        """A validated copy with `changes` applied (lists and dicts are copied)."""
        return dataclasses.replace(self, **changes)

    def clone(self) -> "SamplingParams":
        return self.replace()

    def for_child(self, index: int) -> "SamplingParams":
        """The parameters of child `index` (0-based) of an `n` > 1 request: n=1, seed + index."""
        if not 0 <= index < self.n:
            raise ValueError(f"child index {index} out of range for n={self.n}")
        seed = None if self.seed is None else self.seed + index
        return self.replace(n=1, seed=seed)

    def verify_vocab(self, vocab_size: int) -> None:
        """Refuse `logit_bias` and `allowed_token_ids` token ids the model does not have (call once the model is
        known)."""
        for token_id in self.logit_bias or {}:
            if token_id >= vocab_size:
                raise TokenIdOutOfVocabularyError("logit_bias", token_id, vocab_size)
        for token_id in self.allowed_token_ids or ():
            if token_id >= vocab_size:
                raise TokenIdOutOfVocabularyError("allowed_token_ids", token_id, vocab_size)

    # ------------------------------------------------------------------ validation

    def _check_counts(self) -> None:
        self.n = _as_int(self.n, "n")
        if self.n < 1:
            _reject("n", f"must be at least 1, got {self.n}")
        if self.n > MAX_N:
            _reject("n", f"must be at most {MAX_N}, got {self.n}")
        if self.max_tokens is not None:
            self.max_tokens = _as_int(self.max_tokens, "max_tokens")
            if self.max_tokens < 1:
                raise InvalidMaxTokensError(self.max_tokens)
        self.min_tokens = _as_int(self.min_tokens, "min_tokens")
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            raise MinTokensOutOfRangeError(self.min_tokens, self.max_tokens)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is None:
                continue
            value = _as_int(value, name)
            if not 0 <= value <= MAX_LOGPROBS:
                _reject(name, f"must be between 0 and {MAX_LOGPROBS}, got {value}")
            setattr(self, name, value)
        if self.seed is not None:
            self.seed = _as_int(self.seed, "seed")

    def _check_sampling(self) -> None:
        self.temperature = _as_float(self.temperature, "temperature")
        if self.temperature < 0.0:
            _reject("temperature", f"must be non-negative, got {self.temperature}")
        self.top_p = _as_float(self.top_p, "top_p")
        if not 0.0 < self.top_p <= 1.0:
            _reject("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k is not None:
            top_k = _as_int(self.top_k, "top_k")
            if top_k < -1:
                _reject("top_k", f"must be at least 1 (0 or -1: disabled), got {top_k}")
            self.top_k = top_k if top_k >= 1 else None
        self.min_p = _as_float(self.min_p, "min_p")
        if not 0.0 <= self.min_p <= 1.0:
            _reject("min_p", f"must be in [0, 1], got {self.min_p}")

    def _check_penalties(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = _as_float(getattr(self, name), name)
            if not -PENALTY_LIMIT <= value <= PENALTY_LIMIT:
                _reject(name, f"must be in [-2, 2], got {value}")
            setattr(self, name, value)
        self.repetition_penalty = _as_float(self.repetition_penalty, "repetition_penalty")
        if self.repetition_penalty <= 0.0:
            _reject("repetition_penalty", f"must be positive, got {self.repetition_penalty}")
        self.logit_bias = _normalize_logit_bias(self.logit_bias)

    def _check_masks(self) -> None:
        if self.allowed_token_ids is not None:
            if not isinstance(self.allowed_token_ids, (list, tuple)) or not self.allowed_token_ids:
                _reject("allowed_token_ids", "must be a non-empty list of token ids")
            self.allowed_token_ids = [_as_int(t, "allowed_token_ids") for t in self.allowed_token_ids]
            if any(t < 0 for t in self.allowed_token_ids):
                _reject("allowed_token_ids", "must be non-negative")
        words = [] if self.bad_words is None else self.bad_words
        if not isinstance(words, (list, tuple)):
            _reject("bad_words", "must be a list of strings")
        for word in words:
            # (a word of spaces alone tokenizes to nothing: there would be no token to mask)
            if not isinstance(word, str) or not word.strip():
                _reject("bad_words", f"must hold strings with a non-space character, got {word!r}")
        if len(words) > MAX_BAD_WORDS or any(len(word) > MAX_BAD_WORD_CHARS for word in words):
            _reject(
                "bad_words", f"must hold at most {MAX_BAD_WORDS} words of at most {MAX_BAD_WORD_CHARS} characters each"
            )
        self.bad_words = list(words)

    def _check_stops(self) -> None:
        stop = self.stop
        if stop is None:
            stop = []
        elif isinstance(stop, str):
            stop = [stop]
        elif not isinstance(stop, (list, tuple)):
            _reject("stop", "must be a string or a list of strings")
        for text in stop:
            if not isinstance(text, str) or not text:
                _reject("stop", f"must hold non-empty strings, got {text!r}")
        if len(stop) > MAX_STOP_STRINGS or any(len(text) > MAX_STOP_STRING_CHARS for text in stop):
            _reject(
                "stop",
                f"must hold at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_STRING_CHARS} characters each",
            )
        self.stop = list(stop)
        token_ids = [] if self.stop_token_ids is None else self.stop_token_ids
        if not isinstance(token_ids, (list, tuple, set, frozenset)):
            _reject("stop_token_ids", "must be a list of token ids")
        self.stop_token_ids = [_as_int(t, "stop_token_ids") for t in token_ids]
        if any(t < 0 for t in self.stop_token_ids):
            _reject("stop_token_ids", "must be non-negative")


def _normalize_logit_bias(bias: Any) -> Optional[dict[int, float]]:
    if bias is None:
        return None
    if not isinstance(bias, dict):
        _reject("logit_bias", "must map token ids to biases")
    normalized: dict[int, float] = {}
    for key, value in bias.items():
        token_id = _as_token_id(key)
        value = _as_float(value, "logit_bias")
        if not -LOGIT_BIAS_LIMIT <= value <= LOGIT_BIAS_LIMIT:
            _reject("logit_bias", f"values must be in [-100, 100], got {value}")
        normalized[token_id] = value
    return normalized or None


def _as_token_id(key: Any) -> int:
    if isinstance(key, str) and key.strip().isdigit():
        key = int(key)
    if isinstance(key, bool) or not isinstance(key, numbers.Integral) or key < 0:
        _reject("logit_bias", f"keys must be non-negative token ids, got {key!r}")
    return int(key)


def _as_int(value: Any, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        _reject(field, f"must be an integer, got {value!r}")
    return int(value)


def _as_float(value: Any, field: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        _reject(field, f"must be a number, got {value!r}")
    value = float(value)
    if not math.isfinite(value):
        _reject(field, f"must be finite, got {value!r}")
    return value


def _reject(field: str, problem: str) -> NoReturn:
    raise InvalidParameterError(field, problem)
