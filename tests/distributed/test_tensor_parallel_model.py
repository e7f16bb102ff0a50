"""A Llama-family model split over two gloo ranks computes what the whole model computes: each rank's shard of
q|k|v, o_proj, gate|up and down (engine/models/tensor_parallel.py), its own KV heads in its own cache, partial
sums all-reduced, its slice of the vocabulary's rows (embedding and LM head, tied or not; a vocabulary of 511
padded to 2 x 256), logits gathered. Two real processes (forks of the workers' fork server), float32, a prefill and a decode step over a
paged cache."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.distributed.worker_processes import worker_context
from engine.attention.attention_shape import latent_rank_of
from engine.attention.kv_cache import KVCache, KVCacheSpec
from engine.attention.step_metadata import step_metadata_for
from engine.attention.torch_backend import TorchAttentionBackend
from engine.distributed.parallel_group import ParallelGroup
from engine.loading.loader import iter_weights, load_hf_config
from engine.models import build_model
from engine.models.registry import held_experts_of
from engine.models.tensor_parallel import shard_weights
from tests.engine.factories import make_tiny_model_dir
from tests.ports import free_port

BLOCK = 4
EXPERT_PARALLEL = "+ep"
"""A checkpoint's name in `two_rank_results` ending so runs with expert parallelism."""


def run_model(
    model_dir: Path, tp: ParallelGroup, shapes=None, rank: int = 0, expert_parallel: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of a 10-token prefill and of a decode after it, over a fresh paged cache; the shapes of the
    vocabulary's matrices into `shapes[("vocab", rank)]` when given. `expert_parallel`: each rank holds its share
    of the routed experts whole."""
    torch.manual_seed(0)
    hf_config = load_hf_config(model_dir)
    model = build_model(hf_config, torch.float32, torch.device("cpu"), tp=tp, expert_parallel=expert_parallel)
    weights = iter_weights(model_dir)
    if tp.is_parallel:
        full = build_model(hf_config, torch.float32, torch.device("cpu")).arch
        held = held_experts_of(hf_config, tp) if expert_parallel else None
        weights = shard_weights(weights, full, tp, held_experts=held)
    model.load_weights(weights)
    if shapes is not None:
        shapes[("vocab", rank)] = (tuple(model.embed.shape), tuple(model.lm_head.shape))
    arch = model.arch
    latent = latent_rank_of(hf_config)  # (DeepSeek's latent cache: the same entries on every rank)
    spec = KVCacheSpec(arch.num_layers, BLOCK, arch.num_kv_heads, arch.head_dim, torch.float32, latent_rank=latent)
    cache = KVCache(spec, 8, torch.device("cpu"))
    backend = TorchAttentionBackend()
    prompt = torch.arange(3, 13)
    prefill = step_metadata_for([(10, 10, [0, 1, 2])], torch.arange(10), 0, torch.device("cpu"))
    metadata = [backend.build_metadata(prefill, cache.spec)] * arch.num_layers
    hidden = model.forward(prompt, torch.arange(10), cache.layers, metadata, backend)
    first = model.compute_logits(hidden[-1:])
    decode = step_metadata_for([(11, 1, [0, 1, 2])], torch.tensor([10]), 1, torch.device("cpu"))
    metadata = [backend.build_metadata(decode, cache.spec)] * arch.num_layers
    hidden = model.forward(first.argmax(-1), torch.tensor([10]), cache.layers, metadata, backend)
    return first, model.compute_logits(hidden)


def _rank(rank: int, world: int, port: int, model_dirs: dict, results) -> None:
    tp = ParallelGroup.join(rank, world, f"tcp://127.0.0.1:{port}", torch.device("cpu"), 30)
    try:
        for name, model_dir in model_dirs.items():
            shapes: dict = {}
            expert_parallel = name.endswith(EXPERT_PARALLEL)
            results[(name, rank)] = run_model(Path(model_dir), tp, shapes, rank, expert_parallel)
            results[(name, "vocab", rank)] = shapes[("vocab", rank)]
    finally:
        # The group and its gloo threads end here, not in the interpreter's exit (see BINDS_THE_DEFAULT_GROUP):
        # loading each checkpoint's config imports modules that would have bound it.
        results[("left", rank)] = (tp.leave(), [t for t in native_thread_names() if "gloo" in t])


def native_thread_names() -> list[str]:
    """The names of this process's threads, native ones included (Linux)."""
    names = []
    for task in Path("/proc/self/task").iterdir():
        try:
            names.append((task / "comm").read_text().strip())
        except OSError:  # (a thread that ended meanwhile)
            pass
    return names


def two_rank_results(model_dirs: dict) -> dict:
    """Each checkpoint's `run_model` on both ranks of one pair of worker processes: by (name, rank),
    and its vocabulary's shapes by (name, "vocab", rank)."""
    ctx = worker_context()
    with ctx.Manager() as manager:
        shared = manager.dict()
        port = free_port()
        procs = [ctx.Process(target=_rank, args=(r, 2, port, model_dirs, shared)) for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(150)
        assert [p.exitcode for p in procs] == [0, 0]
        return dict(shared)


CHECKPOINTS = {
    "llama": ("llama", {}),
    "qwen2-kv1": ("qwen2", {"num_key_value_heads": 1}),
    "qwen3": ("qwen3", {}),
    "vocab511": ("llama", {"vocab_size": 511}),
    "vocab511-tied": ("llama", {"vocab_size": 511, "tie_word_embeddings": True}),
}


@pytest.mark.timeout(180)
def test_two_ranks_compute_the_whole_models_logits(tmp_path):
    """Every checkpoint in one pair of processes (starting them costs seconds)."""
    model_dirs = {name: str(make_tiny_model_dir(tmp_path / name, arch, **o)) for name, (arch, o) in CHECKPOINTS.items()}
    expected = {name: run_model(Path(d), ParallelGroup.single()) for name, d in model_dirs.items()}
    results = two_rank_results(model_dirs)
    assert results[("left", 0)] == results[("left", 1)] == (True, [])
    for name, want in expected.items():
        vocab, hidden = want[0].shape[1], load_hf_config(Path(model_dirs[name])).hidden_size
        for rank in range(2):
            for got, logits in zip(results[(name, rank)], want):
                torch.testing.assert_close(got, logits, atol=1e-5, rtol=1e-5, msg=f"{name}, rank {rank}")
            rows = -(-vocab // 2)  # each rank holds its half of the vocabulary's rows, the last one padded
            assert results[(name, "vocab", rank)] == ((rows, hidden), (rows, hidden))
