"""Prefix caching for the hybrid families: a hit restores a snapshot of the recurrent layers' states beside the
attention layers' cached blocks, and the tokens and logprobs stay transformers' (float32, tiny random checkpoints):
the same prompt again, a chat's next turn, a shared system prompt's third request (its junction kept by the second,
inside its prompt chunk), in prompt chunks, through preemptions (a resumed request restores its own end), with
n > 1, with fewer slots than prompts, and after aborts the pool is empty."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from engine import SamplingParams
from tests.engine.references import NEW_TOKENS, assert_idle, check_against_hf, make_llm
from tests.engine.test_hybrid import FAMILIES, LONG_PROMPT, family_dirs  # noqa: F401 (a fixture)
from tests.engine.test_model_equivalence import run_greedy

SYSTEM = LONG_PROMPT[60:130]
"""A shared system prompt (17 blocks of 4 and two tokens), sharing no block with the chat's."""


def chat_rounds(llm) -> tuple[list[list[int]], list]:
    """Prompts run one after another, each hitting what the earlier ones left: (the prompts, their results)."""
    prompts: list[list[int]] = []
    results: list = []

    def run(prompt: list[int]) -> list[int]:
        prompts.append(prompt)
        results.extend(run_greedy(llm, [prompt]))
        return list(results[-1].outputs[0].token_ids)

    first = LONG_PROMPT[:50]
    answer = run(first)
    run(first)  # the same prompt again: its last boundary (48)
    run(first + answer + [5, 6, 7, 8, 9])  # the next turn: the first's end
    run(SYSTEM + [11, 12, 13, 14, 15, 16, 17, 18, 19])  # kept at 76 (its last boundary): past the system prompt
    run(SYSTEM + [21, 22])  # blocks hit to 68, no state there: keeps the junction
    run(SYSTEM + [31, 32, 33, 34])  # restores the junction
    return prompts, results


@pytest.mark.parametrize("family", list(FAMILIES))
def test_hits_restore_the_recurrent_states(family_dirs, family):  # noqa: F811
    model_dir = family_dirs(family)
    with make_llm(model_dir) as llm:
        kv = llm.engine.scheduler.kv_cache_manager
        prompts, results = chat_rounds(llm)
        check_against_hf(model_dir, prompts, results)
        # the last boundary before the final token; the first turn's end (62 tokens, 61 computed); the junction
        assert [r.num_cached_tokens for r in results] == [0, 48, 60, 0, 0, 68]
        assert kv.snapshots is not None and kv.snapshots.num_restored == 3
        assert_idle(llm)


@pytest.mark.parametrize(
    "settings",
    [{"max_num_batched_tokens": 12, "max_num_seqs": 3}, {"state_snapshots": 1}, {"attention_backend": "torch"}],
    ids=["chunked-prefill", "one-slot", "torch"],
)
@pytest.mark.parametrize("family", ["granite-4.0-h", "lfm2", "qwen3_5"])
def test_hits_in_prompt_chunks_with_one_slot_and_through_the_torch_backend(family_dirs, family, settings):  # noqa: F811
    """In 12-token chunks the snapshots fall inside chunks and at their ends; with one slot each save evicts the
    last (fewer hits, the same tokens)."""
    model_dir = family_dirs(family)
    with make_llm(model_dir, **settings) as llm:
        prompts, results = chat_rounds(llm)
        check_against_hf(model_dir, prompts, results)
        cached = [r.num_cached_tokens for r in results]
        if "state_snapshots" in settings:
            # each request's ends evict its last boundary (and the fifth's its junction): only the turn's hit is left
            assert cached == [0, 0, 60, 0, 0, 0]
        else:
            assert cached == [0, 48, 60, 0, 0, 68]


@pytest.mark.parametrize("family", ["granite-4.0-h", "qwen3_5"])
def test_preempted_requests_resume_from_their_own_snapshots(family_dirs, family):  # noqa: F811
    """A pool too small for the batch preempts; a resumed request restores the end it kept (its blocks still
    cached) instead of recomputing from zero; n = 2 siblings wait for the first's prompt and restore it."""
    model_dir = family_dirs(family)
    prompts = [LONG_PROMPT[i : i + 40] for i in range(0, 80, 10)]
    with make_llm(model_dir, num_blocks=60, max_num_batched_tokens=32) as llm:
        kv = llm.engine.scheduler.kv_cache_manager
        results = run_greedy(llm, prompts)
        assert llm.engine.scheduler.num_preemptions > 0 and kv.snapshots is not None
        restored = kv.snapshots.num_restored
        assert restored > 0
        check_against_hf(model_dir, prompts, results)
        twin_prompt = [token + 1 for token in SYSTEM]  # (sharing no block with the prompts above)
        twins = llm.generate(
            [{"prompt_token_ids": twin_prompt}],
            SamplingParams(n=2, max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=0),
            use_tqdm=False,
        )[0]
        assert kv.snapshots.num_restored == restored + 1
        for sample in twins.outputs:
            check_against_hf(model_dir, [twin_prompt], [type("R", (), {"outputs": [sample]})])
        assert_idle(llm)


def test_aborted_requests_leave_their_kept_snapshots_and_an_empty_pool(family_dirs):  # noqa: F811
    """One request aborted mid-prompt (nothing kept yet: its one point lies ahead), one after its prompt (it kept the
    junction where the first's blocks end, 24, its last boundary, 68, and its end, 72): the pool is empty after
    both, and the prompt again restores what the second kept. (A save still in flight when its request is aborted
    is dropped: tests/scheduler/test_state_snapshots.py.)"""
    model_dir = family_dirs("qwen3_5")
    with make_llm(model_dir, max_num_batched_tokens=12, max_num_seqs=3) as llm:
        engine = llm.engine
        kv = engine.scheduler.kv_cache_manager
        assert kv.snapshots is not None
        for name, steps, kept in (("mid-prompt", 2, 0), ("decoding", 8, 3)):
            engine.add_request(name, SYSTEM, SamplingParams(max_tokens=5, temperature=0))
            for _ in range(steps):
                engine.step()
            engine.abort([name])
            engine.step()
            assert_idle(llm)
            assert kv.snapshots.num_indexed == kept
        results = run_greedy(llm, [SYSTEM])
        check_against_hf(model_dir, [SYSTEM], results)
        assert results[0].num_cached_tokens == 68


@pytest.mark.parametrize("family", ["granite-4.0-h", "qwen3_5"])
def test_interleaved_chats_in_a_tight_pool_are_hfs(family_dirs, family):  # noqa: F811
    """Five conversations at once, each turn sent when its previous answer ends (its prompt the conversation so
    far), in 12-token chunks and a pool that preempts: restores, saves inside chunks and at their ends, and
    preemptions interleave in the same steps; every answer is transformers', and the pool ends empty."""
    model_dir = family_dirs(family)
    greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=0)
    conversations = {f"chat{c}": LONG_PROMPT[10 * c : 10 * c + 9 + 6 * c] for c in range(5)}
    turns_left = {name: 3 for name in conversations}
    sent: dict[str, list[int]] = {}
    answers: dict[str, tuple[list[int], list]] = {}
    with make_llm(model_dir, max_num_batched_tokens=12, max_num_seqs=3, num_blocks=40, state_snapshots=16) as llm:
        engine = llm.engine

        def send(name: str) -> None:
            request_id = f"{name}-{3 - turns_left[name]}"
            sent[request_id] = list(conversations[name])
            answers[request_id] = ([], [])
            engine.add_request(request_id, sent[request_id], greedy)

        for name in conversations:
            send(name)
        while engine.has_unfinished_requests:
            for output in engine.step():
                tokens, logprobs = answers[output.request_id]
                tokens += output.new_token_ids
                logprobs += output.logprobs or []
                if output.finish_reason is None:
                    continue
                name = output.request_id.rsplit("-", 1)[0]
                turns_left[name] -= 1
                conversations[name] = conversations[name] + tokens + [40 + turns_left[name], 41]
                if turns_left[name]:
                    send(name)
        kv = engine.scheduler.kv_cache_manager
        assert kv.snapshots is not None and kv.snapshots.num_restored > 0 and engine.scheduler.num_preemptions > 0
        assert_idle(llm)
    results = [
        SimpleNamespace(outputs=[SimpleNamespace(token_ids=tokens, logprobs=logprobs)])
        for tokens, logprobs in answers.values()
    ]
    assert len(results) == 15
    check_against_hf(model_dir, list(sent.values()), results)
