"""Batched token sampling, each row under its own request's parameters.

raw logits ──► logprobs: the raw log-softmax, reported as is
    │
    ├─ min_tokens: eos (unless ignore_eos) and stop_token_ids -> -inf
    ├─ bad_words: the last token of each word the output ends with the rest of -> -inf
    ├─ logit_bias, added
    ├─ repetition penalty over prompt + output tokens
    ├─ presence / frequency penalties over output tokens
    ├─ allowed_token_ids: every other token -> -inf
    ├─ structured output: tokens outside the grammar -> -inf (a TokenBitmask, on the device)
    ▼
greedy rows: argmax
sampled rows: temperature, min_p, top_k, top_p, then a draw
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Optional, Sequence

import torch

from engine.sampling.device_io import to_device, to_host
from engine.sampling.params import SamplingParams
from engine.sampling.state import SamplingState
from engine.structured.token_bitmask import TokenBitmask, apply_token_bitmask

TOP_P_CANDIDATES = 128
"""Candidates first examined for a top-p row without top-k (then 16x more, then the whole vocabulary)."""

PROMPT_LOGPROBS_CHUNK = 1 << 24
"""Logit elements log-softmaxed at a time by `prompt_logprobs`."""


class TokenLogprobs(NamedTuple):
    """A token's raw logprob, its rank (1 + tokens strictly more likely), the top alternatives best first."""

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]]


@dataclass(frozen=True, slots=True)
class SamplerOutput:
    """One token per row; per-row logprobs, None for rows that did not ask (and None overall if none did)."""

    sampled_token_ids: list[int]
    logprobs: Optional[list[Optional[TokenLogprobs]]]


NativeRows = Callable[..., torch.Tensor]
"""`CpuKernels.sample_rows`: (float32 logits [rows, vocab], temperatures, log min_ps, top-ks, top-ps, uniforms)
-> token ids [rows]."""

NativeLogprobs = Callable[[torch.Tensor, torch.Tensor, int], tuple[torch.Tensor, ...]]
"""`CpuKernels.row_logprobs`: (float32 logits [rows, vocab], targets [rows], k) -> (logprobs, ranks, top
logprobs [rows, k], top ids [rows, k])."""

NativeProcessors = Callable[..., None]
"""`CpuKernels.logit_processors`: (float32 logits [rows, vocab] changed in place, (rows, ids, values) added,
penalized rows, their repetition, presence and frequency penalties, their prompt ids and output ids)."""


class Sampler:
    """Picks one token per row of a batch, each row under its own request's parameters.

    Logprobs are the model's RAW log-softmax of the logits (vLLM's default): taken
    before penalties, logit_bias, temperature and top-k/top-p/min-p.

    Sampled rows draw by inverse CDF, one uniform per row: the same distribution as
    the `argmax(probs / q)`, q ~ Exp(1), race, for one random number per row instead
    of one per vocabulary entry. A seeded request's draw is a function of its seed and
    output position alone, and each row's arithmetic involves that row alone, so it gets
    the same tokens whatever shares its batch. Unseeded rows share one batched draw
    from torch's default generator.

    On a GPU (`sync_free`, by default whenever the logits are not on the CPU) a step
    never waits for the device until its results come down, together, in one copy (the
    sampled ids and the requested logprobs): inputs go up from pinned memory without
    waiting, and what would need a look at device values takes the way that does not
    (a full-vocabulary sort for top-p without top-k, dense penalty counts, every rank
    counted over its whole row). On CPU looking is free, and the cheaper sparse ways
    are taken. Both give the same tokens and logprobs, except that top-p without
    top-k sums a row's mass in another order, so a token at the nucleus boundary
    may fall the other way (and exact ties may break differently).

    `native_rows` (on CPU, the native kernels' `sample_rows`) draws the sampled rows
    of a CPU step in one call, with the same arithmetic, the same uniforms and so the
    same tokens (but for a float rounding at a boundary: its exponential is its own;
    and for exact ties among top-k candidates, which bf16 logits hold often: torch's
    topk may order them otherwise, so another of the tied tokens, the same distribution),
    except that a top-p row without top-k whose nucleus outgrows the first
    TOP_P_CANDIDATES draws among it in column order, not best first: the same
    distribution, another token for a given uniform. `native_logprobs` (the kernels'
    `row_logprobs`) gives the logprob rows' entries as `prompt_logprobs` takes them.
    `native_processors` (the kernels' `logit_processors`) applies logit_bias, min_tokens
    and the penalties of a CPU step in one call, with the same float32 arithmetic.
    """

    def __init__(
        self,
        sync_free: Optional[bool] = None,
        native_rows: Optional[NativeRows] = None,
        native_logprobs: Optional[NativeLogprobs] = None,
        native_processors: Optional[NativeProcessors] = None,
    ):
        self.sync_free = sync_free  # None: decided by the logits' device
        self.native_rows = native_rows
        self.native_logprobs = native_logprobs
        self.native_processors = native_processors

    def __call__(
        self, logits: torch.Tensor, states: Sequence[SamplingState], token_bitmask: Optional[TokenBitmask] = None
    ) -> SamplerOutput:
        """logits: [num_rows, vocab] (any float dtype, not modified); row i belongs to states[i].
        `token_bitmask`: the tokens each constrained row may take (its grammar's), applied last."""
        num_rows, vocab = logits.shape
        if len(states) != num_rows:
            raise ValueError(f"{num_rows} rows of logits for {len(states)} sampling states")
        sync_free = self.sync_free if self.sync_free is not None else logits.device.type != "cpu"
        plan = _BatchPlan.build(states, vocab)
        x = logits
        private = plan.needs_processing or token_bitmask is not None
        on_cpu = not sync_free and logits.device.type == "cpu"  # where the native kernels may run
        if private:
            x = logits.to(torch.float32, memory_format=torch.contiguous_format, copy=True)  # [num_rows, vocab]
            if on_cpu and self.native_processors is not None:
                _apply_processors_native(x, states, plan, self.native_processors)
            else:
                _apply_processors(x, states, plan, sync_free)
            for row in plan.allowed_rows:
                x[row].masked_fill_(states[row].disallowed(vocab, x.device), -math.inf)
            if token_bitmask is not None:
                apply_token_bitmask(x, token_bitmask)
        native = self.native_rows if on_cpu else None
        chosen = _choose(x, states, plan, x_is_private=private, sync_free=sync_free, native=native)  # [num_rows]
        if not plan.logprob_rows:
            return SamplerOutput(to_host(chosen)[0].tolist(), None)
        rows, device = plan.logprob_rows, logits.device
        index = None if len(rows) == num_rows else _index(rows, device)
        rows_logits = logits if index is None else logits.index_select(0, index)
        num_top = plan.logprob_tops
        rows_chosen = chosen if index is None else chosen.index_select(0, index)
        if self.native_logprobs is not None and on_cpu:
            k = min(max(num_top, default=0), vocab)
            found = (rows_chosen, *self.native_logprobs(rows_logits.to(torch.float32).contiguous(), rows_chosen, k))
        else:
            raw = torch.log_softmax(rows_logits.float(), dim=-1)  # [rows, vocab]
            found = _logprob_tensors(raw, rows_chosen, num_top, sync_free)
        # the step's one wait for the device
        sampled, ids, id_logprobs, ranks, top_values, top_ids = to_host(chosen, *found)
        logprobs: list[Optional[TokenLogprobs]] = [None] * num_rows
        for row, entry in zip(rows, _logprob_entries(ids, id_logprobs, ranks, top_values, top_ids, num_top)):
            logprobs[row] = entry
        return SamplerOutput(sampled.tolist(), logprobs)


def prompt_logprobs(
    logits: torch.Tensor, target_token_ids: torch.Tensor, num_top: int, native: Optional[NativeLogprobs] = None
) -> list[TokenLogprobs]:
    """The raw logprob, rank and `num_top` best alternatives of each target token.

    logits: [n, vocab] at prompt positions; target_token_ids: [n], the prompt token
    that follows each position. Log-softmaxed in chunks to bound memory. `native` (on CPU,
    the kernels' `row_logprobs`) computes them row by row without the log-softmax tensor:
    the same entries, but for a rounding (its exponential is its own) and the order of
    exactly tied alternatives.
    """
    if num_top < 0:
        raise ValueError(f"num_top must be non-negative, got {num_top}")
    num_rows, vocab = logits.shape
    chunk = max(1, PROMPT_LOGPROBS_CHUNK // vocab)
    targets = target_token_ids.to(device=logits.device, dtype=torch.long)
    sync_free = logits.device.type != "cpu"
    result: list[TokenLogprobs] = []
    if native is not None and not sync_free:
        k = min(num_top, vocab)
        for start in range(0, num_rows, chunk):
            rows = logits[start : start + chunk].to(torch.float32).contiguous()
            lps, ranks, top_values, top_ids = native(rows, targets[start : start + chunk], k)
            tops = [k] * rows.shape[0]
            result += _logprob_entries(targets[start : start + chunk], lps, ranks, top_values, top_ids, tops)
        return result
    for start in range(0, num_rows, chunk):
        raw = torch.log_softmax(logits[start : start + chunk].float(), dim=-1)  # [chunk, vocab]
        tops = [num_top] * raw.shape[0]
        ids, id_logprobs, ranks, top_values, top_ids = to_host(
            *_logprob_tensors(raw, targets[start : start + chunk], tops, sync_free)
        )
        result += _logprob_entries(ids, id_logprobs, ranks, top_values, top_ids, tops)
    return result


# ---------------------------------------------------------------------- the plan of a step


@dataclass(slots=True)
class _BatchPlan:
    """What the rows of one step need, gathered in one pass over the states."""

    greedy_rows: list[int] = field(default_factory=list)
    full_rows: list[int] = field(default_factory=list)  # sampled over the whole vocabulary
    candidate_rows: list[int] = field(default_factory=list)  # sampled among top-k / top-p candidates
    logprob_rows: list[int] = field(default_factory=list)
    logprob_tops: list[int] = field(default_factory=list)  # the alternatives each logprob row wants
    penalty_rows: list[int] = field(default_factory=list)
    add_rows: list[int] = field(default_factory=list)  # (row, id, value) added to the logits:
    add_ids: list[int] = field(default_factory=list)  # logit_bias, and -inf for min_tokens and bad_words
    add_values: list[float] = field(default_factory=list)
    allowed_rows: list[int] = field(default_factory=list)  # rows with allowed_token_ids

    @property
    def needs_processing(self) -> bool:
        return bool(self.add_ids or self.penalty_rows or self.allowed_rows)

    @classmethod
    def build(cls, states: Sequence[SamplingState], vocab: int) -> "_BatchPlan":
        plan = cls()
        for row, state in enumerate(states):
            params = state.params
            if params.is_greedy:
                plan.greedy_rows.append(row)
            elif (params.top_k is not None and params.top_k < vocab) or params.top_p < 1.0:
                plan.candidate_rows.append(row)
            else:
                plan.full_rows.append(row)
            if params.logprobs is not None:  # needs_logprobs
                plan.logprob_rows.append(row)
                plan.logprob_tops.append(params.logprobs)
            if state.has_processors:
                plan._add_processors(row, state, vocab)
            if params.allowed_token_ids is not None:
                plan.allowed_rows.append(row)
        return plan

    def _add_processors(self, row: int, state: SamplingState, vocab: int) -> None:
        additions = [(i, -math.inf) for i in state.suppressed_ids] if state.suppresses_stops else []
        additions += [(i, -math.inf) for i in state.bad_word_ids]
        additions += (state.params.logit_bias or {}).items()
        for token_id, value in additions:
            if token_id < vocab:  # SamplingParams.verify_vocab refuses larger bias ids up front
                self.add_rows.append(row)
                self.add_ids.append(token_id)
                self.add_values.append(value)
        if state.params.needs_penalties:
            self.penalty_rows.append(row)


class _RowParams(NamedTuple):
    """Parameter columns of a group of sampled rows; None where no row of the group uses the feature."""

    temperature: Optional[torch.Tensor]  # [rows, 1]
    log_min_p: Optional[torch.Tensor]  # [rows, 1], -inf where min_p is 0
    top_k: Optional[torch.Tensor]  # [rows, 1], vocab where disabled
    top_p: Optional[torch.Tensor]  # [rows, 1]
    open_rows: list[int]  # rows without top-k: their support is the whole vocabulary
    max_top_k: int  # 0 when no row uses top-k

    @classmethod
    def build(cls, params: Sequence[SamplingParams], vocab: int, device: torch.device) -> "_RowParams":
        def column(values: list, dtype: torch.dtype = torch.float32) -> torch.Tensor:
            return to_device(values, dtype, device).unsqueeze(1)

        top_ks = _top_ks(params, vocab)
        use = [
            any(p.temperature != 1.0 for p in params),
            any(p.min_p > 0.0 for p in params),
            any(k < vocab for k in top_ks),
            any(p.top_p < 1.0 for p in params),
        ]
        return cls(
            column([p.temperature for p in params]) if use[0] else None,
            column(_log_min_ps(params)) if use[1] else None,
            column(top_ks, torch.long) if use[2] else None,
            column([p.top_p for p in params]) if use[3] else None,
            [i for i, k in enumerate(top_ks) if k >= vocab],
            max((k for k in top_ks if k < vocab), default=0),
        )


def _top_ks(params: Sequence[SamplingParams], vocab: int) -> list[int]:
    """Each row's top-k, `vocab` where it has none."""
    return [p.top_k if p.top_k is not None and p.top_k < vocab else vocab for p in params]


def _log_min_ps(params: Sequence[SamplingParams]) -> list[float]:
    """Each row's log(min_p), -inf where it has none."""
    return [math.log(p.min_p) if p.min_p > 0 else -math.inf for p in params]


# ---------------------------------------------------------------------- processors


def _apply_processors(x: torch.Tensor, states: Sequence[SamplingState], plan: _BatchPlan, sync_free: bool) -> None:
    """min_tokens, logit_bias and the penalties, in place on x [num_rows, vocab] (float32)."""
    device = x.device
    if plan.add_ids:
        rows, ids = _index(plan.add_rows, device), _index(plan.add_ids, device)
        x.index_put_((rows, ids), to_device(plan.add_values, torch.float32, device), accumulate=True)
    if plan.penalty_rows:
        penalize = _apply_penalties_dense if sync_free else _apply_penalties
        penalize(x, states, plan.penalty_rows)


def _apply_processors_native(
    x: torch.Tensor, states: Sequence[SamplingState], plan: _BatchPlan, native: NativeProcessors
) -> None:
    """`_apply_processors` on CPU in one native call: its additions, and per penalized row its penalties and
    the ids they look at (the prompt's only under a repetition penalty)."""
    if not (plan.add_ids or plan.penalty_rows):  # a token bitmask alone made x private
        return
    device = x.device
    params = [states[r].params for r in plan.penalty_rows]
    native(
        x,
        (plan.add_rows, plan.add_ids, plan.add_values),
        plan.penalty_rows,
        [p.repetition_penalty for p in params],
        [p.presence_penalty for p in params],
        [p.frequency_penalty for p in params],
        [
            states[r].unique_prompt_ids(device) if p.repetition_penalty != 1.0 else None
            for r, p in zip(plan.penalty_rows, params)
        ],
        [states[r].output_ids_tensor(device) for r in plan.penalty_rows],
    )


def _apply_penalties(x: torch.Tensor, states: Sequence[SamplingState], rows: list[int]) -> None:
    """Repetition (HF/vLLM: prompt and output tokens), then presence and frequency (OpenAI: output tokens).

    Touches only the (row, token) entries that occurred, never whole rows (counting them needs
    `torch.unique`, which waits for the device: see `_apply_penalties_dense`).
    """
    device, vocab = x.device, x.shape[1]
    flat_x = x.view(-1)  # [num_rows * vocab]
    params = {r: states[r].params for r in rows}
    rep_rows = [r for r in rows if params[r].repetition_penalty != 1.0]
    if rep_rows:
        ids = [states[r].unique_prompt_ids(device) for r in rep_rows]
        ids += [states[r].output_ids_tensor(device) for r in rep_rows]
        index = _flat_index(ids, rep_rows + rep_rows, vocab)  # [entries], repeats allowed
        penalty = _by_row(x, rep_rows, [[params[r].repetition_penalty for r in rep_rows]], 1.0)
        penalty = penalty[0, torch.div(index, vocab, rounding_mode="floor")]  # [entries]
        values = flat_x[index]
        # a repeated entry writes the same value each time
        flat_x[index] = torch.where(values > 0, values / penalty, values * penalty)
    count_rows = [r for r in rows if params[r].presence_penalty != 0.0 or params[r].frequency_penalty != 0.0]
    if count_rows:
        ids = [states[r].output_ids_tensor(device) for r in count_rows]
        index, counts = torch.unique(_flat_index(ids, count_rows, vocab), return_counts=True)  # [entries]
        columns = [[params[r].presence_penalty for r in count_rows], [params[r].frequency_penalty for r in count_rows]]
        by_row = _by_row(x, count_rows, columns, 0.0)  # [2, num_rows]
        presence, frequency = by_row[:, torch.div(index, vocab, rounding_mode="floor")]  # [entries] each
        flat_x.index_add_(0, index, -(frequency * counts + presence))


def _apply_penalties_dense(x: torch.Tensor, states: Sequence[SamplingState], rows: list[int]) -> None:
    """`_apply_penalties` without waiting for the device: occurrences counted into a [num_rows, vocab]
    table (an accumulating scatter), penalties applied over whole rows. The same arithmetic on the
    entries that occurred, and none on the others."""
    device, vocab = x.device, x.shape[1]
    params = {r: states[r].params for r in rows}
    rep_rows = [r for r in rows if params[r].repetition_penalty != 1.0]
    if rep_rows:
        ids = [states[r].unique_prompt_ids(device) for r in rep_rows]
        ids += [states[r].output_ids_tensor(device) for r in rep_rows]
        seen = torch.zeros(x.numel(), dtype=torch.bool, device=device)
        seen[_flat_index(ids, rep_rows + rep_rows, vocab)] = True
        penalty = _by_row(x, rep_rows, [[params[r].repetition_penalty for r in rep_rows]], 1.0).view(-1, 1)
        x.copy_(torch.where(seen.view_as(x), torch.where(x > 0, x / penalty, x * penalty), x))
    count_rows = [r for r in rows if params[r].presence_penalty != 0.0 or params[r].frequency_penalty != 0.0]
    if count_rows:
        index = _flat_index([states[r].output_ids_tensor(device) for r in count_rows], count_rows, vocab)
        counts = torch.zeros(x.numel(), dtype=torch.float32, device=device)
        counts.index_put_((index,), torch.ones(index.shape, dtype=torch.float32, device=device), accumulate=True)
        counts = counts.view_as(x)
        columns = [[params[r].presence_penalty for r in count_rows], [params[r].frequency_penalty for r in count_rows]]
        presence, frequency = _by_row(x, count_rows, columns, 0.0).unsqueeze(2)  # [num_rows, 1] each
        x.sub_(torch.where(counts > 0, frequency * counts + presence, 0.0))


def _by_row(x: torch.Tensor, rows: list[int], columns: list[list[float]], default: float) -> torch.Tensor:
    """Per-row values of some parameters, columns[j][i] for rows[i].  # [len(columns), num_rows]"""
    table = torch.full((len(columns), x.shape[0]), default, device=x.device)
    table[:, _index(rows, x.device)] = to_device(columns, torch.float32, x.device)
    return table


def _flat_index(token_ids: list[torch.Tensor], rows: list[int], vocab: int) -> torch.Tensor:
    """row * vocab + id for every id of every row (token_ids[i] belongs to rows[i]).  # [entries]

    The row offsets are a cumulative sum of jumps placed where each row's ids start.
    """
    ids = torch.cat(token_ids)
    starts, jumps, start, previous = [], [], 0, 0
    for row, t in zip(rows, token_ids):
        if t.numel():
            starts.append(start)
            jumps.append((row - previous) * vocab)
            previous = row
        start += t.numel()
    jump = torch.zeros_like(ids).index_add_(0, _index(starts, ids.device), _index(jumps, ids.device))
    return ids + jump.cumsum(0)


# ---------------------------------------------------------------------- choosing


def _argmax(x: torch.Tensor) -> torch.Tensor:
    """Each row's argmax (the first of equal maxima; a row with a NaN: its first NaN).  # [num_rows]

    On CPU numpy's: torch's CPU argmax over a vocabulary runs several times slower (docs/performance.md).
    """
    if x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2 and x.is_contiguous():
        if not torch.compiler.is_compiling():
            return torch.from_numpy(x.numpy().argmax(axis=-1))
    return x.argmax(dim=-1)


def _choose(
    x: torch.Tensor,
    states: Sequence[SamplingState],
    plan: _BatchPlan,
    x_is_private: bool,
    sync_free: bool,
    native: Optional[NativeRows] = None,
) -> torch.Tensor:
    """The token of every row.  # [num_rows]

    x: [num_rows, vocab], the caller's logits unless `x_is_private` (then it may be overwritten). `native`:
    the sampled rows drawn by that call (CPU).
    """
    if not (plan.full_rows or plan.candidate_rows):
        return _argmax(x)
    num_rows, device = x.shape[0], x.device
    token_ids = torch.empty(num_rows, dtype=torch.long, device=device)
    if plan.greedy_rows:
        index = _index(plan.greedy_rows, device)
        token_ids[index] = _argmax(x.index_select(0, index))
    if native is not None:
        return _choose_native(x, states, plan, native, token_ids)
    groups = ((plan.full_rows, _sample_full, True), (plan.candidate_rows, _sample_candidates, False))
    for rows, sample, overwrites in groups:
        if not rows:
            continue
        index = _index(rows, device)
        if len(rows) < num_rows:
            rows_x = x.index_select(0, index).float()  # a copy
        else:
            rows_x = x.to(torch.float32, copy=overwrites and not x_is_private)
        chosen = sample(rows_x, [states[r].params for r in rows], _uniforms(states, rows, device), sync_free)
        if len(rows) == num_rows:
            return chosen
        token_ids[index] = chosen
    return token_ids


def _choose_native(
    x: torch.Tensor, states: Sequence[SamplingState], plan: _BatchPlan, native: NativeRows, token_ids: torch.Tensor
) -> torch.Tensor:
    """The sampled rows' tokens into token_ids (its greedy rows' set) by one native call, each row with the
    uniform the torch way draws for it (the full rows' draw first, then the candidate rows')."""
    rows = plan.full_rows + plan.candidate_rows
    uniforms = [_uniforms(states, group, x.device) for group in (plan.full_rows, plan.candidate_rows) if group]
    order = sorted(range(len(rows)), key=rows.__getitem__)  # the rows in batch order, as x holds them
    rows = [rows[i] for i in order]
    u = torch.cat(uniforms)[order] if len(uniforms) > 1 else uniforms[0]
    num_rows, vocab = x.shape
    rows_x = x if len(rows) == num_rows else x.index_select(0, _index(rows, x.device))
    params = [states[r].params for r in rows]
    chosen = native(
        rows_x.to(torch.float32).contiguous(),
        [p.temperature for p in params],
        _log_min_ps(params),
        _top_ks(params, vocab),
        [p.top_p for p in params],
        u,
    )
    if len(rows) == num_rows:
        return chosen
    token_ids[_index(rows, x.device)] = chosen
    return token_ids


def _uniforms(states: Sequence[SamplingState], rows: list[int], device: torch.device) -> torch.Tensor:
    """One U[0, 1) per row: the request's own draw when seeded, else from one batched draw.  # [rows]"""
    seeded = [(i, states[r]) for i, r in enumerate(rows) if states[r].seed is not None]
    u = torch.rand(len(rows), device=device)
    if seeded:
        u[_index([i for i, _ in seeded], device)] = to_device(
            [state.seeded_uniform() for _, state in seeded], u.dtype, device
        )
    return u


def _sample_full(x: torch.Tensor, params: Sequence[SamplingParams], u: torch.Tensor, sync_free: bool) -> torch.Tensor:
    """Rows without top-k/top-p: temperature and min_p over the whole vocabulary, then a draw.

    x: [rows, vocab] float32, overwritten; u: [rows]. Returns token ids [rows].
    """
    rp = _RowParams.build(params, x.shape[1], x.device)
    z = x.sub_(x.amax(dim=-1, keepdim=True))  # [rows, vocab], row max at 0
    if rp.temperature is not None:
        z.div_(rp.temperature)
    if rp.log_min_p is not None:
        z.masked_fill_(z < rp.log_min_p, -math.inf)  # p < min_p * p_max
    return _draw(z.exp_(), u, sync_free)


def _sample_candidates(
    x: torch.Tensor,
    params: Sequence[SamplingParams],
    u: torch.Tensor,
    sync_free: bool,
    num_candidates: Optional[int] = None,
) -> torch.Tensor:
    """Rows with top-k and/or top-p: min_p, top-k, top-p and the draw among each row's best tokens.

    x: [rows, vocab] float32, not modified; u: [rows]. Returns token ids [rows].
    Everything a row's token depends on is a prefix sum over its own sorted
    candidates or a sum over its own row, never over `num_candidates` entries, so
    the token does not depend on the other rows. A row without top-k whose nucleus
    runs past the candidates is redone with 16x more, then with the whole vocabulary; `sync_free`
    (asking whether one did would wait for the device) takes the whole vocabulary at once.
    """
    vocab = x.shape[1]
    rp = _RowParams.build(params, vocab, x.device)
    if num_candidates is None:
        open_candidates = (vocab if sync_free else TOP_P_CANDIDATES) if rp.open_rows else 0
        num_candidates = max(rp.max_top_k, open_candidates)
    num_candidates = min(max(num_candidates, 1), vocab)
    values, indices = x.topk(num_candidates, dim=-1)  # [rows, K], best first
    z = values - values[:, :1]  # [rows, K]
    if rp.temperature is not None:
        z = z / rp.temperature
    weights = z.exp()  # [rows, K], unnormalised probabilities; what is kept is a prefix of each row
    if rp.top_k is not None:
        weights.masked_fill_(torch.arange(num_candidates, device=x.device) >= rp.top_k, 0.0)
    if rp.log_min_p is not None:
        weights.masked_fill_(z < rp.log_min_p, 0.0)
    if rp.top_p is None:
        return indices.gather(1, _draw(weights, u, sync_free).unsqueeze(1)).squeeze(1)

    cdf = weights.cumsum(dim=-1)  # [rows, K]
    mass = cdf[:, -1:].clone()  # [rows, 1], complete for rows with top-k
    if rp.open_rows and num_candidates < vocab:
        mass[_index(rp.open_rows, x.device)] = _open_mass(x, values, rp)
    weights.masked_fill_(cdf - weights >= rp.top_p * mass, 0.0)  # mass before the token reaches top_p
    token_ids = indices.gather(1, _draw(weights, u, sync_free).unsqueeze(1)).squeeze(1)  # [rows]
    if num_candidates == vocab or not rp.open_rows:
        return token_ids
    open_index = _index(rp.open_rows, x.device)
    reached = (cdf[:, -1:] >= rp.top_p * mass).squeeze(1)  # [rows]
    short = open_index[~reached[open_index]]  # open rows whose nucleus runs past the candidates
    if short.numel():
        more = num_candidates * 16 if num_candidates * 64 < vocab else vocab
        token_ids[short] = _sample_candidates(x[short], [params[i] for i in short.tolist()], u[short], sync_free, more)
    return token_ids


def _open_mass(x: torch.Tensor, values: torch.Tensor, rp: _RowParams) -> torch.Tensor:
    """The whole-row unnormalised probability mass of the rows without top-k.  # [open rows, 1]"""
    index = _index(rp.open_rows, x.device)
    z = x.index_select(0, index).sub_(values.index_select(0, index)[:, :1])  # [open rows, vocab]
    if rp.temperature is not None:
        z.div_(rp.temperature.index_select(0, index))
    if rp.log_min_p is not None:
        z.masked_fill_(z < rp.log_min_p.index_select(0, index), -math.inf)
    return z.exp_().sum(dim=-1, keepdim=True)


def _draw(weights: torch.Tensor, u: torch.Tensor, sync_free: bool) -> torch.Tensor:
    """Inverse-CDF draw of column i with probability weights[:, i] / row total.

    weights: [rows, n], non-negative; u: [rows] in [0, 1). Returns columns [rows]. A
    zero-weight column is never returned (a row without positive weight gets its argmax).
    """
    cdf = weights.cumsum(dim=-1)  # [rows, n]
    total = cdf[:, -1:]  # [rows, 1]
    target = torch.minimum(u.unsqueeze(1) * total, torch.nextafter(total, torch.zeros_like(total)))
    columns = torch.searchsorted(cdf, target, right=True).clamp_(max=weights.shape[1] - 1)  # [rows, 1]
    bad = ~(weights.gather(1, columns) > 0)
    # Sync-free: always take the fallback (asking whether it is needed would wait for the device); on CPU
    # asking is free and skips an argmax over the vocabulary.
    if sync_free or bool(bad.any()):
        columns = torch.where(bad, weights.argmax(dim=-1, keepdim=True), columns)
    return columns.squeeze(1)


# ---------------------------------------------------------------------- logprobs


def _logprob_tensors(
    raw: torch.Tensor, token_ids: torch.Tensor, num_top: list[int], sync_free: bool
) -> tuple[torch.Tensor, ...]:
    """raw: [n, vocab] log-softmax; token_ids: [n]; num_top: the alternatives wanted per row.
    Returns (token_ids [n], their logprobs [n], ranks [n], top logprobs [n, k], top ids [n, k]).

    A rank is 1 + the tokens strictly more likely. A token at least as likely as the k-th best
    takes it from the top k; only the others are counted over their whole row (sync-free: every
    row is counted over its whole row, since picking the others out would wait for the device).
    """
    k = min(max(max(num_top, default=0), 1), raw.shape[1])
    top_values, top_ids = raw.topk(k, dim=-1)  # [n, k], best first
    chosen = raw.gather(1, token_ids.unsqueeze(1))  # [n, 1]
    if sync_free:
        ranks = (raw > chosen).sum(dim=-1) + 1  # [n]
    else:
        ranks = (top_values > chosen).sum(dim=-1) + 1
        outside = (chosen.squeeze(1) < top_values[:, -1]).nonzero().squeeze(1)
        if outside.numel():
            ranks[outside] = (raw.index_select(0, outside) > chosen.index_select(0, outside)).sum(dim=-1) + 1
    return token_ids, chosen.squeeze(1), ranks, top_values, top_ids


def _logprob_entries(
    token_ids: torch.Tensor,
    chosen: torch.Tensor,
    ranks: torch.Tensor,
    top_values: torch.Tensor,
    top_ids: torch.Tensor,
    num_top: list[int],
) -> list[TokenLogprobs]:
    """`_logprob_tensors`' results (on the host) as one TokenLogprobs per row."""
    rows = zip(token_ids.tolist(), chosen.tolist(), ranks.tolist(), top_ids.tolist(), top_values.tolist(), num_top)
    return [TokenLogprobs(t, lp, rank, list(zip(ids[:n], vals[:n]))) for t, lp, rank, ids, vals, n in rows]


def _index(values: list[int], device: torch.device) -> torch.Tensor:
    return to_device(values, torch.long, device)
