"""--pipeline-parallel-size over gloo on CPU: the layers split into stages in real worker processes, each stage's
hidden states sent to the next, the last stage's back to stage 0 (the engine's process), which samples; as many
steps in flight as stages. Greedy tokens identical to one process and logprobs within 1e-5 in float32 (a stage
computes exactly what one process computes for its layers), under chunked prefill, prefix caching, preemption,
prompt logprobs and aborts, alone and with tensor parallelism within each stage; a dead stage fails the engine.

Every family tensor parallelism serves beside Llama's (the generic decoder's, the mixtures of experts', DeepSeek's
and GPT-OSS's: per-layer RoPE, windows, sinks and layer kinds, dense layers between sparse ones, latent caches,
embedding scales and learned positions on stage 0, soft-caps, logit scales and LM-head biases with the head) splits
into two stages that compute one process's logits, every family in one pair of worker processes; served end to end, Gemma 3's
and GPT-OSS's sliding and full layers keep the whole model's KV groups on each stage, DeepSeek-V3 serves its
latent cache per stage, and Gemma serves a LoRA adapter
(its own embedding and LM head) over int8 weights."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch

from engine import LLM, LoRAMix, LoRARequest, SamplingParams
from engine.distributed.worker_processes import worker_context
from engine.attention.attention_shape import latent_rank_of
from engine.attention.kv_cache import KVCache, KVCacheSpec
from engine.attention.step_metadata import step_metadata_for
from engine.attention.torch_backend import TorchAttentionBackend
from engine.distributed.parallel_group import ParallelGroup
from engine.distributed.pipeline_link import PipelineLink
from engine.distributed.pipeline_stage import PipelineStage
from engine.distributed.shm_all_reduce import PeerGoneError
from engine.errors import SettingsConflictError
from engine.loading.loader import iter_weights, load_hf_config
from engine.models import build_model
from tests.distributed import test_tensor_parallel_families as tp_families
from tests.distributed.test_tensor_parallel_model import BLOCK, run_model
from tests.engine.factories import make_tiny_model_dir
from tests.engine.references import assert_idle
from tests.engine.test_deepseek_equivalence import make_deepseek_dir
from tests.engine.test_gpt_oss import make_gpt_oss_dir
from tests.engine.test_gpt_oss_mxfp4 import write_checkpoints
from tests.engine.test_model_equivalence import mixed_prompts
from tests.engine.test_moe_equivalence import FAMILIES as MOE_FAMILIES
from tests.engine.test_moe_equivalence import make_moe_dir
from tests.distributed.stepping import tokens_with_an_abort
from tests.lora.adapters import make_adapter
from tests.ports import free_port

pytestmark = pytest.mark.timeout(300)

TINY = dict(dtype="float32", device="cpu", block_size=4, max_num_batched_tokens=16, max_num_seqs=4)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """Four layers (two per stage), four query heads over two KV heads (two ranks per stage can split them)."""
    return make_tiny_model_dir(tmp_path_factory.mktemp("llama4"), "llama", num_hidden_layers=4)


def run(model_dir, prompts, params: SamplingParams, **settings):
    """Each prompt's tokens and logprobs, stepping the engine by hand; the most steps that were in flight."""
    with LLM(str(model_dir), **{**TINY, **settings}) as llm:
        engine = llm.engine
        for i, prompt in enumerate(prompts):
            engine.add_request(f"r{i}", prompt, params)
        tokens: dict[str, list[int]] = {}
        logprobs: dict[str, list[float]] = {}
        prompt_logprobs: dict[str, list] = {}
        most_in_flight = 0
        while engine.has_work:
            for out in engine.step():
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
                logprobs.setdefault(out.request_id, []).extend(lp.logprob for lp in out.logprobs or [])
                if out.prompt_logprobs is not None:
                    prompt_logprobs[out.request_id] = out.prompt_logprobs
            most_in_flight = max(most_in_flight, engine.steps_in_flight + 1)
        stats = engine.stats()
        assert_idle(llm)
    return tokens, logprobs, prompt_logprobs, stats, most_in_flight


def assert_same(got, expected, abs: float = 1e-5) -> None:
    tokens, logprobs = got[:2]
    assert tokens == expected[0]
    for request_id, values in logprobs.items():
        assert values == pytest.approx(expected[1][request_id], abs=abs)


GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=0)


def test_two_stages_with_chunked_prefill_and_preemption(model_dir):
    prompts = mixed_prompts(21)
    expected = run(model_dir, prompts, GREEDY, num_blocks=20)
    got = run(model_dir, prompts, GREEDY, num_blocks=20, pipeline_parallel_size=2)
    assert got[3].num_preemptions > 0
    assert got[4] == 2  # both stages had a step
    assert_same(got, expected)


def test_prefix_cache_hits(model_dir):
    prompts = mixed_prompts(22, shared_prefix=20)
    expected = run(model_dir, prompts, GREEDY, enable_prefix_caching=True)
    got = run(model_dir, prompts, GREEDY, enable_prefix_caching=True, pipeline_parallel_size=2)
    assert got[3].prefix_cache_hits >= 16
    assert_same(got, expected)


def test_tensor_parallel_within_each_of_two_stages_with_prompt_logprobs(model_dir):
    """Four ranks: stage 0 = ranks 0, 1 and stage 1 = ranks 2, 3, each stage's pair all-reducing between them;
    prompt logprobs make the last stage send every row back, not only the sampled ones."""
    prompts = mixed_prompts(23)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    expected = run(model_dir, prompts, params)
    got = run(model_dir, prompts, params, pipeline_parallel_size=2, tensor_parallel_size=2)
    assert_same(got, expected)
    assert got[2].keys() == expected[2].keys() == {f"r{i}" for i in range(len(prompts))}
    for request_id, scored in got[2].items():
        want = expected[2][request_id]
        assert len(scored) == len(want)
        for entry, want_entry in zip(scored[1:], want[1:]):
            assert entry.token_id == want_entry.token_id
            assert entry.logprob == pytest.approx(want_entry.logprob, abs=1e-5)


def test_aborts_while_steps_are_in_flight(model_dir):
    """A request aborted while its step is in flight: its blocks go back at once (a later step that reuses them
    writes after it in every stage), its late tokens are dropped, the others finish as alone."""
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = mixed_prompts(24)[:4]
    outputs = {}
    for pp in (1, 2):
        with LLM(str(model_dir), **TINY, pipeline_parallel_size=pp) as llm:
            outputs[pp] = tokens_with_an_abort(llm, prompts, params, abort_at=6)
    aborted = outputs[2].pop("r1", [])
    assert len(aborted) < 12 and aborted == outputs[1]["r1"][: len(aborted)]
    outputs[1].pop("r1")
    assert outputs[2] == outputs[1]


def test_three_stages(tmp_path):
    """Six layers as 2 + 2 + 2. Two steps in flight put each request in a batch of its own where one process
    batches them together: batch-invariant products make a row's result independent of its batch, so the
    comparison sees the stages alone."""
    model = str(make_tiny_model_dir(tmp_path, "llama", num_hidden_layers=6))
    prompts = [[1, 54, 34, 28, 49, 31], [1, 198, 28, 94, 35, 46]]
    settings = dict(batch_invariant=True)
    expected = run(model, prompts, GREEDY, **settings)
    got = run(model, prompts, GREEDY, **settings, pipeline_parallel_size=3)
    assert got[4] == 2  # two requests: one step each in flight
    assert_same(got, expected)


def test_a_dead_stage_fails_the_engine_within_seconds(model_dir):
    """Stage 0 waits for the last stage's hidden states: a killed stage 1 ends that wait with an error (its
    connection closes), not after --distributed-timeout."""
    params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
    with LLM(str(model_dir), **TINY, max_model_len=256, pipeline_parallel_size=2) as llm:
        engine = llm.engine
        worker = engine.runner.peers.ranks.processes[0]
        engine.add_request("r0", [5, 6, 7, 8], params)
        engine.step()
        os.kill(worker.pid, signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(PeerGoneError, match="the stage on rank 1 is gone") as info:
            for _ in range(1000):
                engine.step()
        assert time.monotonic() - started < 10
        assert "gloo" not in str(info.value) and isinstance(info.value.__cause__, RuntimeError)


# ------------------------------------------------------------------ the other families


SLIDING_FULL = ["sliding_attention", "full_attention", "sliding_attention"]
ODD_SPLITS = {  # name: (factory arch, config overrides)
    "gemma3-3": ("gemma3", {"num_hidden_layers": 3, "layer_types": SLIDING_FULL}),  # local and global RoPEs
    "cohere2-3": ("cohere2", {"num_hidden_layers": 3}),  # full layers without RoPE
    "smollm3-3": ("smollm3", {"num_hidden_layers": 3, "no_rope_layers": [1, 0, 1], "layer_types": SLIDING_FULL}),
}
"""Three layers split 1 + 2, so that stage 1's layers are not the pattern's first ones (four layers split 2 + 2 would
put an alternating pattern's first two layers on each stage)."""


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    """Every generic-decoder family and mixture of experts that tensor parallelism's tests build, and ODD_SPLITS;
    DeepSeek-V2 (q_proj, or q_a_proj and q_b_proj) and V3 (grouped routing), three layers, the first dense; GPT-OSS
    (sliding, full, sliding) in float and in MXFP4 (experts 64 wide: two blocks per row)."""
    root = tmp_path_factory.mktemp("families")
    dense = {**tp_families.FAMILIES, **ODD_SPLITS}
    dirs = {name: make_tiny_model_dir(root / name, arch, **o) for name, (arch, o) in dense.items()}
    dirs.update({name: make_moe_dir(root / name, name) for name in MOE_FAMILIES})
    dirs["llama4-3"] = make_moe_dir(root / "llama4-3", "llama4", num_hidden_layers=3)  # NoPE layer 1, sparse 1
    dirs.update({name: make_deepseek_dir(root / name, f, **o) for name, (f, o) in tp_families.DEEPSEEK.items()})
    dirs["gpt_oss"] = make_gpt_oss_dir(root / "gpt_oss", intermediate_size=64)
    write_checkpoints(dirs["gpt_oss"], root / "gpt_oss-mxfp4", root / "gpt_oss-dequantized")
    dirs["gpt_oss-mxfp4"] = root / "gpt_oss-mxfp4"
    return dirs


def stage_logits(model_dir: Path, rank: int) -> dict:
    """`run_model`'s prefill and decode with the model split in two stages, this process being stage `rank`:
    stage 0 embeds and runs its layers, stage 1 takes its hidden states over the pipeline link, runs the other
    layers and sends the sampled row back, stage 0 computes the logits. Stage 0's: the two steps' logits; both:
    what the stage holds."""
    torch.manual_seed(0)
    cpu = torch.device("cpu")
    hf_config = load_hf_config(model_dir)
    model = build_model(hf_config, torch.float32, cpu)
    stage = PipelineStage.of_rank(rank, 1, 2, hf_config.num_hidden_layers)
    model.hold_stage(stage)
    model.load_weights(iter_weights(model_dir))
    arch = model.arch
    latent = latent_rank_of(hf_config)  # (DeepSeek's latent cache: its stage's layers of it)
    spec = KVCacheSpec(len(stage.layers), BLOCK, arch.num_kv_heads, arch.head_dim, torch.float32, latent_rank=latent)
    cache = KVCache(spec, 8, cpu)
    backend = TorchAttentionBackend()
    link = PipelineLink(stage, arch.hidden_size, torch.float32, cpu)

    def step(input_ids: torch.Tensor, positions: torch.Tensor, blocks) -> torch.Tensor:
        metadata = [backend.build_metadata(blocks, cache.spec)] * len(stage.layers)
        if stage.is_first:
            link.send_forward(model.forward(input_ids, positions, cache.layers, metadata, backend))
            return model.compute_logits(link.receive(1))
        arrived = link.receive(len(positions))  # (a later stage reads no token ids)
        link.send_forward(model.forward(input_ids, positions, cache.layers, metadata, backend, arrived)[-1:])
        return torch.empty(0)

    prefill = step_metadata_for([(10, 10, [0, 1, 2])], torch.arange(10), 0, cpu)
    first = step(torch.arange(3, 13), torch.arange(10), prefill)
    decode = step_metadata_for([(11, 1, [0, 1, 2])], torch.tensor([10]), 1, cpu)
    token = first.argmax(-1) if stage.is_first else torch.zeros(1, dtype=torch.int64)
    second = step(token, torch.tensor([10]), decode)
    link.flush()
    held = dict(
        layers=len(model.layers),
        ends=[model.embed is not None, model.lm_head is not None],
        moe_blocks=sorted(getattr(model, "moe_blocks", {})),
        windows=[attention.sliding_window for attention in model.attention_layers],
        sinks=[attention.sinks is not None and bool(attention.sinks.any()) for attention in model.attention_layers],
    )
    return dict(logits=(first, second), held=held) if stage.is_first else dict(held=held)


def _stage(rank: int, port: int, model_dirs: dict, results) -> None:
    group = ParallelGroup.join_stage(rank, 1, 2, f"tcp://127.0.0.1:{port}", torch.device("cpu"), 30)
    try:
        for name, model_dir in model_dirs.items():
            results[(name, rank)] = stage_logits(Path(model_dir), rank)
    finally:
        results[("left", rank)] = group.leave()


def two_stage_results(model_dirs: dict) -> dict:
    """Each checkpoint's `stage_logits` on both stages of one pair of worker processes."""
    ctx = worker_context()
    with ctx.Manager() as manager:
        shared = manager.dict()
        port = free_port()
        procs = [ctx.Process(target=_stage, args=(r, port, model_dirs, shared)) for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(150)
        assert [p.exitcode for p in procs] == [0, 0]
        return dict(shared)


@pytest.mark.timeout(180)
def test_two_stages_compute_every_familys_logits(family_dirs):
    expected = {name: run_model(model_dir, ParallelGroup.single()) for name, model_dir in family_dirs.items()}
    results = two_stage_results({name: str(d) for name, d in family_dirs.items()})
    assert results[("left", 0)] and results[("left", 1)]
    for name, want in expected.items():
        num_layers = load_hf_config(family_dirs[name]).num_hidden_layers
        first, last = (results[(name, rank)]["held"] for rank in range(2))
        assert first["layers"] + last["layers"] == num_layers and last["layers"] >= first["layers"] >= 1, name
        assert first["ends"] == [True, True] and last["ends"] == [False, False], name  # (tied or not)
        for got, logits in zip(results[(name, 0)]["logits"], want):
            torch.testing.assert_close(got, logits, atol=1e-5, rtol=1e-5, msg=name)
    # sparse layers keyed by each stage's own layer index: Qwen3-MoE's layer 1 dense (stage 1 = layers 1, 2);
    # GLM-4.5's first layer dense; Llama 4's experts on layers 1 and 3 (stages of layers 0, 1 and 2, 3)
    assert [results[("qwen3_moe", rank)]["held"]["moe_blocks"] for rank in range(2)] == [[0], [1]]
    assert [results[("glm4_moe", rank)]["held"]["moe_blocks"] for rank in range(2)] == [[], [0, 1]]
    assert [results[("llama4", rank)]["held"]["moe_blocks"] for rank in range(2)] == [[1], [1]]
    assert [results[("llama4-3", rank)]["held"]["moe_blocks"] for rank in range(2)] == [[], [0]]
    # DeepSeek's first layer dense (first_k_dense_replace 1), alone on stage 0
    for name in tp_families.DEEPSEEK:
        assert [results[(name, rank)]["held"]["moe_blocks"] for rank in range(2)] == [[], [0, 1]], name
    # GPT-OSS's sliding, full, sliding: each stage's windows and the checkpoint's sinks by its own layer index
    for name in ("gpt_oss", "gpt_oss-mxfp4"):
        first, last = (results[(name, rank)]["held"] for rank in range(2))
        assert (first["windows"], last["windows"]) == ([8], [None, 8]), name
        assert first["sinks"] + last["sinks"] == [True] * 3 and last["moe_blocks"] == [0, 1], name


def test_layer_groups_follow_the_stages(family_dirs):
    """Gemma 3's sliding layers 0 and 2 and full layer 1, split 1 + 2: the whole model's KV groups (full: 1;
    sliding: 0; sliding: 2, a layer each) on both stages, stage 0's cache holding layer 0 only (its other groups
    empty), under chunked prefill, preemption and prefix hits past the window."""
    prompts = mixed_prompts(25, shared_prefix=12)
    settings = dict(num_blocks=40, enable_prefix_caching=True)
    expected = run(family_dirs["gemma3-3"], prompts, GREEDY, **settings)
    got = run(family_dirs["gemma3-3"], prompts, GREEDY, **settings, pipeline_parallel_size=2)
    assert got[3].num_preemptions > 0 and got[3].prefix_cache_hits > 0
    assert_same(got, expected)


def test_gemma_lora_over_int8_weights(family_dirs, tmp_path):
    """An adapter with its own embedding and LM head (scaled by Gemma's sqrt(hidden) as the base's) on stage 0,
    its layers' deltas on each stage by the stage's own layer index, over int8 weights: one process's tokens."""
    base = family_dirs["gemma"]
    adapter = make_adapter(
        base, tmp_path / "saved", seed=3, r=2, targets=("v_proj", "o_proj"), modules_to_save=["embed_tokens", "lm_head"]
    )
    one, two = mixed_prompts(28)[:2]
    prompts = [one, one, two, two]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    settings = dict(TINY, quantization="int8", enable_lora=True, max_loras=1, max_lora_rank=4)
    outputs = []
    for pp in (1, 2):
        with LLM(str(base), **settings, pipeline_parallel_size=pp) as llm:
            llm.engine.lora_manager.add_lora(LoRARequest("saved", str(adapter)))
            loras = [LoRAMix.single("saved"), None] * 2
            results = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
            outputs.append([list(r.outputs[0].token_ids) for r in results])
            assert_idle(llm)
    assert outputs[1] == outputs[0]
    assert outputs[0][0] != outputs[0][1]  # the adapter changes what the model says


@pytest.mark.parametrize(
    "arch, settings, message",
    [
        ("llama", {"pipeline_parallel_size": 3}, "2 layers, fewer than the stages"),
        (
            "llama",
            {"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}},
            "speculative decoding",
        ),
    ],
)
def test_refusals_name_the_combination(tmp_path, arch, settings, message):
    model_dir = make_tiny_model_dir(tmp_path / arch, arch)
    with pytest.raises(SettingsConflictError, match=message):
        LLM(str(model_dir), **TINY, **{"pipeline_parallel_size": 2, **settings})


def test_deepseek_v3_on_two_stages(family_dirs):
    """Each stage's latent cache holds its layers' latents; stage 0 the dense first layer, stage 1 the sparse ones
    (grouped routing): one process's tokens and logprobs (tensor parallelism within stages: the Llama test above;
    DeepSeek's cut by heads and widths: test_tensor_parallel_families)."""
    prompts = mixed_prompts(30)[:3]
    expected = run(family_dirs["deepseek_v3"], prompts, GREEDY)
    got = run(family_dirs["deepseek_v3"], prompts, GREEDY, pipeline_parallel_size=2)
    assert_same(got, expected)


def test_gpt_oss_mxfp4_sliding_and_full_layers_on_two_stages(family_dirs):
    """GPT-OSS's sliding layers 0 and 2 and full layer 1 split 1 + 2: the whole model's KV groups on both stages
    (stage 0's cache holds layer 0 alone), prompts past the window of 8, under preemption and prefix hits; each
    stage dequantizes its own layers' MXFP4 experts."""
    prompts = mixed_prompts(31, shared_prefix=12)[:4]
    settings = dict(num_blocks=24, enable_prefix_caching=True)
    expected = run(family_dirs["gpt_oss-mxfp4"], prompts, GREEDY, **settings)
    got = run(family_dirs["gpt_oss-mxfp4"], prompts, GREEDY, **settings, pipeline_parallel_size=2)
    assert got[3].num_preemptions > 0 and got[3].prefix_cache_hits > 0
    assert_same(got, expected)


def test_deepseek_speculation_is_refused_with_stages(family_dirs):
    """DeepSeek-V3's own prediction layer (method mtp) drafts for the next step: refused with stages, as any
    speculation, before any process starts."""
    with pytest.raises(SettingsConflictError, match="speculative decoding"):
        LLM(
            str(family_dirs["deepseek_v3"]),
            **TINY,
            pipeline_parallel_size=2,
            speculative_config={"method": "mtp", "num_speculative_tokens": 1},
        )


def test_llama4_chunked_attention_on_two_stages(tmp_path):
    """Llama 4 whose RoPE layers attend within chunks of 16 positions, split in two stages: each stage cuts its
    steps at the chunks' boundaries for its own chunked layers; one process's tokens on sequences crossing several."""
    model = make_moe_dir(tmp_path / "llama4", "llama4", attention_chunk_size=16)
    prompts = mixed_prompts(29)[4:7]  # 17, 33 and 60 tokens
    expected = run(model, prompts, GREEDY)
    got = run(model, prompts, GREEDY, pipeline_parallel_size=2)
    assert_same(got, expected)
