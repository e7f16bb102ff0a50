"""Two "hosts" on one machine: node 0 (an LLM here, rank 0) and node 1 (`pagedserve serve --headless`, rank 1)
meet at a TCP rendezvous on 127.0.0.1 and split the model (each rank half of every layer, or half of the layers);
the step messages reach node 1 over a gloo broadcast, a pipeline's hidden states over gloo sends.
Same greedy tokens and logprobs as one process; node 1 leaves with status 0 when node 0 shuts down."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from tests.conftest import server_environment
from tests.engine.references import assert_idle
from tests.engine.test_model_equivalence import mixed_prompts
from tests.ports import free_port

pytestmark = pytest.mark.timeout(180)

REPO = Path(__file__).resolve().parents[2]
SETTINGS = dict(
    dtype="float32", device="cpu", block_size=4, max_num_batched_tokens=16, max_num_seqs=4, max_model_len=128
)


def generate(llm: LLM, prompts):
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=0)
    results = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert_idle(llm)
    return [(r.outputs[0].token_ids, [lp.logprob for lp in r.outputs[0].logprobs]) for r in results]


@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2)], ids=["tensor", "pipeline"])
def test_two_nodes_give_one_process_tokens(tmp_path, tiny_model_dir, tp, pp):
    """Either a tensor-parallel pair or two pipeline stages, one rank on each "host"."""
    prompts = mixed_prompts(14)
    with LLM(str(tiny_model_dir), **SETTINGS) as llm:
        expected = generate(llm, prompts)
    port = free_port()
    flags = [f"--{key.replace('_', '-')}={value}" for key, value in SETTINGS.items()]
    log = tmp_path / "node1.txt"
    with log.open("w") as out:
        node1 = subprocess.Popen(
            [sys.executable, "-m", "server.cli", "serve", "--model", str(tiny_model_dir), *flags,
             "--tensor-parallel-size", str(tp), "--pipeline-parallel-size", str(pp),
             "--nnodes", "2", "--node-rank", "1", "--headless",
             "--master-port", str(port)],
            stdout=out, stderr=subprocess.STDOUT, env=server_environment(), cwd=REPO,
        )  # fmt: skip
    try:
        with LLM(
            str(tiny_model_dir),
            **SETTINGS,
            tensor_parallel_size=tp,
            pipeline_parallel_size=pp,
            nnodes=2,
            node_rank=0,
            master_port=port,
        ) as llm:
            got = generate(llm, prompts)
        assert node1.wait(timeout=30) == 0, log.read_text()[-3000:]
    finally:
        node1.kill()
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(got, expected):
        assert tokens == want_tokens
        assert logprobs == pytest.approx(want_logprobs, abs=1e-5)
    assert "node 1 of 2: ranks 1 .. 1" in log.read_text()
