"""Grammar-constrained decoding in the engine: hypothesis-made JSON schemas validate, at temperature 0 and 1,
mixed with unconstrained requests (unchanged by their neighbours), across preemption, and the refusals."""

from __future__ import annotations

import dataclasses
import json
import pickle

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from engine.errors import InvalidParameterError
from engine.sampling.params import SamplingParams
from engine.structured import StructuredOutputs
from engine.runner.peer_step import PeerStep
from engine.structured.grammar_ref import GrammarRef
from scheduler import NewRequestData, SchedulerOutput
from tests.engine.json_schemas import bounded_schemas, check_output
from tests.engine.references import assert_idle, make_llm

PROMPTS = ["The quick brown fox", "Hello, world! How", "def add(a, b):", "Once upon a time"]


@pytest.fixture(scope="module")
def invariant_llm(tiny_llama_dir):
    """Batch-invariant kernels: an unconstrained request's tokens cannot depend on its neighbours."""
    with make_llm(tiny_llama_dir, batch_invariant=True) as llm:
        yield llm


@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))
@given(schema=bounded_schemas(), temperature=st.sampled_from([0.0, 1.0]), seed=st.integers(0, 1000))
def test_generated_schemas_validate_in_mixed_batches(invariant_llm, schema, temperature, seed):
    plain = SamplingParams(max_tokens=8, temperature=0.0)
    constrained = SamplingParams(
        max_tokens=240, temperature=temperature, seed=seed, structured_outputs={"json": schema}
    )
    alone = invariant_llm.generate(PROMPTS[:1], plain)[0].outputs[0]
    outputs = invariant_llm.generate(PROMPTS, [plain, constrained, constrained.replace(seed=seed + 1), plain])
    for out in outputs[1:3]:
        assert out.outputs[0].finish_reason == "stop", out.outputs[0].text
        check_output(schema, out.outputs[0].text)
    assert outputs[0].outputs[0].token_ids == alone.token_ids
    assert_idle(invariant_llm)


def test_every_kind_of_constraint(llm):
    kinds = [
        ({"regex": "[a-c]{2,4}-[0-9]{3}"}, lambda t: __import__("re").fullmatch("[a-c]{2,4}-[0-9]{3}", t)),
        ({"choice": ["alpha", "beta gamma"]}, lambda t: t in ("alpha", "beta gamma")),
        ({"grammar": 'root ::= "yes" | "no" | "maybe"'}, lambda t: t in ("yes", "no", "maybe")),
        ({"json_object": True}, lambda t: isinstance(json.loads(t), dict)),
    ]
    params = [SamplingParams(max_tokens=200, temperature=1.0, seed=3, structured_outputs=k) for k, _ in kinds]
    outputs = llm.generate(PROMPTS, params)
    for (_, ok), out in zip(kinds, outputs):
        assert out.outputs[0].finish_reason == "stop"
        assert ok(out.outputs[0].text), out.outputs[0].text


def test_vllms_offline_params_objects_are_read_as_the_dict_form(llm):
    """vLLM's `SamplingParams(structured_outputs=StructuredOutputsParams(...))` and the older
    `guided_decoding=GuidedDecodingParams(...)` constrain as the dict form does (they were TypeErrors); options
    that are what this engine does are taken, others refused by name."""
    from engine.sampling.params import GuidedDecodingParams, StructuredOutputsParams

    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    params = [
        SamplingParams(max_tokens=60, temperature=0, structured_outputs={"json": schema}),
        SamplingParams(
            max_tokens=60, temperature=0, structured_outputs=StructuredOutputsParams(json=schema, disable_fallback=True)
        ),
        SamplingParams(max_tokens=60, temperature=0, guided_decoding=GuidedDecodingParams(json=json.dumps(schema))),
        SamplingParams(
            max_tokens=60, temperature=0, guided_decoding=GuidedDecodingParams(choice=["yes", "no"], backend="xgrammar")
        ),
    ]
    assert params[0].structured_outputs == params[1].structured_outputs == params[2].structured_outputs
    outputs = [out.outputs[0].text for out in llm.generate(PROMPTS[:1] * 4, params)]
    assert outputs[0] == outputs[1] == outputs[2] and isinstance(json.loads(outputs[0])["n"], int)
    assert outputs[3] in ("yes", "no")
    for bad, field in (
        (StructuredOutputsParams(json=schema, structural_tag="{}"), "structural_tag"),
        (GuidedDecodingParams(regex="a+", backend="outlines"), "backend"),
        (StructuredOutputsParams(regex="a+", choice=["a"]), "structured_outputs"),
    ):
        with pytest.raises(InvalidParameterError, match=field):
            SamplingParams(structured_outputs=bad)
    with pytest.raises(InvalidParameterError, match="guided_decoding"):
        SamplingParams(structured_outputs={"regex": "a"}, guided_decoding=GuidedDecodingParams(regex="b"))
    assert SamplingParams(structured_outputs={"regex": "a"}).replace(n=2).structured_outputs.regex == "a"


def test_penalties_logprobs_and_top_k_keep_working(llm):
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["n"],
        "additionalProperties": False,
    }
    params = SamplingParams(
        max_tokens=60,
        temperature=0.8,
        top_k=5,
        top_p=0.9,
        seed=1,
        logprobs=2,
        repetition_penalty=1.2,
        presence_penalty=0.5,
        logit_bias={5: 3.0},
        structured_outputs={"json": schema},
    )
    out = llm.generate(PROMPTS[:1], params)[0].outputs[0]
    check_output(schema, out.text)
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)


def test_preemption_rebuilds_the_matcher(tiny_llama_dir):
    """Few KV blocks: requests are preempted and recomputed; their matchers are rebuilt from the outputs."""
    schema = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 12, "maxItems": 12}
    params = SamplingParams(max_tokens=60, temperature=0.0, structured_outputs={"json": schema})
    roomy = make_llm(tiny_llama_dir, enable_prefix_caching=True)
    expected = [o.outputs[0].text for o in roomy.generate(PROMPTS, params)]
    tight = make_llm(tiny_llama_dir, num_blocks=24, enable_prefix_caching=True)
    outputs = tight.generate(PROMPTS, params)
    assert tight.llm_engine.stats().num_preemptions > 0
    assert [o.outputs[0].text for o in outputs] == expected
    for text in expected:
        check_output(schema, text)
    again = tight.generate(PROMPTS[:1], params)[0]  # prefix-cache hit on the prompt
    assert again.outputs[0].text == expected[0]
    assert_idle(tight)


def test_compiled_grammars_are_cached(llm):
    compiler = llm.llm_engine.grammar_compiler
    seen = []
    compiler.on_compile = seen.append
    constraint = StructuredOutputs.parse({"json": {"type": "object", "properties": {"zz": {"type": "boolean"}}}})
    first = compiler.compile(constraint)
    assert (
        compiler.compile(
            StructuredOutputs.parse({"json": {"properties": {"zz": {"type": "boolean"}}, "type": "object"}})
        )
        is first
    )
    assert len(seen) == 1
    compiler.on_compile = None


def test_a_request_holds_its_grammar_and_a_pickled_one_travels_empty(llm):
    """The scheduler request keeps the compiled grammar (the cache may drop it); a step message pickled for a
    worker carries the reference empty, and the worker compiles the constraint itself."""
    engine = llm.engine
    params = SamplingParams(max_tokens=8, structured_outputs={"regex": "[xyz]{3}"})
    compiled = engine.grammar_compiler.compile(params.structured_outputs)
    request = engine.make_request("held", [5, 6, 7], params, grammar=compiled)
    assert isinstance(request.grammar, GrammarRef) and request.grammar.compiled is compiled
    offline = engine.make_request("offline", [5, 6, 7], params)  # compiled (here: found) synchronously
    assert isinstance(offline.grammar, GrammarRef) and offline.grammar.compiled is compiled
    assert engine.make_request("plain", [5, 6, 7], SamplingParams(max_tokens=8)).grammar is None
    assert pickle.loads(pickle.dumps(request.grammar)).compiled is None


def test_a_step_message_round_trip_keeps_every_field_and_sends_the_grammar_empty(llm):
    """What a worker gets (a PeerStep, pickled by the shared-memory broadcast): the sampling parameters equal,
    the token ids equal (int32 bytes on the wire), the grammar reference empty (the worker compiles its own)."""
    engine = llm.engine
    params = SamplingParams(
        max_tokens=8,
        temperature=0.7,
        seed=5,
        stop=["\n"],
        logit_bias={3: 1.5},
        structured_outputs={"regex": "[xyz]{3}"},
    )
    request = engine.make_request("held", [i % 500 for i in range(300)], params)
    new = NewRequestData(
        request.request_id,
        request.all_token_ids,
        request.num_prompt_tokens,
        ((1, 2),),
        0,
        request.sampling_params,
        request.eos_token_ids,
        request.grammar,
    )
    output = SchedulerOutput({"held": 300}, {"held": 0}, step_id=3, new_requests=(new,), new_block_ids={})
    back = pickle.loads(pickle.dumps(PeerStep(output, {"other": [4]}), protocol=5))
    assert back.sampled_token_ids == {"other": [4]}
    got = back.scheduler_output.new_requests[0]
    assert isinstance(got.grammar, GrammarRef) and got.grammar.compiled is None
    assert isinstance(new.grammar, GrammarRef) and new.grammar.compiled is not None
    assert got.sampling_params == params and got.sampling_params.structured_outputs == params.structured_outputs
    assert got.token_ids.tolist() == request.all_token_ids and got.eos_token_ids == request.eos_token_ids
    assert dataclasses.replace(got, grammar=new.grammar) == new
    assert dataclasses.replace(back.scheduler_output, new_requests=output.new_requests) == output


@pytest.mark.parametrize(
    "value, field",
    [
        ({"json": {"type": "object", "uniqueItems": True}}, "structured_outputs.json"),
        ({"json": {"type": "strange"}}, "structured_outputs.json"),
        ({"json": "{not json"}, "structured_outputs.json"),
        ({"regex": ""}, "structured_outputs.regex"),
        ({"json": {}, "regex": "a"}, "structured_outputs"),
        ({"nonsense": 1}, "structured_outputs.nonsense"),
    ],
)
def test_refusals_name_the_field(value, field):
    with pytest.raises(InvalidParameterError) as caught:
        SamplingParams(structured_outputs=value)
    assert caught.value.field == field


def test_uncompilable_grammar_is_refused(llm):
    with pytest.raises(InvalidParameterError) as caught:
        llm.generate(PROMPTS[:1], SamplingParams(structured_outputs={"grammar": "root ::= ( unclosed"}))
    assert caught.value.field == "structured_outputs"
    assert_idle(llm)


def test_ignore_eos_cannot_combine():
    with pytest.raises(InvalidParameterError) as caught:
        SamplingParams(ignore_eos=True, structured_outputs={"regex": "a"})
    assert caught.value.field == "ignore_eos"


def test_a_draft_that_ends_the_grammar_with_a_stop_token_is_checked_without_error(llm):
    """Speculative decoding: drafts that complete the grammar, then its stop token, then more. The check stops at
    the stop token (a terminated matcher has no next mask: xgrammar raises, which on the engine thread failed every
    request) and leaves the matcher where it was."""
    decoder = llm.engine.runner.grammar
    tokenizer = llm.engine.tokenizer
    text = tokenizer.encode("ab")
    eos = min(tokenizer.eos_token_ids)
    matcher = decoder.new_matcher(StructuredOutputs.parse({"regex": "ab"}), [])
    drafts = [*text, eos, text[0]]
    mask = decoder.fill_bitmask([(0, matcher)], 1 + len(drafts), {0: drafts})
    assert mask.rows == list(range(1 + len(text)))  # the state before each draft, up to the stop token
    assert not matcher.is_terminated() and matcher.accept_token(text[0])  # rolled back to the start


# Schemas whose keywords the grammar engine would drop, each with a value its grammar admits though the schema
# does not: refused by name, so that a schema is never half enforced.
DROPPED = [
    ({"allOf": [{"type": "integer"}, {"minimum": 1000}]}, "2.5", "'allOf' of 2 schemas"),
    ({"type": "object", "required": ["zz"]}, "{}", "requires 'zz'"),
    (
        {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["b"], "additionalProperties": False},
        '{"a":2}',
        "requires 'b'",
    ),
    ({"anyOf": [{"type": "integer", "maximum": 5}], "minimum": 3}, "1", "combines 'anyOf' with 'minimum'"),
    ({"$ref": "#/$defs/n", "$defs": {"n": {"type": "integer"}}, "maximum": 3}, "7", "combines '$ref' with 'maximum'"),
    ({"minLength": 3}, '"a"', "'minLength' but no 'type'"),
]


@pytest.mark.parametrize("schema, admitted, message", DROPPED)
def test_schemas_the_grammar_would_half_enforce_are_refused(schema, admitted, message):
    import jsonschema
    import xgrammar as xgr

    from engine.structured.json_bounds import json_schema_grammar

    # the premise: xgrammar's grammar for it admits a value the schema does not (when xgrammar learns the
    # keyword, this fails and the refusal can go)
    grammar = xgr.Grammar.from_ebnf(json_schema_grammar(json.dumps(schema)))
    assert xgr.testing._is_grammar_accept_string(grammar, admitted)
    assert not jsonschema.Draft202012Validator(schema).is_valid(json.loads(admitted))
    with pytest.raises(InvalidParameterError) as caught:
        SamplingParams(structured_outputs={"json": schema})
    assert caught.value.field == "structured_outputs.json" and message in str(caught.value)


@pytest.mark.parametrize(
    "schema",
    [
        {"allOf": [{"type": "integer"}]},
        {"type": "string", "enum": ["a", "b"], "title": "x"},
        {"const": "a", "enum": ["a"], "type": "string"},
        {"$ref": "#/$defs/A", "$defs": {"A": {"type": "integer"}}, "description": "d"},
        {"anyOf": [{"type": "string"}, {"type": "null"}], "default": None, "title": "T"},
        {"properties": {"a": {"type": "string"}}, "required": ["a"]},
        {"type": ["string", "null"], "maxLength": 4},
        {  # pydantic's tagged union: OpenAPI's discriminator beside the oneOf, each branch's tag a const
            "oneOf": [{"$ref": "#/$defs/Cat"}, {"$ref": "#/$defs/Dog"}],
            "discriminator": {"propertyName": "kind", "mapping": {"cat": "#/$defs/Cat", "dog": "#/$defs/Dog"}},
            "$defs": {
                "Cat": {
                    "type": "object",
                    "properties": {"kind": {"const": "cat", "type": "string"}},
                    "required": ["kind"],
                },
                "Dog": {
                    "type": "object",
                    "properties": {"kind": {"const": "dog", "type": "string"}},
                    "required": ["kind"],
                },
            },
        },
    ],
)
def test_schemas_the_grammar_enforces_whole_are_accepted(schema):
    """What pydantic and OpenAI's strict schemas write: annotations beside a $ref or anyOf, a type beside enum."""
    SamplingParams(structured_outputs={"json": schema})
