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
        "discriminator",  # (OpenAPI's, which pydantic writes beside a tagged union's oneOf: each branch's const)
    }
)
# Keywords of one type: in a schema with no type (nor properties or items, which make it an object or an array)
# the engine admits any JSON value and drops them, though a value of their type would have to meet them.
_TYPED = frozenset(
    {
        "minimum",
        "maximum",
        "exclusiveMinimum",
        "exclusiveMaximum",
        "minLength",
        "maxLength",
        "pattern",
        "format",
        "minItems",
        "maxItems",
        "required",
        "minProperties",
        "maxProperties",
    }
)
_STRUCTURE = _TYPED | {
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
    "additionalProperties",
    "items",
    "prefixItems",
}
SUPPORTED_KEYWORDS = _ANNOTATIONS | _STRUCTURE
# The grammar engine (xgrammar) builds a schema object from the first of these it has and reads nothing else of
# it: a keyword beside one (`{"anyOf": [...], "minimum": 3}`) would be dropped, so it is refused.
_ALONE = ("$ref", "const", "enum", "anyOf", "oneOf", "allOf")
_BESIDE_ANYTHING = _ANNOTATIONS | {"$defs", "definitions"}
_BESIDE_VALUES = _BESIDE_ANYTHING | {"type", "const", "enum"}  # concrete values: the type only says what they are
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
    _check_combination(schema, field, path)
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
    missing = [name for name in required if name not in schema.get("properties", {})]
    if missing:  # the engine writes only the properties it knows: such a name would never be written
        raise InvalidParameterError(
            field,
            f"requires {missing[0]!r} at {path}, which is not one of its properties: this server cannot enforce it",
        )


def _check_combination(schema: dict, field: str, path: str) -> None:
    """Refuse keywords the grammar engine would drop: beside a keyword it reads alone, a second schema of allOf,
    and a type's keyword where no type is given."""
    ref = schema.get("$ref")
    if ref is not None and (not isinstance(ref, str) or not ref.startswith("#")):
        # xgrammar admits any value for a reference it cannot follow (another document, a URL)
        raise InvalidParameterError(
            field,
            f"has a '$ref' to {ref!r} at {path}; this server can enforce only references inside the schema (#...)",
        )
    alone = next((keyword for keyword in _ALONE if keyword in schema), None)
    if alone is not None:
        allowed = _BESIDE_VALUES if alone in ("const", "enum") else _BESIDE_ANYTHING
        beside = sorted(keyword for keyword in schema if keyword != alone and keyword not in allowed)
        if beside:
            hint = {
                "$ref": f" (put {beside[0]!r} in the schema it refers to)",
                "anyOf": f" (put {beside[0]!r} in each of its schemas)",
                "oneOf": f" (put {beside[0]!r} in each of its schemas)",
                "allOf": f" (put {beside[0]!r} in its schema)",
            }.get(alone, "")
            raise InvalidParameterError(
                field,
                f"combines {alone!r} with {beside[0]!r} at {path}, which this server cannot enforce together{hint}",
            )
        all_of = schema.get("allOf")
        if alone == "allOf" and isinstance(all_of, list) and len(all_of) > 1:
            raise InvalidParameterError(
                field, f"has an 'allOf' of {len(all_of)} schemas at {path}; this server can enforce only one"
            )
        return
    if "type" in schema or any(k in schema for k in ("properties", "additionalProperties", "items", "prefixItems")):
        return
    typed = sorted(_TYPED & set(schema))
    if typed:
        raise InvalidParameterError(
            field, f"has {typed[0]!r} but no 'type' at {path}; this server can enforce it only with a 'type'"
        )


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
