"""Hypothesis strategies for JSON schemas whose every valid instance is short (bounded strings, arrays,
numbers, enums; objects of at most three properties, open or closed), and the check of an output against
one: what the structured-output tests of the tiny and the embedded model generate."""

from __future__ import annotations

import json

import jsonschema
from hypothesis import strategies as st


def _leaf() -> st.SearchStrategy[dict]:
    return st.one_of(
        st.builds(
            lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
            st.integers(-50, 50),
            st.integers(0, 100),
        ),
        st.builds(
            lambda lo, span: {"type": "number", "minimum": lo, "maximum": lo + span},
            st.integers(-5, 5),
            st.integers(1, 10),
        ),
        st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(1, 6)),
        st.lists(
            st.sampled_from(["red", "green", "blue", "cyan", 1, 2, None]), min_size=1, max_size=4, unique=True
        ).map(lambda values: {"enum": values}),
        st.just({"type": "boolean"}),
    )


def bounded_schemas() -> st.SearchStrategy[dict]:
    def extend(children):
        names = st.sampled_from(["a", "b", "c", "id", "name", "tags"])
        objects = st.builds(
            lambda props, required_mask, closed: {
                "type": "object",
                "properties": props,
                "required": [k for k, keep in zip(props, required_mask) if keep],
                **({"additionalProperties": False} if closed else {}),
            },
            st.dictionaries(names, children, min_size=1, max_size=3),
            st.lists(st.booleans(), min_size=3, max_size=3),
            st.booleans(),
        )
        arrays = st.builds(
            lambda item, lo, extra: {"type": "array", "items": item, "minItems": lo, "maxItems": lo + extra},
            children,
            st.integers(0, 2),
            st.integers(0, 2),
        )
        return st.one_of(objects, arrays)

    return st.recursive(_leaf(), extend, max_leaves=5).filter(lambda s: s.get("type") in ("object", "array"))


def check_output(schema: dict, text: str) -> None:
    # a strict parse: a raw control character in a string (which xgrammar's bounded strings admitted) fails it
    jsonschema.validate(json.loads(text), schema)
