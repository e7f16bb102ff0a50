"""--distributed-executor-backend ray on a real local Ray cluster of two nodes (one CPU each, so rank 0's bundle
takes the driver's node and rank 1's actor the other): greedy tokens and logprobs of one process; stop() leaves
no actor process, no placement group and no reserved resource behind; an actor killed with ray.kill fails the
engine within seconds with an error naming its rank, and so does losing its node; a cluster too small is
reported with what it lacks.

One cluster for the module (Ray's start-up costs seconds): no dashboard, small object stores. `ray` is a dev
dependency: without it this module fails to import (it is never skipped)."""

from __future__ import annotations

import logging
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import ray
from ray.cluster_utils import Cluster
from ray.util.placement_group import placement_group_table

from engine import LLM, SamplingParams
from engine.ray_workers import RayClusterError, RayRanks
from tests.engine.references import assert_idle
from tests.engine.test_model_equivalence import mixed_prompts

pytestmark = pytest.mark.timeout(120)

SETTINGS = dict(
    dtype="float32", device="cpu", block_size=4, max_num_batched_tokens=16, max_num_seqs=4, max_model_len=128
)
NODE = dict(num_cpus=1, object_store_memory=80 * 2**20)
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def cluster():
    """Two Ray nodes on this machine; this process is their driver (the engine reuses its connection)."""
    cluster = Cluster(initialize_head=True, head_node_args=dict(**NODE, include_dashboard=False))
    cluster.add_node(**NODE)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, logging_level=logging.WARNING)
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


def generate(llm: LLM, prompts):
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=0)
    results = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert_idle(llm)
    return [(r.outputs[0].token_ids, [lp.logprob for lp in r.outputs[0].logprobs]) for r in results]


def ray_ranks(llm: LLM) -> RayRanks:
    peers = llm.engine.runner.peers
    assert peers is not None
    ranks = peers.ranks
    assert isinstance(ranks, RayRanks)
    return ranks


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_two_ranks_on_two_nodes_give_one_process_tokens(cluster, tiny_model_dir):
    prompts = mixed_prompts(14)[:6]
    with LLM(str(tiny_model_dir), **SETTINGS) as llm:
        expected = generate(llm, prompts)
    driver_node = ray.get_runtime_context().get_node_id()
    with LLM(str(tiny_model_dir), **SETTINGS, tensor_parallel_size=2, distributed_executor_backend="ray") as llm:
        ranks = ray_ranks(llm)
        (node, pid), = ranks.nodes.values()  # fmt: skip
        bundles = placement_group_table(ranks.placement_group)["bundles_to_node_id"]
        assert bundles[0] == driver_node and bundles[1] == node != driver_node
        got = generate(llm, prompts)
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(got, expected):
        assert tokens == want_tokens
        assert logprobs == pytest.approx(want_logprobs, abs=1e-5)
    deadline = time.monotonic() + 10
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(pid), "the actor's process outlived stop()"
    assert placement_group_table(ranks.placement_group)["state"] == "REMOVED"
    while ray.available_resources().get("CPU", 0) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ray.available_resources().get("CPU", 0) == 2


def test_a_killed_actor_fails_the_engine_naming_its_rank(cluster, tiny_model_dir):
    with LLM(str(tiny_model_dir), **SETTINGS, tensor_parallel_size=2, distributed_executor_backend="ray") as llm:
        generate(llm, [[5, 6, 7, 8]])
        workers = llm.engine.runner.peers
        assert workers is not None
        ray.kill(ray_ranks(llm).actors[1])
        killed = time.monotonic()
        while workers.failure is None and time.monotonic() - killed < 10:
            time.sleep(0.05)
        assert time.monotonic() - killed < 5
        message = r"worker rank 1 \(pagedserve-tp1\) \(a Ray actor on node \w+\) died"
        assert re.search(message, str(workers.failure)), workers.failure
        with pytest.raises(RuntimeError, match=message):
            generate(llm, [[5, 6, 7, 9]])


def test_a_cluster_too_small_is_reported_with_what_it_lacks(cluster, tiny_model_dir):
    started = time.monotonic()
    lacks = r"cannot place 2 tensor-parallel ranks .* needs CPU 4 \(the cluster has 2\).* hold CPU 2 \(it has 1\)"
    with pytest.raises(RayClusterError, match=lacks):
        LLM(str(tiny_model_dir), **SETTINGS, tensor_parallel_size=2, distributed_executor_backend="ray",
            ray_cpus_per_rank=2, distributed_timeout=2)  # fmt: skip
    assert time.monotonic() - started < 10
    assert ray.util.placement_group_table() and all(
        group["state"] == "REMOVED" for group in ray.util.placement_group_table().values()
    )


def test_the_server_imports_no_ray():
    """Only the ray backend imports ray: the server's import time does not grow with it."""
    code = "import sys, server.app, server.cli, engine.builder; print('ray' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert result.stdout.strip() == "False", result.stderr[-2000:]


def test_losing_the_actors_node_fails_the_engine(cluster, tiny_model_dir):
    """The module's last use of the cluster: it takes the second node away as a crashed host goes (its raylet and
    processes SIGKILLed)."""
    with LLM(str(tiny_model_dir), **SETTINGS, tensor_parallel_size=2, distributed_executor_backend="ray") as llm:
        generate(llm, [[5, 6, 7, 8]])
        workers = llm.engine.runner.peers
        assert workers is not None
        (node,) = [node for node in cluster.worker_nodes if node.node_id == ray_ranks(llm).nodes[1][0]]
        cluster.remove_node(node, allow_graceful=False)
        lost = time.monotonic()
        while workers.failure is None and time.monotonic() - lost < 30:
            time.sleep(0.05)
        assert time.monotonic() - lost < 10  # measured: 2.5 s (the driver's connection to the actor breaks)
        assert re.search(r"worker rank 1 \(pagedserve-tp1\) \(a Ray actor on node \w+\) died", str(workers.failure))
