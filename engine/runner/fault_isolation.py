"""Fault isolation: a failure in one request's sampling or text ends that request, never the step.

    runner.sampler = GuardedSampler(sampler)   (the runner guards its own sampler)
        logits rows not finite (NaN / inf)  -> its request is recorded as failed (its token is never shown)
        the batched sampler raises           -> every row is sampled alone; the rows that raise are failed
    EngineCore.step: failed requests end with finish_reason "error" (and the message), the rest go on

`FaultInjector` is how tests reach inside (no HTTP field, no flag): set
`EngineCore.fault_injector` to an object with these methods.
"""

from __future__ import annotations

import logging
from typing import Callable, Optional, Protocol, Sequence

import numpy as np
import torch

from engine.sampling.sampler import SamplerOutput
from engine.sampling.state import SamplingState
from engine.structured.token_bitmask import TokenBitmask

logger = logging.getLogger(__name__)


class FaultInjector(Protocol):
    """Test-only hooks into the step (the engine never sets one itself)."""

    def on_logits(self, logits: torch.Tensor, request_ids: Sequence[str]) -> None:
        """May write into `logits` ([num_rows, vocab], row i for request_ids[i]) or raise."""

    def on_detokenize(self, request_id: str) -> None:
        """May raise, as a failing detokenizer would."""


class SampleFn(Protocol):
    """What GuardedSampler wraps: a `Sampler`'s call."""

    def __call__(
        self, logits: torch.Tensor, states: Sequence[SamplingState], token_bitmask: Optional[TokenBitmask] = None
    ) -> SamplerOutput: ...


class GuardedSampler:
    """Wraps the runner's sampler: a row that cannot be sampled fails its request alone."""

    def __init__(self, sampler: SampleFn, request_id_of: Callable[[SamplingState], str]):
        self.sampler = sampler
        self.request_id_of = request_id_of
        self.injector: Optional[FaultInjector] = None
        self.failures: dict[str, str] = {}  # request id -> what went wrong, until the engine takes them

    def take_failures(self) -> dict[str, str]:
        failures, self.failures = self.failures, {}
        return failures

    def __call__(
        self, logits: torch.Tensor, states: Sequence[SamplingState], token_bitmask: Optional[TokenBitmask] = None
    ) -> SamplerOutput:
        try:
            return self._sample(logits, states, token_bitmask)
        except Exception:  # noqa: BLE001 - find the rows at fault: sample each alone
            logger.warning("sampling a batch of %d failed; sampling its rows one by one", len(states))
        tokens: list[int] = []
        logprobs: list = []
        for row, state in enumerate(states):
            try:
                out = self._sample(logits[row : row + 1], [state], _row_mask(token_bitmask, row))
            except Exception as exc:  # noqa: BLE001 - this request fails alone
                self._fail(state, f"sampling failed: {type(exc).__name__}: {exc}")
                tokens.append(0)  # never shown: the request ends with an error in this step
                logprobs.append(None)
                continue
            tokens.append(out.sampled_token_ids[0])
            logprobs.append(None if out.logprobs is None else out.logprobs[0])
        return SamplerOutput(tokens, logprobs if any(lp is not None for lp in logprobs) else None)

    def _sample(
        self, logits: torch.Tensor, states: Sequence[SamplingState], token_bitmask: Optional[TokenBitmask]
    ) -> SamplerOutput:
        if self.injector is not None:
            logits = logits.clone()
            self.injector.on_logits(logits, [self.request_id_of(state) for state in states])
        nonfinite = _nonfinite_rows(logits)  # on a GPU read once the sampler has synchronized
        out = self.sampler(logits, states) if token_bitmask is None else self.sampler(logits, states, token_bitmask)
        if nonfinite is not None:
            for row in nonfinite.nonzero().flatten().tolist():  # a non-finite row's token is garbage: fail it
                self._fail(states[row], "the model produced non-finite logits (NaN or inf)")
        return out

    def _fail(self, state: SamplingState, message: str) -> None:
        request_id = self.request_id_of(state)
        self.failures.setdefault(request_id, message)


def _nonfinite_rows(logits: torch.Tensor) -> Optional[torch.Tensor]:
    """None when every row of logits [num_rows, vocab] is finite, else [num_rows] bool: the rows holding a
    NaN or an infinity (on a GPU always the tensor, not looked at here). A row's sum is finite only if all
    its entries are (inf and NaN propagate); a non-finite sum (or an overflow of finite values) is settled
    element by element. One vectorized pass in the common case, on CPU numpy's for float32 rows: one call,
    where torch's sum, isfinite and all cost several times more (docs/performance.md)."""
    if logits.device.type == "cpu":
        if logits.dtype == torch.float32:
            with np.errstate(over="ignore", invalid="ignore"):  # what the check looks for: no warning
                sums_finite = bool(np.isfinite(logits.numpy().sum(axis=-1)).all())
        else:
            sums_finite = bool(torch.isfinite(logits.sum(dim=-1, dtype=torch.float32)).all())
        if sums_finite:
            return None
        nonfinite = ~torch.isfinite(logits).all(dim=-1)
        return nonfinite if bool(nonfinite.any()) else None
    return ~torch.isfinite(logits).all(dim=-1)


def _row_mask(mask: Optional[TokenBitmask], row: int) -> Optional[TokenBitmask]:
    """The bitmask of one row sampled alone (None when that row is unconstrained)."""
    if mask is None or row not in mask.rows:
        return None
    return TokenBitmask(mask.bitmask[row : row + 1], [0])
