"""The step message's pickled form: compact (token ids as int32 bytes), and every field equal after a round trip."""

import pickle
from array import array
from dataclasses import dataclass, fields

import pytest

from scheduler import NewRequestData, SchedulerOutput

from tests.scheduler.factories import make_request, make_scheduler, sample_for


@dataclass(frozen=True)
class Params:
    """Stands for the engine's sampling parameters, opaque to the scheduler (tests/engine pickles the real ones)."""

    temperature: float
    stop: tuple[str, ...]


def round_trip(obj):
    return pickle.loads(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def assert_same(a, b):
    assert type(a) is type(b)
    for f in fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        assert x == y and type(x) is type(y), f.name
    assert a == b


def test_every_field_survives_a_round_trip():
    long = list(range(49_000, 49_600)) + [0, 2**31 - 1]
    new = (
        NewRequestData("a", long, 600, ((3, 4, 5), (9,)), 16, Params(0.5, ("\n",)), frozenset({2, 7}), "grammar"),
        NewRequestData("b", array("i", [5]), 1, ((1,), ()), 0),  # a resumed one: outputs after the prompt
        NewRequestData("c", (8, 9, 10), 2, ((6,), (7,)), 0, None, frozenset(), None),
    )
    output = SchedulerOutput(
        num_scheduled_tokens={"a": 586, "b": 1, "c": 3, "d": 4},
        num_computed_tokens={"b": 0, "a": 16, "c": 0, "d": 12},  # not in the same order
        step_id=41,
        new_requests=new,
        new_block_ids={"d": ((11,), (12,))},
        preempted_request_ids=frozenset({"e"}),
        finished_request_ids=frozenset({"f", "g"}),
        scheduled_spec_decode_tokens={"d": (1, 2, 3)},
    )
    back = round_trip(output)
    assert_same(output, back)
    assert list(back.num_computed_tokens) == ["b", "a", "c", "d"]
    for sent, got in zip(output.new_requests, back.new_requests):
        assert_same(sent, got)
        assert got.token_ids.typecode == "i" and got.prompt_token_ids == sent.prompt_token_ids
    assert back.new_requests[0].token_ids.tolist() == long
    assert back.new_requests[2].output_token_ids.tolist() == [10]
    assert round_trip(SchedulerOutput({}, {})) == SchedulerOutput({}, {})


def test_token_ids_travel_as_int32_bytes():
    tokens = list(range(1000, 1300))
    message = pickle.dumps(NewRequestData("a", tokens, 300, ((1,),), 0), protocol=5)
    assert array("i", tokens).tobytes() in message  # one buffer, not an int object per token
    with pytest.raises(OverflowError):
        NewRequestData("a", [2**31], 1, ((1,),), 0)  # no vocabulary has ids past int32


def test_the_schedulers_messages_survive_a_round_trip():
    s = make_scheduler(num_blocks=12, block_size=4, max_num_batched_tokens=16)
    for i in range(6):
        s.add_request(make_request(9 + i, first_token=100 + 50 * i, max_tokens=6, ignore_eos=True))
    kinds = set()
    while s.has_unfinished_requests:
        output = s.schedule()
        assert_same(output, round_trip(output))
        for sent, got in zip(output.new_requests, round_trip(output.new_requests)):
            assert_same(sent, got)
        kinds |= {"new"} if output.new_requests else set()
        kinds |= {"preempted"} if output.preempted_request_ids else set()
        kinds |= {"finished"} if output.finished_request_ids else set()
        s.update_from_output(output, sample_for(s, output))
    assert kinds == {"new", "preempted", "finished"}
