"""An engine kept in decode: the step timer the step benchmarks (moe_step, tensor_parallel) share."""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path
from typing import Any, Optional


class DecodeSteps:
    """An engine with `batch` requests kept in decode; `median_ms` times a run of its steps. `threads`: torch's
    threads while this engine steps (process-wide: engines compared in one process each set their own)."""

    def __init__(
        self, model_dir: Path, batch: int, max_steps: int, prompt_len: int, threads: Optional[int] = None, **llm: Any
    ):
        import torch

        from engine import LLM, SamplingParams

        self.threads = threads
        if threads is not None:
            torch.set_num_threads(threads)
        self.llm = LLM(
            str(model_dir),
            device="cpu",
            max_model_len=prompt_len + max_steps + 16,
            max_num_seqs=batch,
            max_num_batched_tokens=max(256, prompt_len * batch),
            **llm,
        )
        engine = self.llm.engine
        params = SamplingParams(max_tokens=max_steps, temperature=0, ignore_eos=True)
        for i in range(batch):
            engine.add_request(f"bench-{i}", [(7 * i + 13 * j) % 1000 + 3 for j in range(prompt_len)], params)
        engine.step()  # the prefills
        engine.step()
        # With tensor parallelism rank 0 (this process) is pinned to its share of the CPUs until its engine stops:
        # each engine steps on the CPUs it had when it started.
        self.cpus = os.sched_getaffinity(0)

    def median_ms(self, steps: int) -> float:
        self._take_cpus()
        timings = []
        for _ in range(steps):
            start = time.perf_counter()
            self.llm.engine.step()
            timings.append(time.perf_counter() - start)
        return statistics.median(timings) * 1e3

    def tokens_per_s(self, steps: int) -> float:
        """Output tokens per second over `steps` steps (with pipeline parallelism a step returns one of the batches
        in flight, so a step's time alone would not compare)."""
        self._take_cpus()
        engine = self.llm.engine
        start = time.perf_counter()
        tokens = sum(len(out.new_token_ids) for _ in range(steps) for out in engine.step())
        return tokens / (time.perf_counter() - start)

    def _take_cpus(self) -> None:
        import torch

        from engine.distributed.cpu_binding import pin_process

        if self.threads is not None:
            torch.set_num_threads(self.threads)
        pin_process(self.cpus)
