"""What a decode-shaped step costs by its number of query rows: the measured model the scheduler weighs
speculation's verification rows against."""

from __future__ import annotations

import bisect
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class StepCost:
    """Seconds of a step of `rows[i]` decode rows, measured on this machine (the engine measures it at
    start-up); between two measured sizes the cost is interpolated linearly, beyond the last extrapolated
    from the last two (a step that large is compute-bound: its cost grows with its rows)."""

    rows: tuple[int, ...]
    seconds: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.rows) < 2 or len(self.rows) != len(self.seconds) or list(self.rows) != sorted(set(self.rows)):
            raise ValueError(f"a step cost needs two or more increasing row counts with a time each: {self}")

    def __call__(self, num_rows: int) -> float:
        rows, seconds = self.rows, self.seconds
        i = min(max(bisect.bisect_left(rows, num_rows), 1), len(rows) - 1)
        slope = (seconds[i] - seconds[i - 1]) / (rows[i] - rows[i - 1])
        return max(seconds[i - 1] + slope * (num_rows - rows[i - 1]), seconds[0])
