"""A request's structured-output fields (vLLM's extras, OpenAI's response_format) as engine constraints, each
with the field it came from (the engine compiles it off the event loop before the request is queued)."""

from __future__ import annotations

from typing import Any, Optional

from engine.structured import StructuredOutputs
from server.http.errors import bad_request
from server.openai.protocol import ResponseFormat, SamplingFields

# vLLM's older spellings: field -> the `structured_outputs` key it means
GUIDED_EXTRAS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
STRUCTURED_EXTRAS = frozenset({"structured_outputs", *GUIDED_EXTRAS})


def constraint_from_extras(body: SamplingFields) -> Optional[tuple[StructuredOutputs, str]]:
    """The constraint of `structured_outputs` or one `guided_*` extra, with the field it came from."""
    extra = {k: v for k, v in (body.model_extra or {}).items() if k in STRUCTURED_EXTRAS and v is not None}
    if not extra:
        return None
    if len(extra) > 1:
        names = sorted(extra)
        raise bad_request(f"set only one of {', '.join(names)}.", param=names[1])
    ((name, value),) = extra.items()
    if name == "structured_outputs":
        return StructuredOutputs.parse(value, name), name
    return StructuredOutputs.of_kind(GUIDED_EXTRAS[name], value, name), name


def format_beside_forced_calls(
    format_constraint: Optional[tuple[StructuredOutputs, str]],
    tool_constraint: Optional[tuple[StructuredOutputs, str]],
) -> Optional[tuple[StructuredOutputs, str]]:
    """The format field's constraint (`response_format`, `text.format`), or None when `tool_choice` (required or
    named) forces calls: the output is then the calls, and the format governs only text the model does not write.
    OpenAI takes both (the Agents SDK and instructor send an output type beside a forced tool), and vLLM's tool
    schema takes the format's place, so the tools' grammar governs here too. The format is still checked."""
    return None if tool_constraint is not None else format_constraint


def constraint_from_response_format(
    response_format: Optional[ResponseFormat],
) -> Optional[tuple[StructuredOutputs, str]]:
    """`{"type": "json_object"}` or `{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}`."""
    if response_format is None or response_format.type == "text":
        return None
    extra: dict[str, Any] = response_format.model_extra or {}
    if response_format.type == "json_object":
        return StructuredOutputs(json_object=True), "response_format"
    if response_format.type != "json_schema":
        raise bad_request(
            f"response_format type {response_format.type!r} is not supported; use text, json_object or json_schema.",
            param="response_format.type",
        )
    spec = extra.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise bad_request(
            "response_format.json_schema must be an object with a name and a schema.",
            param="response_format.json_schema",
        )
    schema = spec.get("schema", {})
    field = "response_format.json_schema.schema"
    if schema == {}:
        return StructuredOutputs(json_object=True), field
    return StructuredOutputs.of_kind("json", schema, field), field
