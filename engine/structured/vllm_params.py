"""vLLM's offline spelling of a constraint: `SamplingParams(structured_outputs=StructuredOutputsParams(json=schema))`
(and the older `guided_decoding=GuidedDecodingParams(...)`), read into this engine's StructuredOutputs by
`StructuredOutputs.parse`, as its dict form is."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Optional, Union


@dataclass
class StructuredOutputsParams:
    """vLLM's fields: one of json (a schema, or its text), regex, choice, grammar (EBNF or Lark) or json_object;
    the options this engine takes as vLLM does (disable_any_whitespace, whitespace_pattern, disable_fallback: there
    is no other backend to fall back to); others set are refused by name when the params are read."""

    json: Optional[Union[str, dict]] = None
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None
    json_object: Optional[bool] = None
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: Optional[str] = None
    structural_tag: Optional[str] = None

    def as_dict(self) -> dict[str, Any]:
        """The fields set (not at their defaults), as the `structured_outputs` object of a request."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) not in (None, False)}


@dataclass
class GuidedDecodingParams(StructuredOutputsParams):
    """vLLM's older name, with its `backend` (xgrammar, or auto: this engine's one backend)."""

    backend: Optional[str] = None

    def as_dict(self) -> dict[str, Any]:
        values = super().as_dict()
        backend = values.pop("backend", None)
        if backend not in (None, "auto", "xgrammar"):
            values["backend"] = backend  # refused by name: there is no other backend here
        return values
