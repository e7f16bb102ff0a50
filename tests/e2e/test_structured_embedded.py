"""Structured output on the embedded SmolLM2 model (a real vocabulary and real preferences, where the tiny random
model has neither): bounded JSON schemas, written out and hypothesis-made, in one batch with unconstrained
requests, and schemas whose numbers have no bound but the grammar's own. Every constrained output
ends by its grammar and validates; every unconstrained output equals its output alone (batch-invariant
kernels, so its neighbours' masks cannot have touched it)."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from engine import LLM, SamplingParams
from tests.engine.json_schemas import bounded_schemas, check_output
from tests.engine.references import assert_idle

COLOUR = {
    "type": "object",
    "properties": {
        "colour": {"enum": ["red", "green", "blue"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["colour", "count"],
    "additionalProperties": False,
}
FRUITS = {"type": "array", "items": {"type": "string", "maxLength": 6}, "minItems": 1, "maxItems": 2}
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 10},
                "zip": {"type": "integer", "minimum": 10000, "maximum": 99999},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "address"],
    "additionalProperties": False,
}
REVIEW = {
    "type": "object",
    "properties": {
        "score": {"type": "number", "minimum": 0, "maximum": 1},
        "ok": {"type": "boolean"},
        "note": {"type": "string", "maxLength": 6},
    },
    "required": ["score", "ok"],
    "additionalProperties": False,
}
CONSTRAINED = [  # (question, schema, temperature)
    ("Pick a colour and a count, as JSON.", COLOUR, 0.0),
    ("List two fruits as a JSON array.", FRUITS, 0.0),
    ("Give a person's name and address as JSON.", PERSON, 0.0),
    ("Review this film as JSON: score and ok.", REVIEW, 0.0),
    ("Give a person's name and address as JSON.", PERSON, 1.0),
]
PLAIN = ["What is the capital of France?"]
MAX_TOKENS = 64  # the longest bounded output here is under 50 tokens

CITY = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "country": {"type": "string"},
        "population_millions": {"type": "number"},
    },
    "required": ["name", "country", "population_millions"],
}
FILM = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "year": {"type": "integer"},
        "rating": {"type": "number"},
        "seen": {"type": "boolean"},
    },
    "required": ["title", "year", "rating", "seen"],
}
PRODUCT = {
    "type": "object",
    "properties": {
        "product": {"type": "string"},
        "price": {"type": "number", "minimum": 0},
        "in_stock": {"type": "boolean"},
        "size": {
            "type": "object",
            "properties": {"width_cm": {"type": "number"}, "height_cm": {"type": "number"}},
            "required": ["width_cm", "height_cm"],
        },
    },
    "required": ["product", "price", "in_stock", "size"],
}
UNBOUNDED = [  # schemas without maxLength / maximum: the grammar's own bounds end the numbers (issue 23)
    ("Give me the city of Paris as JSON with its population.", CITY),
    ("Return JSON about Lagos.", CITY),
    ("Describe the movie Titanic as JSON.", FILM),
    ("A chair for sale, as JSON.", PRODUCT),
]


@pytest.fixture(scope="module")
def embedded_llm(embedded_checkpoint):
    with LLM(None, device="cpu", max_model_len=512, kv_cache_memory="64MiB", batch_invariant=True) as llm:
        yield llm  # shut down after the module, not kept for the rest of the run


def conversation(question: str) -> list[dict]:
    return [{"role": "user", "content": question}]


def test_bounded_schemas_validate_beside_unchanged_plain_requests(embedded_llm):
    plain = SamplingParams(max_tokens=12, temperature=0)
    alone = [out.outputs[0] for out in embedded_llm.chat([conversation(q) for q in PLAIN], plain, use_tqdm=False)]
    conversations = [conversation(q) for q, _, _ in CONSTRAINED] + [conversation(q) for q in PLAIN]
    params = [
        SamplingParams(max_tokens=MAX_TOKENS, temperature=t, seed=i, structured_outputs={"json": schema})
        for i, (_, schema, t) in enumerate(CONSTRAINED)
    ] + [plain] * len(PLAIN)
    results = embedded_llm.chat(conversations, params, use_tqdm=False)
    for (question, schema, _), result in zip(CONSTRAINED, results):
        out = result.outputs[0]
        assert out.finish_reason == "stop", (question, out.text)
        jsonschema.validate(json.loads(out.text, strict=False), schema)
    for solo, result in zip(alone, results[len(CONSTRAINED) :]):
        assert result.outputs[0].token_ids == solo.token_ids
        assert result.outputs[0].text == solo.text
    assert_idle(embedded_llm)


@settings(max_examples=4, deadline=None, suppress_health_check=list(HealthCheck))
@given(schema=bounded_schemas(), temperature=st.sampled_from([0.0, 1.0]), seed=st.integers(0, 1000))
def test_generated_schemas_validate_beside_an_unchanged_plain_request(embedded_llm, schema, temperature, seed):
    plain = SamplingParams(max_tokens=8, temperature=0)
    alone = embedded_llm.chat([conversation(PLAIN[0])], plain, use_tqdm=False)[0].outputs[0]
    question = f"Answer with JSON matching this schema: {json.dumps(schema)}"
    constrained = SamplingParams(
        max_tokens=160, temperature=temperature, seed=seed, structured_outputs={"json": schema}
    )
    results = embedded_llm.chat([conversation(question), conversation(PLAIN[0])], [constrained, plain], use_tqdm=False)
    out = results[0].outputs[0]
    assert out.finish_reason == "stop", out.text
    check_output(schema, out.text)
    assert results[1].outputs[0].token_ids == alone.token_ids
    assert_idle(embedded_llm)


@pytest.mark.slow
def test_greedy_json_with_unbounded_numbers_ends(embedded_llm):
    """At temperature 0 the model wrote `"population_millions": 1111111...` until max_tokens; bounded numbers
    (17 significant digits) and no whitespace between tokens end every output well before it."""
    params = [
        SamplingParams(max_tokens=200, temperature=0, structured_outputs={"json": schema}) for _, schema in UNBOUNDED
    ]
    results = embedded_llm.chat([conversation(q) for q, _ in UNBOUNDED], params, use_tqdm=False)
    for (question, schema), result in zip(UNBOUNDED, results):
        out = result.outputs[0]
        assert out.finish_reason == "stop" and len(out.token_ids) < 100, (question, len(out.token_ids), out.text)
        value = json.loads(out.text)
        jsonschema.validate(value, schema)
        assert list(value) == list(schema["properties"])  # the schema's order
        assert not re.search(r"\s", re.sub(r'"(?:[^"\\]|\\.)*"', '""', out.text)), out.text  # no whitespace
    assert_idle(embedded_llm)
