"""What structured output costs on the embedded model: `python -m benchmarks.structured_overhead`.

    compile   a typical JSON schema: the vocabulary's token table (once per process), a cold compile (a schema
              not seen before; min over a few), a cached one (the GrammarCompiler's LRU hit)
    step      decode steps of a batch of B requests, all constrained by that schema vs none constrained, same
              prompts and lengths; only steps where all B rows decode one token count. Each mode runs
              `--repeats` times, alternating; per-step times are CPU time of the process (robust on a shared
              machine) and wall time, as the min and the median
    parts     of a constrained step: the bitmask fill of its B matchers (xgrammar; timed inside the constrained
              runs, so at the grammar states the model really reaches) and the mask applied to [B, vocab]
              float32 logits (xgrammar's CPU kernel, timed alone)

The issue's target: a constrained step within 10% of an unconstrained one on the CPU.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from engine.bench import make_prompts
from engine.llm import LLM
from engine.sampling.params import SamplingParams
from engine.structured import StructuredOutputs
from engine.structured.token_bitmask import TokenBitmask, apply_token_bitmask

SCHEMA = {  # an order: a list of line items, the kind of schema an extraction task sends
    "type": "object",
    "properties": {
        "customer": {"type": "string", "maxLength": 24},
        "priority": {"enum": ["low", "normal", "high"]},
        "items": {
            "type": "array",
            "minItems": 6,
            "maxItems": 12,
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 16},
                    "quantity": {"type": "integer", "minimum": 1, "maximum": 99},
                    "unit_price": {"type": "number", "minimum": 0, "maximum": 1000},
                    "tags": {"type": "array", "items": {"enum": ["new", "sale", "gift"]}, "maxItems": 2},
                },
                "required": ["name", "quantity", "unit_price"],
                "additionalProperties": False,
            },
        },
    },
    "required": ["customer", "priority", "items"],
    "additionalProperties": False,
}


@dataclass
class StepTimes:
    cpu: list[float] = field(default_factory=list)
    wall: list[float] = field(default_factory=list)
    sample: list[float] = field(default_factory=list)  # wall seconds of the runner's sample phase

    def summary(self) -> tuple[float, float, float, float]:
        """(cpu min, cpu median, wall min, wall median), milliseconds."""
        return (
            min(self.cpu) * 1e3,
            statistics.median(self.cpu) * 1e3,
            min(self.wall) * 1e3,
            statistics.median(self.wall) * 1e3,
        )


def timed(fn: Callable[[], object]) -> tuple[float, float]:
    """(process CPU seconds, wall seconds) of one call."""
    cpu, wall = time.process_time(), time.perf_counter()
    fn()
    return time.process_time() - cpu, time.perf_counter() - wall


def compile_times(llm: LLM, repeats: int) -> dict[str, float]:
    compiler = llm.engine.grammar_compiler
    table = timed(compiler.compiler)[1]  # the vocabulary's token table: first use only
    cold = []
    for i in range(repeats):  # a new schema each time: a description makes the key new, not the grammar
        schema = {**SCHEMA, "description": f"run {time.time_ns()} {i}"}
        cold.append(timed(lambda: compiler.compile(StructuredOutputs.of_kind("json", schema, "schema")))[1])
    constraint = StructuredOutputs.of_kind("json", SCHEMA, "schema")
    compiler.compile(constraint)
    cached = min(timed(lambda: compiler.compile(constraint))[1] for _ in range(100))
    return {
        "token table (first use)": table,
        "cold compile (min)": min(cold),
        "cold compile (median)": statistics.median(cold),
        "cached": cached,
    }


def decode_steps(
    llm: LLM, prompts: list[list[int]], params: SamplingParams, num_steps: int, times: StepTimes, tag: str
) -> None:
    """Queue one request per prompt, then time up to `num_steps` steps in which every request decodes."""
    engine = llm.engine
    runner = engine.runner
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts):
        engine.add_request(request_id, prompt, params)
    sample, last = runner._sample, [0.0]

    def timed_sample(*args):  # the phase that differs: logits, mask fill and apply, sampling, matchers' accept
        started = time.perf_counter()
        out = sample(*args)
        last[0] = time.perf_counter() - started
        return out

    runner._sample = timed_sample
    counted = 0
    while counted < num_steps and engine.has_unfinished_requests:
        before = engine.stats()
        all_decoding = before.num_running == len(prompts) and engine.num_steps > 0 and _decoding(engine, ids)
        cpu, wall = timed(engine.step)
        if all_decoding and engine.last_step_num_tokens == len(prompts):
            times.cpu.append(cpu)
            times.wall.append(wall)
            times.sample.append(last[0])
            counted += 1
    del runner._sample
    engine.abort([i for i in ids if i in engine.unfinished_request_ids()])
    while engine.has_work:
        engine.step()


def _decoding(engine, ids: list[str]) -> bool:
    requests = engine.scheduler.requests
    return all(r in requests and requests[r].num_output_tokens > 0 for r in ids)


def mask_parts(llm: LLM, batch: int, repeats: int) -> dict[str, float]:
    """Each alone (min seconds): the mask applied on [B, vocab] float32 logits, the float32 copy the sampler
    masks, and B matchers accepting one token each (the mean over a real constrained output's tokens)."""
    grammar = llm.engine.runner.grammar
    constraint = StructuredOutputs.of_kind("json", SCHEMA, "schema")
    mask = grammar.fill_bitmask([(row, grammar.new_matcher(constraint, [])) for row in range(batch)], batch)
    logits = torch.randn(batch, llm.engine.vocab_size)  # [B, vocab] float32, as compute_logits returns
    apply = min(
        timed(lambda: apply_token_bitmask(logits, TokenBitmask(mask.bitmask, mask.rows)))[1] for _ in range(repeats)
    )
    copy = min(timed(lambda: logits.to(torch.float32, copy=True))[1] for _ in range(repeats))
    params = SamplingParams(max_tokens=200, temperature=0, structured_outputs={"json": SCHEMA})
    tokens = llm.generate(["Orders:"], params, use_tqdm=False)[0].outputs[0].token_ids
    per_token = min(timed(lambda: grammar.new_matcher(constraint, tokens))[1] for _ in range(5)) / len(tokens)
    return {
        "bitmask apply (min)": apply,
        "logits float32 copy (min)": copy,
        f"accept, {batch} matchers (min)": per_token * batch,
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=16, help="timed decode steps per run")
    parser.add_argument("--repeats", type=int, default=5, help="runs of each mode, alternating")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--dtype", default=None, help="the model's dtype (default: the engine's CPU default)")
    args = parser.parse_args(argv)
    kwargs = {"dtype": args.dtype} if args.dtype else {}
    llm = LLM(None, device="cpu", max_model_len=1024, max_num_seqs=max(args.batch, 16), **kwargs)
    compile_ = compile_times(llm, repeats=5)
    prompts = make_prompts(llm, args.batch, args.prompt_len, seed=0)
    modes = {
        "unconstrained": SamplingParams(max_tokens=400, temperature=0, ignore_eos=True),
        "constrained": SamplingParams(max_tokens=400, temperature=0, structured_outputs={"json": SCHEMA}),
    }
    llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], SamplingParams(max_tokens=4), use_tqdm=False)
    times = {mode: StepTimes() for mode in modes}
    fills: list[float] = []
    grammar = llm.engine.runner.grammar
    for run in range(args.repeats):
        for mode, params in modes.items():
            grammar.on_fill = fills.append if mode == "constrained" else None
            decode_steps(llm, prompts, params, args.steps, times[mode], f"{mode}-{run}")
    grammar.on_fill = None
    parts = {
        "bitmask fill (min)": min(fills),
        "bitmask fill (median)": statistics.median(fills),
        **mask_parts(llm, args.batch, repeats=50),
    }
    _report(args, llm, compile_, times, parts)


def _report(args, llm: LLM, compile_: dict, times: dict[str, StepTimes], parts: dict) -> None:
    print(
        f"embedded model, {llm.engine.runner.model.dtype}, {torch.get_num_threads()} torch threads, "
        f"batch {args.batch}, prompt {args.prompt_len} tokens"
    )
    print("\ngrammar compile (typical schema)        ms")
    for name, seconds in compile_.items():
        print(f"  {name:<36} {seconds * 1e3:9.3f}")
    print(f"\ndecode step, batch {args.batch}     steps   cpu min  cpu med  wall min  wall med   (ms)")
    for mode, t in times.items():
        print(f"  {mode:<24} {len(t.cpu):5d}  " + "  ".join(f"{v:7.1f}" for v in t.summary()))
    plain, constrained = times["unconstrained"].summary(), times["constrained"].summary()
    print(
        "  overhead                        "
        + "  ".join(f"{(c - p) / p * 100:+6.1f}%" for p, c in zip(plain, constrained))
    )
    samples = {mode: (min(t.sample) * 1e3, statistics.median(t.sample) * 1e3) for mode, t in times.items()}
    print("\nsample phase (the only one that differs)   min     med   (ms)")
    for mode, (low, mid) in samples.items():
        print(f"  {mode:<36} {low:7.2f} {mid:7.2f}")
    extra = samples["constrained"][0] - samples["unconstrained"][0]
    print(
        f"  constrained extra (min - min)        {extra:7.2f}   = {extra / plain[2] * 100:.1f}% of the "
        f"unconstrained step (wall min), {extra / plain[0] * 100:.1f}% of its cpu min"
    )
    print("\nparts of a constrained step                ms   share of the unconstrained step (wall min)")
    for name, seconds in parts.items():
        print(f"  {name:<36} {seconds * 1e3:7.3f}   {seconds * 1e3 / plain[2] * 100:5.1f}%")
    total = sum(v for k, v in parts.items() if "fill (min)" not in k) * 1e3  # fill counted by its median
    print(f"  {'sum (fill median + the rest)':<36} {total:7.3f}   {total / plain[2] * 100:5.1f}%")


if __name__ == "__main__":
    main()
