"""Where an engine step's time goes (`--profile`): wall time per phase, summed over steps.

    schedule     the scheduler picks the step's tokens
    prepare      the runner writes the step's inputs (buffers, block table, metadata)
    forward      the model over the KV cache (on CUDA: until the device is done)
    sample       logits of the sampled rows, the sampler, tokens back to the host
    update       the scheduler takes the tokens (stops, frees, prefix-cache indexing)
    detokenize   text, stop strings and outputs of the step's requests
    between      from the end of one step to the start of the next (publishing outputs, taking
                 new requests, idle waits)

Off by default; when on, every phase boundary costs a clock read (and a device sync on CUDA).
"""

from __future__ import annotations

import time
from typing import Callable, Optional

PHASES = ("schedule", "prepare", "forward", "sample", "update", "detokenize", "between")


class StepProfile:
    def __init__(self, synchronize: Optional[Callable[[], None]] = None):
        self.synchronize = synchronize  # waits for the device (CUDA) before the forward phase ends
        self.totals = dict.fromkeys(PHASES, 0.0)
        self.steps = 0
        self._last: Optional[float] = None
        self._step_end: Optional[float] = None

    def begin_step(self) -> None:
        now = time.perf_counter()
        if self._step_end is not None:
            self.totals["between"] += now - self._step_end
        self._last = now

    def lap(self, phase: str) -> None:
        """The time since the previous lap (or the step's start) belongs to `phase`."""
        if phase == "forward" and self.synchronize is not None:
            self.synchronize()
        now = time.perf_counter()
        if self._last is not None:
            self.totals[phase] += now - self._last
        self._last = now

    def end_step(self) -> None:
        self.steps += 1
        self._step_end = self._last = time.perf_counter()

    def table(self) -> str:
        """Mean milliseconds per step and share of the total, per phase."""
        total = sum(self.totals.values()) or 1.0
        steps = max(self.steps, 1)
        lines = [f"step profile over {self.steps} steps (ms per step, share):"]
        for phase in PHASES:
            seconds = self.totals[phase]
            lines.append(f"  {phase:<11} {seconds / steps * 1e3:9.3f} ms  {seconds / total:6.1%}")
        lines.append(f"  {'total':<11} {total / steps * 1e3:9.3f} ms")
        return "\n".join(lines)

    def reset(self) -> None:
        self.totals = dict.fromkeys(PHASES, 0.0)
        self.steps = 0
        self._last = self._step_end = None
