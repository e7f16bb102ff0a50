"""Admission control: the bound on sequences waiting for their first token, and the 429 beyond it.

    route --admit(prompt token counts)--> Admission: queue non-empty and over a bound? -> 429 + Retry-After
                                           else: a Ticket holds one place per sequence
    first output of a sequence --> ticket.started(id): its place is freed (it now runs) and counted in the
                                   drain rate that Retry-After is estimated from
    stream closed / request ended --> ticket.release(): every place still held is freed

Every sequence counts (a request with two prompts and n = 3 holds six places). The
counts live on the event loop only; nothing here touches the engine.
"""

from __future__ import annotations

import math
import time
from collections import deque
from typing import Callable, Optional, Sequence

from server.http.errors import APIError, bad_request

DRAIN_WINDOW_S = 30.0  # the drain rate is measured over this many recent seconds
RETRY_AFTER_MIN_S = 1
RETRY_AFTER_MAX_S = 60
RETRY_AFTER_UNKNOWN_S = 2  # when nothing has left the queue recently


class Admission:
    """Counts the sequences admitted that have not produced a token yet, and their prompt tokens."""

    def __init__(
        self,
        max_requests: int,
        max_tokens: int,
        clock: Callable[[], float] = time.monotonic,
        on_reject: Optional[Callable[[], None]] = None,
    ):
        self.max_requests = max_requests
        self.max_tokens = max_tokens
        self.num_requests = 0
        self.num_tokens = 0
        self._clock = clock
        self._on_reject = on_reject
        self._started: deque[float] = deque()  # when sequences left the queue by starting

    def check_size(self, num_sequences: int, param: str) -> None:
        """A request with more sequences than the queue can ever hold is a 400 (naming `param`), not a 429."""
        if num_sequences > self.max_requests:
            raise bad_request(
                f"this request asks for {num_sequences} sequences (prompts x n, or inputs to embed); at most "
                f"{self.max_requests} can be queued (--max-queued-requests).",
                param=param,
            )

    def precheck(self, count: int) -> None:
        """The 429 that `admit` would give `count` sequences now, before the request is tokenized."""
        if self.num_requests > 0 and self.num_requests + count > self.max_requests:
            self._refuse(count, over_requests=True)

    def admit(self, request_ids: Sequence[str], prompt_tokens: Sequence[int]) -> "Ticket":
        """Places for the sequences `request_ids` (each with its prompt length), or a 429 when the queue is
        full. A request is always admitted into an empty queue (so a long prompt is never refused forever)."""
        count, tokens = len(request_ids), sum(prompt_tokens)
        over_requests = self.num_requests + count > self.max_requests
        over_tokens = self.num_tokens + tokens > self.max_tokens
        if self.num_requests > 0 and (over_requests or over_tokens):
            self._refuse(count, over_requests)
        self.num_requests += count
        self.num_tokens += tokens
        return Ticket(self, dict(zip(request_ids, prompt_tokens)))

    def _refuse(self, count: int, over_requests: bool) -> None:
        if self._on_reject is not None:
            self._on_reject()
        what = (
            f"--max-queued-requests {self.max_requests}" if over_requests else f"--max-queued-tokens {self.max_tokens}"
        )
        excess = self.num_requests + count - self.max_requests if over_requests else count
        retry = self.retry_after(max(excess, 1))
        raise APIError(
            429,
            f"the server is busy: {self.num_requests} sequences ({self.num_tokens} prompt "
            f"tokens) are waiting, the limit is {what}. Retry after {retry} s.",
            code="queue_full",
            headers={"Retry-After": str(retry)},
        )

    def retry_after(self, excess: int) -> int:
        """Whole seconds until `excess` more sequences should have left the queue, at the recent drain rate."""
        now = self._clock()
        self._forget_before(now - DRAIN_WINDOW_S)
        if not self._started:
            return RETRY_AFTER_UNKNOWN_S
        span = max(now - self._started[0], 1.0)
        rate = len(self._started) / span  # sequences per second
        return int(min(max(math.ceil(excess / rate), RETRY_AFTER_MIN_S), RETRY_AFTER_MAX_S))

    def _leave(self, tokens: int, started: bool) -> None:
        self.num_requests -= 1
        self.num_tokens -= tokens
        if started:
            now = self._clock()
            self._started.append(now)
            self._forget_before(now - DRAIN_WINDOW_S)

    def _forget_before(self, cutoff: float) -> None:
        while self._started and self._started[0] < cutoff:
            self._started.popleft()


class Ticket:
    """The places one request holds in the queue; each is given back once (started or released)."""

    def __init__(self, admission: Admission, held: dict[str, int]):
        self._admission = admission
        self._held = held  # request id -> prompt tokens, while waiting

    def started(self, request_id: str) -> None:
        """The sequence produced its first output: it no longer waits."""
        tokens = self._held.pop(request_id, None)
        if tokens is not None:
            self._admission._leave(tokens, started=True)

    def release(self) -> None:
        """Give back every place still held (the request ended, failed or was refused)."""
        held, self._held = self._held, {}
        for tokens in held.values():
            self._admission._leave(tokens, started=False)
