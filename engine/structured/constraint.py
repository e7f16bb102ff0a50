"""A request's structured-output constraint, as vLLM spells it (`structured_outputs`)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, NoReturn, Optional

from engine.errors import InvalidParameterError
from engine.structured.schema_check import canonical_schema, check_schema
from engine.structured.vllm_params import StructuredOutputsParams

_KINDS = ("json", "regex", "choice", "grammar", "json_object")
# vLLM's options taken as what this engine does: the output has no free whitespace, and xgrammar is the only
# backend (nothing to fall back from)
_OPTIONS = {"disable_any_whitespace", "whitespace_pattern", "disable_fallback"}


@dataclass(frozen=True, slots=True)
class StructuredOutputs:
    """Exactly one of: a JSON Schema (`json`, canonical text: keywords sorted, properties in the schema's
    order, which is the order the output writes them), a regex, a choice of strings, a grammar
    (`grammar`: EBNF in xgrammar's GBNF dialect, or Lark when no rule is written with `::=`, as vLLM reads
    it), or `json_object` (any JSON object).

    Frozen and hashable: `key` is what compiled grammars are cached by. Build it with `parse`, which
    validates and names the request field (`field`) in its refusals.
    """

    json: Optional[str] = None
    regex: Optional[str] = None
    choice: Optional[tuple[str, ...]] = None
    grammar: Optional[str] = None
    json_object: bool = False

    @property
    def kind(self) -> str:
        return next(k for k in _KINDS if getattr(self, k) not in (None, False))

    @property
    def key(self) -> tuple[str, Any]:
        return self.kind, getattr(self, self.kind)

    @classmethod
    def parse(cls, value: Any, field: str = "structured_outputs") -> "StructuredOutputs":
        """From vLLM's `structured_outputs` object ({"json": schema} | {"regex": ...} | {"choice": [...]} |
        {"grammar": ...} | {"json_object": true}) or its offline StructuredOutputsParams; a StructuredOutputs is
        returned as is."""
        if isinstance(value, cls):
            return value
        if isinstance(value, StructuredOutputsParams):
            value = value.as_dict()
        if not isinstance(value, dict):
            _reject(field, "must be an object with one of json, regex, choice, grammar, json_object")
        unknown = sorted(set(value) - set(_KINDS) - _OPTIONS)
        if unknown:
            _reject(f"{field}.{unknown[0]}", "is not supported")
        given = [k for k in _KINDS if value.get(k) not in (None, False)]
        if len(given) != 1:
            _reject(field, f"must set exactly one of {', '.join(_KINDS)}, got {len(given)}")
        kind = given[0]
        return cls.of_kind(kind, value[kind], f"{field}.{kind}")

    @classmethod
    def of_kind(cls, kind: str, value: Any, field: str) -> "StructuredOutputs":
        """One kind's constraint ("json": a schema, "regex", ...), refusals naming `field` as given."""
        if kind not in _KINDS:
            raise ValueError(f"unknown constraint kind {kind!r}")
        return getattr(cls, f"_{kind}")(value, field)

    @classmethod
    def _json(cls, schema: Any, field: str) -> "StructuredOutputs":
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as exc:
                _reject(field, f"is not valid JSON: {exc}")
        if not isinstance(schema, (dict, bool)):
            _reject(field, "must be a JSON Schema (an object)")
        check_schema(schema, field)
        return cls(json=json.dumps(canonical_schema(schema), separators=(",", ":")))

    @classmethod
    def _regex(cls, pattern: Any, field: str) -> "StructuredOutputs":
        if not isinstance(pattern, str) or not pattern:
            _reject(field, "must be a non-empty string")
        return cls(regex=pattern)

    @classmethod
    def _choice(cls, choices: Any, field: str) -> "StructuredOutputs":
        if not isinstance(choices, (list, tuple)) or not choices or not all(isinstance(c, str) and c for c in choices):
            _reject(field, "must be a non-empty list of non-empty strings")
        return cls(choice=tuple(choices))

    @classmethod
    def _grammar(cls, grammar: Any, field: str) -> "StructuredOutputs":
        if not isinstance(grammar, str) or not grammar.strip():
            _reject(field, "must be a non-empty grammar (EBNF with a `root` rule, or Lark)")
        return cls(grammar=grammar)

    @classmethod
    def _json_object(cls, flag: Any, field: str) -> "StructuredOutputs":
        if flag is not True:
            _reject(field, "must be true")
        return cls(json_object=True)


def _reject(field: str, problem: str) -> NoReturn:
    raise InvalidParameterError(field, problem)
