"""JSON Schema keywords the grammar engine honours; any other is refused by name (never ignored). The canonical
form of a schema."""

from __future__ import annotations

from typing import Any

from engine.errors import InvalidParameterError

_ANNOTATIONS = frozenset(
    {
        "title",
        "description",
        "default",
        "examples",
        "$schema",
        "$id",
        "$comment",
        "deprecated",
        "readOnly",
        "writeOnly",
        "strict",
    }
)
_STRUCTURE = frozenset(
    {
        "type",
        "enum",
        "const",
        "anyOf",
        "oneOf",
        "allOf",
        "$ref",
        "$defs",
        "definitions",
        "properties",
        "required",
        "additionalProperties",
        "items",
        "prefixItems",
        "minItems",
        "maxItems",
        "minimum",
        "maximum",
        "exclusiveMinimum",
        "exclusiveMaximum",
        "minLength",
        "maxLength",
        "pattern",
        "format",
        "minProperties",
        "maxProperties",
    }
)
SUPPORTED_KEYWORDS = _ANNOTATIONS | _STRUCTURE
_TYPES = frozenset({"object", "array", "string", "number", "integer", "boolean", "null"})
_SCHEMA_MAPS = ("properties", "$defs", "definitions")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_VALUES = ("items", "additionalProperties")


def check_schema(schema: Any, field: str) -> None:
    """Refuse (InvalidParameterError naming `field` and the keyword's path) a keyword the engine cannot honour
    or a malformed `type`."""
    _check(schema, field, "#")


def _check(schema: Any, field: str, path: str) -> None:
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise InvalidParameterError(field, f"has a schema that is not an object at {path}")
    for keyword in schema:
        if keyword not in SUPPORTED_KEYWORDS:
            raise InvalidParameterError(
                field, f"uses the JSON Schema keyword {keyword!r} at {path}, which this server cannot enforce"
            )
    types = schema.get("type")
    for name in types if isinstance(types, list) else [] if types is None else [types]:
        if name not in _TYPES:
            raise InvalidParameterError(field, f"has an unknown type {name!r} at {path}/type")
    for keyword in _SCHEMA_MAPS:
        children = schema.get(keyword, {})
        if not isinstance(children, dict):
            raise InvalidParameterError(field, f"has a {keyword!r} that is not an object at {path}")
        for name, child in children.items():
            _check(child, field, f"{path}/{keyword}/{name}")
    for keyword in _SCHEMA_LISTS:
        children = schema.get(keyword, [])
        if not isinstance(children, list):
            raise InvalidParameterError(field, f"has a {keyword!r} that is not a list at {path}")
        for i, child in enumerate(children):
            _check(child, field, f"{path}/{keyword}/{i}")
    for keyword in _SCHEMA_VALUES:
        if keyword in schema:
            _check(schema[keyword], field, f"{path}/{keyword}")
    required = schema.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        raise InvalidParameterError(field, f"has a 'required' that is not a list of names at {path}")


def canonical_schema(schema: Any) -> Any:
    """`schema` with every schema object's keywords sorted (equal schemas, equal text) but the names under
    `properties` in their given order: the order the output writes them. Values of other keywords (enum, const,
    default, ...) are kept as given."""
    if not isinstance(schema, dict):
        return schema
    out = {}
    for keyword in sorted(schema):
        value = schema[keyword]
        if keyword in _SCHEMA_MAPS and isinstance(value, dict):
            names = value if keyword == "properties" else sorted(value)
            value = {name: canonical_schema(value[name]) for name in names}
        elif keyword in _SCHEMA_LISTS and isinstance(value, list):
            value = [canonical_schema(child) for child in value]
        elif keyword in _SCHEMA_VALUES:
            value = canonical_schema(value)
        out[keyword] = value
    return out
