"""The queue bound itself (no server): n counts as n, the token bound, an empty queue admits anything,
Retry-After follows the recent drain rate."""

from __future__ import annotations

import pytest

from server.serving.admission import Admission
from server.http.errors import APIError


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def test_sequences_are_counted_one_by_one_and_given_back_once():
    admission = Admission(max_requests=4, max_tokens=1000, clock=Clock())
    ticket = admission.admit(["a#0", "a#1", "a#2"], [10, 10, 10])  # n = 3
    assert (admission.num_requests, admission.num_tokens) == (3, 30)
    with pytest.raises(APIError) as refused:
        admission.admit(["b#0", "b#1"], [5, 5])
    assert refused.value.status == 429 and refused.value.code == "queue_full"
    ticket.started("a#0")
    ticket.started("a#0")
    assert admission.num_requests == 2
    ticket.release()
    ticket.release()
    assert (admission.num_requests, admission.num_tokens) == (0, 0)


def test_the_token_bound_and_the_empty_queue():
    admission = Admission(max_requests=10, max_tokens=100, clock=Clock())
    big = admission.admit(["a"], [500])  # an empty queue takes even a prompt over the bound
    with pytest.raises(APIError):
        admission.admit(["b"], [1])
    big.release()
    admission.admit(["c"], [60])
    with pytest.raises(APIError) as refused:
        admission.admit(["d"], [60])
    assert "--max-queued-tokens 100" in refused.value.message


def test_retry_after_follows_the_drain_rate():
    clock = Clock()
    admission = Admission(max_requests=2, max_tokens=1000, clock=clock)
    assert admission.retry_after(1) >= 1  # nothing drained yet: a default
    for i in range(10):  # ten sequences started over ten seconds: one per second
        admission.admit([f"r{i}"], [1]).started(f"r{i}")
        clock.now += 1.0
    assert admission.retry_after(5) == 5
    assert admission.retry_after(1000) == 60  # capped
    clock.now += 100  # the window forgot them
    assert admission.retry_after(3) >= 1


def test_a_request_larger_than_the_queue_is_a_400():
    admission = Admission(max_requests=4, max_tokens=1000, clock=Clock())
    with pytest.raises(APIError) as refused:
        admission.check_size(5, "n")
    assert refused.value.status == 400 and refused.value.param == "n"
