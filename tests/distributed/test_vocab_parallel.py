"""The vocabulary split over two ranks (engine/layers/vocab_parallel.py): each rank holds its slice of the
embedding's and LM head's rows, padded when the vocabulary does not divide; served with --tensor-parallel-size 2
(real worker processes, logits gathered through shared memory), greedy tokens, their logprobs and the prompt's
logprobs are those of one process within 1e-5 in float32, with a vocabulary of 511 and with tied embeddings."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.distributed.parallel_group import ParallelGroup
from engine.layers.vocab_parallel import VocabParallel
from engine.kernels.column_block_weight import PackedWeight
from tests.engine.factories import make_tiny_model_dir
from tests.engine.references import assert_idle
from tests.engine.test_model_equivalence import mixed_prompts

pytestmark = pytest.mark.timeout(300)

TINY = dict(dtype="float32", device="cpu", block_size=4, max_num_batched_tokens=16, max_num_seqs=4)


def test_each_rank_takes_its_rows_and_the_last_is_padded_with_zeros():
    weight = torch.arange(511 * 3, dtype=torch.float32).view(511, 3)
    first, last = (VocabParallel(511, ParallelGroup(rank, 2)).shard(weight) for rank in range(2))
    assert first.shape == last.shape == (256, 3)
    assert torch.equal(first, weight[:256])
    assert torch.equal(last[:255], weight[256:]) and not last[255].any()
    with pytest.raises(ValueError, match="512 rows for a vocabulary of 511"):
        VocabParallel(511, ParallelGroup(0, 2)).shard(torch.zeros(512, 3))


@pytest.fixture(
    scope="module",
    params=[{}, {"vocab_size": 511}, {"tie_word_embeddings": True}],
    ids=["vocab512", "vocab511", "tied"],
)
def model_dir(request, tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("vocab"), "llama", **request.param), request.param


def _shape(matrix) -> tuple[int, ...]:
    """A vocabulary matrix's [rows, hidden], a tensor or packed in column blocks (float32 on AVX2 or AVX-512,
    bf16 on AVX512-BF16)."""
    return (matrix.out_features, matrix.in_features) if isinstance(matrix, PackedWeight) else tuple(matrix.shape)


def generate(model_dir, prompts, tp: int):
    """Greedy tokens with their logprobs, and the prompts' logprobs (their tokens' and the top one's), served by
    `tp` ranks; rank 0's vocabulary matrices' shapes."""
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=1, prompt_logprobs=1)
    with LLM(str(model_dir), **TINY, tensor_parallel_size=tp) as llm:
        model = llm.engine.runner.model
        shapes = (_shape(model.embed), _shape(model.lm_head))
        results = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert_idle(llm)
    outputs = []
    for result in results:
        completion = result.outputs[0]
        scored = [entry for entry in result.prompt_logprobs if entry is not None]  # (the first token has none)
        assert len(scored) == len(result.prompt_token_ids) - 1
        outputs.append(
            (
                completion.token_ids,
                [lp.logprob for lp in completion.logprobs],
                [(e.token_id, e.top[0][0]) for e in scored],
                [e.logprob for e in scored] + [e.top[0][1] for e in scored],
            )
        )
    return outputs, shapes


def test_two_ranks_generate_and_score_as_one_process(model_dir):
    path, overrides = model_dir
    vocab = overrides.get("vocab_size", 512)
    # prompts of 1 to 33 tokens (chunked prefill: a request's prompt rows over several steps), ids in the vocabulary
    prompts = [[token % vocab for token in prompt] for prompt in mixed_prompts(21)[:6]]
    expected, whole = generate(path, prompts, 1)
    got, shard = generate(path, prompts, 2)
    hidden = whole[0][1]
    assert whole == ((vocab, hidden), (vocab, hidden))
    assert shard == ((-(-vocab // 2), hidden), (-(-vocab // 2), hidden))  # rank 0 holds its half only
    for (tokens, logprobs, top, prompt_lps), (want_tokens, want_logprobs, want_top, want_prompt_lps) in zip(
        got, expected
    ):
        assert tokens == want_tokens
        assert logprobs == pytest.approx(want_logprobs, abs=1e-5)
        assert top == want_top
        assert prompt_lps == pytest.approx(want_prompt_lps, abs=1e-5)
