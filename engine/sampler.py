"""Batched token sampling with per-request parameters.

For each row of the logits, in this order:

    raw logits ──► logprobs (raw log-softmax, reported as is)
        │
        ├─ min_tokens: eos (unless ignore_eos) and stop_token_ids -> -inf
        ├─ logit_bias (added)
        ├─ repetition penalty over prompt + output tokens
        ├─ presence / frequency penalties over output tokens
        ▼
    greedy rows: argmax
    sampled rows: temperature, min_p, top_k, top_p, then a draw
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple, Optional, Sequence

import torch

from engine.sampling_params import GREEDY_TEMPERATURE, SamplingParams

TOP_P_CANDIDATES = 128
"""Candidates first examined for a top-p row without top-k; 16x more, then a full sort, when too few."""

PROMPT_LOGPROBS_CHUNK = 1 << 24
"""Logit elements log-softmaxed at a time by `prompt_logprobs`."""

_SEED_MODULUS = 1 << 64


class TokenLogprobs(NamedTuple):
    """A token's raw logprob, its rank (1 + tokens strictly more likely) and the top alternatives, best first."""

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]]


@dataclass(frozen=True, slots=True)
class SamplerOutput:
    """One sampled token per row; logprobs per row (None where not asked; None overall if no row asked)."""

    sampled_token_ids: list[int]
    logprobs: Optional[list[Optional[TokenLogprobs]]]


@dataclass(slots=True)
class SamplingState:
    """What the sampler needs of one request, kept by the model runner for the request's lifetime.

    `output_token_ids` is the request's live list: the runner appends each sampled
    token. The state caches those ids (and the prompt's) as device tensors for the
    penalties, extending the cache only by the tokens appended since the last step.
    """

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    eos_token_ids: frozenset[int]
    generator: Optional[torch.Generator]
    suppressed_ids: tuple[int, ...] = field(default=(), init=False)
    has_processors: bool = field(default=False, init=False)
    _prompt_ids: Optional[torch.Tensor] = field(default=None, init=False, repr=False)
    _output_ids: Optional[torch.Tensor] = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        params = self.params
        suppressed = set(params.stop_token_ids)
        if not params.ignore_eos:
            suppressed |= self.eos_token_ids
        self.suppressed_ids = tuple(sorted(suppressed)) if params.min_tokens > 0 else ()
        self.has_processors = bool(self.suppressed_ids or params.logit_bias or params.needs_penalties)

    @classmethod
    def create(
        cls,
        params: SamplingParams,
        prompt_token_ids: Sequence[int],
        output_token_ids: Sequence[int],
        eos_token_ids: frozenset[int],
        device: torch.device,
    ) -> "SamplingState":
        """A state whose generator (when `params.seed` is set) lives on `device`, seeded with the seed."""
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=device)
            generator.manual_seed(params.seed % _SEED_MODULUS)
        return cls(params, prompt_token_ids, output_token_ids, frozenset(eos_token_ids), generator)

    @property
    def suppresses_stops(self) -> bool:
        """min_tokens not yet reached: eos and stop ids are masked this step."""
        return bool(self.suppressed_ids) and len(self.output_token_ids) < self.params.min_tokens

    def unique_prompt_ids(self, device: torch.device) -> torch.Tensor:
        """The distinct prompt ids on `device`, built once.  # [num_distinct_prompt_tokens]"""
        if self._prompt_ids is None or self._prompt_ids.device != device:
            ids = torch.tensor(list(self.prompt_token_ids), dtype=torch.long, device=device)
            self._prompt_ids = torch.unique(ids)
        return self._prompt_ids

    def output_ids_tensor(self, device: torch.device) -> torch.Tensor:
        """The output ids on `device`, extended by the tokens appended since the last call.  # [num_output_tokens]"""
        cached = self._output_ids
        num_tokens = len(self.output_token_ids)
        if cached is None or cached.device != device or cached.numel() > num_tokens:
            cached = torch.tensor(list(self.output_token_ids), dtype=torch.long, device=device)
        elif cached.numel() < num_tokens:
            new = list(self.output_token_ids[cached.numel():])
            cached = torch.cat((cached, torch.tensor(new, dtype=torch.long, device=device)))
        self._output_ids = cached
        return cached


class Sampler:
    """Picks one token per row of a batch, each row under its own request's parameters.

    Logprobs are the model's RAW log-softmax of the logits (vLLM's default), taken
    before penalties, logit_bias, temperature and top-k/top-p/min-p.

    Sampled rows draw by inverse CDF with one uniform per row (equivalent to the
    `argmax(probs / q)`, q ~ Exp(1), race, at 1 random number per row instead of
    one per vocabulary entry). A row whose request has a seed draws its uniform
    from its own generator, once per step, and every row is processed by itself,
    so a seeded request gives the same tokens whatever shares its batch. Unseeded
    rows share one batched draw from torch's default generator.
    """

    def __call__(self, logits: torch.Tensor, states: Sequence[SamplingState]) -> SamplerOutput:
        """`logits` [num_rows, vocab] (any float dtype); row i belongs to `states[i]`."""
        num_rows, vocab = logits.shape
        if len(states) != num_rows:
            raise ValueError(f"{num_rows} rows of logits for {len(states)} sampling states")
        plan = _BatchPlan.build(states, vocab)
        x = logits
        if plan.needs_processing:
            x = logits.to(torch.float32, copy=True)  # [num_rows, vocab]
            _apply_processors(x, states, plan)
        sampled = _choose(x, states, plan, x_is_private=plan.needs_processing).tolist()
        logprobs = None
        if plan.logprob_rows:
            logprobs = _sampled_logprobs(logits, sampled, states, plan.logprob_rows)
        return SamplerOutput(sampled, logprobs)


def prompt_logprobs(logits: torch.Tensor, target_token_ids: torch.Tensor, num_top: int) -> list[TokenLogprobs]:
    """Raw logprob, rank and `num_top` alternatives of each target under the model.

    logits: [n, vocab] at prompt positions; target_token_ids: [n], the prompt token
    that follows each position. Computed in chunks to bound memory.
    """
    if num_top < 0:
        raise ValueError(f"num_top must be non-negative, got {num_top}")
    num_rows, vocab = logits.shape
    chunk = max(1, PROMPT_LOGPROBS_CHUNK // vocab)
    targets = target_token_ids.to(device=logits.device, dtype=torch.long)
    result: list[TokenLogprobs] = []
    for start in range(0, num_rows, chunk):
        raw = torch.log_softmax(logits[start:start + chunk].float(), dim=-1)  # [chunk, vocab]
        result += _token_logprobs(raw, targets[start:start + chunk], [num_top] * raw.shape[0])
    return result


# ---------------------------------------------------------------------- batch plan


@dataclass(slots=True)
class _BatchPlan:
    """What the rows of one step need, gathered in a single pass over the states."""

    greedy_rows: list[int] = field(default_factory=list)
    full_rows: list[int] = field(default_factory=list)  # sampled over the whole vocabulary
    candidate_rows: list[int] = field(default_factory=list)  # sampled among top-k / top-p candidates
    logprob_rows: list[int] = field(default_factory=list)
    penalty_rows: list[int] = field(default_factory=list)
    suppress_rows: list[int] = field(default_factory=list)  # with suppress_ids: (row, id) pairs
    suppress_ids: list[int] = field(default_factory=list)
    bias_rows: list[int] = field(default_factory=list)  # with bias_ids, bias_values
    bias_ids: list[int] = field(default_factory=list)
    bias_values: list[float] = field(default_factory=list)

    @property
    def needs_processing(self) -> bool:
        return bool(self.suppress_ids or self.bias_ids or self.penalty_rows)

    @classmethod
    def build(cls, states: Sequence[SamplingState], vocab: int) -> "_BatchPlan":
        plan = cls()
        for row, state in enumerate(states):
            params = state.params
            if params.temperature < GREEDY_TEMPERATURE:
                plan.greedy_rows.append(row)
            elif (params.top_k is not None and params.top_k < vocab) or params.top_p < 1.0:
                plan.candidate_rows.append(row)
            else:
                plan.full_rows.append(row)
            if params.logprobs is not None:
                plan.logprob_rows.append(row)
            if state.has_processors:
                plan._add_processors(row, state, vocab)
        return plan

    def _add_processors(self, row: int, state: SamplingState, vocab: int) -> None:
        params = state.params
        if state.suppresses_stops:
            ids = [i for i in state.suppressed_ids if i < vocab]
            self.suppress_rows += [row] * len(ids)
            self.suppress_ids += ids
        if params.logit_bias:
            for token_id, bias in params.logit_bias.items():
                if token_id < vocab:  # SamplingParams.verify_vocab refuses these up front
                    self.bias_rows.append(row)
                    self.bias_ids.append(token_id)
                    self.bias_values.append(bias)
        if params.needs_penalties:
            self.penalty_rows.append(row)


class _RowParams(NamedTuple):
    """Per-row parameter tensors of a group of sampled rows; None where no row uses the feature."""

    temperature: Optional[torch.Tensor]  # [rows, 1]
    log_min_p: Optional[torch.Tensor]  # [rows, 1], -inf where min_p is 0
    top_k: Optional[torch.Tensor]  # [rows, 1], vocab where disabled
    top_p: Optional[torch.Tensor]  # [rows]
    open_rows: list[int]  # rows without top-k: their support is the whole vocabulary
    max_top_k: int  # the largest top-k in use, 0 when none

    @classmethod
    def build(cls, params: Sequence[SamplingParams], vocab: int, device: torch.device) -> "_RowParams":
        temps = [p.temperature for p in params]
        min_ps = [p.min_p for p in params]
        top_ks = [p.top_k if p.top_k is not None and p.top_k < vocab else vocab for p in params]
        top_ps = [p.top_p for p in params]

        def column(values: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=device).unsqueeze(1)

        return cls(
            temperature=column(temps, torch.float32) if any(t != 1.0 for t in temps) else None,
            log_min_p=column([math.log(m) if m > 0 else -math.inf for m in min_ps], torch.float32)
            if any(m > 0.0 for m in min_ps) else None,
            top_k=column(top_ks, torch.long) if any(k < vocab for k in top_ks) else None,
            top_p=column(top_ps, torch.float32).squeeze(1) if any(p < 1.0 for p in top_ps) else None,
            open_rows=[i for i, k in enumerate(top_ks) if k >= vocab],
            max_top_k=max((k for k in top_ks if k < vocab), default=0),
        )

    def select(self, rows: torch.Tensor, open_rows: list[int]) -> "_RowParams":
        def pick(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
            return None if t is None else t.index_select(0, rows)

        return _RowParams(
            pick(self.temperature), pick(self.log_min_p), pick(self.top_k), pick(self.top_p),
            open_rows, self.max_top_k,
        )


# ---------------------------------------------------------------------- processors


def _apply_processors(x: torch.Tensor, states: Sequence[SamplingState], plan: _BatchPlan) -> None:
    """min_tokens, logit_bias and penalties, in place on x [num_rows, vocab] (float32)."""
    device = x.device
    if plan.suppress_ids:
        rows = torch.tensor(plan.suppress_rows, device=device)
        ids = torch.tensor(plan.suppress_ids, device=device)
        x.index_put_((rows, ids), torch.tensor(-math.inf, device=device))
    if plan.bias_ids:
        rows = torch.tensor(plan.bias_rows, device=device)
        ids = torch.tensor(plan.bias_ids, device=device)
        values = torch.tensor(plan.bias_values, dtype=torch.float32, device=device)
        x.index_put_((rows, ids), values, accumulate=True)
    if plan.penalty_rows:
        _apply_penalties(x, states, plan.penalty_rows)


def _apply_penalties(x: torch.Tensor, states: Sequence[SamplingState], rows: list[int]) -> None:
    """Repetition (HF/vLLM: prompt + output tokens) then presence and frequency (OpenAI: output tokens).

    Touches only the (row, token) entries that occurred, never a whole row.
    """
    device, vocab = x.device, x.shape[1]
    flat_x = x.view(-1)  # [num_rows * vocab]
    rep_rows = [r for r in rows if states[r].params.repetition_penalty != 1.0]
    if rep_rows:
        ids = [states[r].unique_prompt_ids(device) for r in rep_rows]
        ids += [states[r].output_ids_tensor(device) for r in rep_rows]
        lengths = torch.tensor([t.numel() for t in ids], device=device)
        index = _flat_index(ids, rep_rows + rep_rows, lengths, vocab)  # [entries], repeats allowed
        penalty = torch.tensor([states[r].params.repetition_penalty for r in rep_rows] * 2, device=device)
        penalty = torch.repeat_interleave(penalty, lengths)  # [entries]
        values = flat_x[index]
        flat_x[index] = torch.where(values > 0, values / penalty, values * penalty)  # repeats write equal values
    count_rows = [
        r for r in rows if states[r].params.presence_penalty != 0.0 or states[r].params.frequency_penalty != 0.0
    ]
    if count_rows:
        ids = [states[r].output_ids_tensor(device) for r in count_rows]
        lengths = torch.tensor([t.numel() for t in ids], device=device)
        index, counts = torch.unique(_flat_index(ids, count_rows, lengths, vocab), return_counts=True)
        presence = torch.zeros(x.shape[0], device=device)  # [num_rows]
        frequency = torch.zeros(x.shape[0], device=device)
        presence[_index(count_rows, device)] = torch.tensor(
            [states[r].params.presence_penalty for r in count_rows], device=device
        )
        frequency[_index(count_rows, device)] = torch.tensor(
            [states[r].params.frequency_penalty for r in count_rows], device=device
        )
        row = torch.div(index, vocab, rounding_mode="floor")
        flat_x.index_add_(0, index, -(frequency[row] * counts + presence[row]))


def _flat_index(token_ids: list[torch.Tensor], rows: list[int], lengths: torch.Tensor, vocab: int) -> torch.Tensor:
    """row * vocab + token id for every id of every row (token_ids[i] belongs to rows[i]).  # [entries]"""
    row_of = torch.repeat_interleave(torch.tensor(rows, dtype=torch.long, device=lengths.device), lengths)
    return row_of * vocab + torch.cat(token_ids)


# ---------------------------------------------------------------------- choosing


def _choose(
    x: torch.Tensor, states: Sequence[SamplingState], plan: _BatchPlan, x_is_private: bool
) -> torch.Tensor:
    """The token id of every row.  # [num_rows]

    x [num_rows, vocab] is the caller's logits unless `x_is_private` (then it may be overwritten).
    """
    if not (plan.full_rows or plan.candidate_rows):
        return x.argmax(dim=-1)
    num_rows, vocab = x.shape
    device = x.device
    token_ids = torch.empty(num_rows, dtype=torch.long, device=device)
    if plan.greedy_rows:
        index = _index(plan.greedy_rows, device)
        token_ids[index] = x.index_select(0, index).argmax(dim=-1)
    for rows, sample in ((plan.full_rows, _sample_full), (plan.candidate_rows, _sample_candidates)):
        if not rows:
            continue
        index = _index(rows, device)
        row_params = _RowParams.build([states[r].params for r in rows], vocab, device)
        if len(rows) < num_rows:
            rows_x = x.index_select(0, index).float()  # a copy
        else:
            rows_x = x.to(torch.float32, copy=not x_is_private)
        chosen = sample(rows_x, row_params, _uniforms(states, rows, device))
        if len(rows) == num_rows:
            return chosen
        token_ids[index] = chosen
    return token_ids


def _uniforms(states: Sequence[SamplingState], rows: list[int], device: torch.device) -> torch.Tensor:
    """One U[0, 1) per row: from the request's generator when seeded, else one batched draw.  # [rows]"""
    seeded = [(i, states[r].generator) for i, r in enumerate(rows) if states[r].generator is not None]
    u = torch.rand(len(rows), device=device) if len(seeded) < len(rows) else torch.empty(len(rows), device=device)
    if seeded:
        draws = [torch.rand(1, generator=g, device=g.device) for _, g in seeded]
        u[_index([i for i, _ in seeded], device)] = torch.cat(draws).to(device)
    return u


def _sample_full(x: torch.Tensor, rp: _RowParams, u: torch.Tensor) -> torch.Tensor:
    """Rows without top-k/top-p: temperature and min_p over the whole vocabulary, then a draw.

    x: [rows, vocab] float32, overwritten; u: [rows]. Returns token ids [rows].
    """
    z = x.sub_(x.amax(dim=-1, keepdim=True))  # [rows, vocab], row max at 0
    if rp.temperature is not None:
        z.div_(rp.temperature)
    if rp.log_min_p is not None:
        z.masked_fill_(z < rp.log_min_p, -math.inf)  # p < min_p * p_max
    return _draw(z.exp_(), u)


def _sample_candidates(
    x: torch.Tensor, rp: _RowParams, u: torch.Tensor, num_candidates: Optional[int] = None
) -> torch.Tensor:
    """Rows with top-k and/or top-p: the draw is among each row's best candidates.

    x: [rows, vocab] float32, not modified; u: [rows]. Returns token ids [rows]. Every quantity a
    row's token depends on is a prefix sum over its own sorted candidates (or a sum
    over its own row), so the result does not depend on `num_candidates` or on the
    other rows. Rows whose top-p nucleus is longer than the candidates are redone
    with 16x more, then with the whole (sorted) vocabulary.
    """
    num_rows, vocab = x.shape
    if num_candidates is None:
        num_candidates = max(rp.max_top_k, TOP_P_CANDIDATES if rp.open_rows else 0)
    num_candidates = min(max(num_candidates, 1), vocab)
    values, indices = x.topk(num_candidates, dim=-1)  # [rows, K], best first
    z = values - values[:, :1]  # [rows, K]
    if rp.temperature is not None:
        z = z / rp.temperature
    keep = torch.ones_like(z, dtype=torch.bool)  # [rows, K], a prefix of each row
    if rp.top_k is not None:
        keep &= torch.arange(num_candidates, device=x.device) < rp.top_k
    if rp.log_min_p is not None:
        keep &= z >= rp.log_min_p
    weights = z.exp().masked_fill_(~keep, 0.0)  # [rows, K], unnormalised probabilities
    if rp.top_p is None:
        return indices.gather(1, _draw(weights, u).unsqueeze(1)).squeeze(1)

    cdf = weights.cumsum(dim=-1)  # [rows, K]
    mass = cdf[:, -1].clone()  # [rows], the row's total (all within the candidates for top-k rows)
    if rp.open_rows:
        mass[_index(rp.open_rows, x.device)] = _open_mass(x, values, rp)
    weights.masked_fill_((cdf - weights) >= rp.top_p.unsqueeze(1) * mass.unsqueeze(1), 0.0)
    token_ids = indices.gather(1, _draw(weights, u).unsqueeze(1)).squeeze(1)  # [rows]
    if num_candidates == vocab or not rp.open_rows:
        return token_ids
    open_index = _index(rp.open_rows, x.device)
    short = open_index[cdf[open_index, -1] < (rp.top_p * mass)[open_index]]  # nucleus past the candidates
    if short.numel():
        more = num_candidates * 16 if num_candidates * 64 < vocab else vocab
        redo = _sample_candidates(
            x.index_select(0, short), rp.select(short, list(range(short.numel()))),
            u.index_select(0, short), more,
        )
        token_ids[short] = redo
    return token_ids


def _open_mass(x: torch.Tensor, values: torch.Tensor, rp: _RowParams) -> torch.Tensor:
    """Total unnormalised probability of rows without top-k, over their whole row.  # [open rows]"""
    index = _index(rp.open_rows, x.device)
    z = x.index_select(0, index).sub_(values.index_select(0, index)[:, :1])  # [open, vocab]
    if rp.temperature is not None:
        z.div_(rp.temperature.index_select(0, index))
    if rp.log_min_p is not None:
        z.masked_fill_(z < rp.log_min_p.index_select(0, index), -math.inf)
    return z.exp_().sum(dim=-1)


def _draw(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw: column i with probability weights[:, i] / row total.

    weights: [rows, n] non-negative; u: [rows] in [0, 1). Returns columns [rows]; a
    column of zero weight is never returned (a row with no positive weight gets its argmax).
    """
    cdf = weights.cumsum(dim=-1)  # [rows, n]
    total = cdf[:, -1:]  # [rows, 1]
    target = torch.minimum(u.unsqueeze(1) * total, torch.nextafter(total, torch.zeros_like(total)))
    columns = torch.searchsorted(cdf, target, right=True).clamp_(max=weights.shape[1] - 1)  # [rows, 1]
    bad = ~(weights.gather(1, columns) > 0)
    if bool(bad.any()):
        columns = torch.where(bad, weights.argmax(dim=-1, keepdim=True), columns)
    return columns.squeeze(1)


# ---------------------------------------------------------------------- logprobs


def _sampled_logprobs(
    logits: torch.Tensor, sampled: list[int], states: Sequence[SamplingState], rows: list[int]
) -> list[Optional[TokenLogprobs]]:
    device = logits.device
    index = _index(rows, device)
    raw = torch.log_softmax(_take_rows(logits, rows, index).float(), dim=-1)  # [rows, vocab]
    token_ids = torch.tensor([sampled[r] for r in rows], dtype=torch.long, device=device)
    entries = _token_logprobs(raw, token_ids, [states[r].params.logprobs for r in rows])
    result: list[Optional[TokenLogprobs]] = [None] * logits.shape[0]
    for row, entry in zip(rows, entries):
        result[row] = entry
    return result


def _token_logprobs(raw: torch.Tensor, token_ids: torch.Tensor, num_top: list[int]) -> list[TokenLogprobs]:
    """raw: [n, vocab] log-softmax; token_ids: [n]; num_top: alternatives wanted per row.

    A token at least as likely as the k-th best gets its rank from the top k; only
    the others count over their whole row.
    """
    k = min(max(max(num_top, default=0), 1), raw.shape[1])
    top_values, top_ids = raw.topk(k, dim=-1)  # [n, k], best first
    chosen = raw.gather(1, token_ids.unsqueeze(1))  # [n, 1]
    ranks = (top_values > chosen).sum(dim=-1) + 1  # [n]
    outside = (chosen.squeeze(1) < top_values[:, -1]).nonzero().squeeze(1)
    if outside.numel():
        ranks[outside] = (raw.index_select(0, outside) > chosen.index_select(0, outside)).sum(dim=-1) + 1
    return [
        TokenLogprobs(token_id, logprob, rank, list(zip(ids_row[:n], values_row[:n])))
        for token_id, logprob, rank, ids_row, values_row, n in zip(
            token_ids.tolist(), chosen.squeeze(1).tolist(), ranks.tolist(),
            top_ids.tolist(), top_values.tolist(), num_top,
        )
    ]


# ---------------------------------------------------------------------- helpers


def _index(rows: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.long, device=device)


def _take_rows(x: torch.Tensor, rows: list[int], index: torch.Tensor) -> torch.Tensor:
    """x itself when `rows` is every row (they are ascending), else a copy of those rows."""
    return x if len(rows) == x.shape[0] else x.index_select(0, index)
