"""The server's settings, composed from defaults, a YAML preset, `PAGEDSERVE_*` variables and flags.

    defaults  <  --config FILE.yaml  <  PAGEDSERVE_<FLAG>  <  --flag
                 (model/cache/scheduler/parallel/server/lora sections, top-level attention_backend, batch_invariant, enforce_eager, profile,
                 cpu_threads, speculative_config)

Every value remembers where it came from, so an error names the flag, the
environment variable or the YAML key that set it.

Why not pydantic-settings (tried, 2.16): its env source reaches a nested field only
as PAGEDSERVE_ENGINE__SCHEDULER__MAX_NUM_SEQS, or through aliases on the engine's
and scheduler's own models; it JSON-decodes lists (PAGEDSERVE_API_KEY=k1,k2 fails)
and knows no "none"; its YAML source skips a missing file silently and reads the
file as the root model, not as the preset's sections; its CLI source names flags
--engine.scheduler.max_num_seqs; and it validates the merged sources at once, so an
error cannot say which flag, variable or key set the value. Kept by custom sources,
it would merge three dicts, the few lines of `load_settings` below; a BaseSettings
would also read os.environ in its constructor.
"""

from __future__ import annotations

import argparse
import difflib
import json
import logging
import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Mapping, Optional, Sequence, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from engine.cache_config import parse_size
from engine.engine_config import EngineConfig
from engine.loading.model_config import DTYPE_ALIASES
from server.config.server_config import ServerConfig

logger = logging.getLogger(__name__)

ENV_PREFIX = "PAGEDSERVE_"
NOT_SETTINGS = frozenset(
    {
        "PAGEDSERVE_CACHE_DIR",  # read by the engine: where converted models and built kernels are kept
        # read by docker-compose (docker-compose*.yml, deploy/compose/)
        "PAGEDSERVE_IMAGE",
        "PAGEDSERVE_HOST_PORT",
        "PAGEDSERVE_MODELS_DIR",
        "PAGEDSERVE_GPU",
        "PAGEDSERVE_2_GPU",
        # read by scripts/container_test.sh
        "PAGEDSERVE_TEST_IMAGE",
        "PAGEDSERVE_CTR_DIR",
        "PAGEDSERVE_CTR_PORT",
    }
)
"""PAGEDSERVE_* variables that are not settings but are read elsewhere: no warning for them."""
FieldPath = tuple[str, ...]  # a field's place in Settings, e.g. ("engine", "scheduler", "max_num_seqs")

# YAML top level -> place in Settings; `tiny_model` belongs to the tests' model factory.
_YAML_SECTIONS: dict[str, FieldPath] = {
    "model": ("engine", "model"),
    "cache": ("engine", "cache"),
    "scheduler": ("engine", "scheduler"),
    "parallel": ("engine", "parallel"),
    "server": ("server",),
    "lora": ("engine", "lora"),
}
_YAML_SCALARS: dict[str, FieldPath] = {
    "attention_backend": ("engine", "attention_backend"),
    "batch_invariant": ("engine", "batch_invariant"),
    "enforce_eager": ("engine", "enforce_eager"),
    "profile": ("engine", "profile"),
    "cpu_threads": ("engine", "cpu_threads"),
    "speculative_config": ("engine", "speculative_config"),
}
_YAML_IGNORED = frozenset({"tiny_model"})
_SECRET_FIELDS = frozenset({("server", "api_keys")})
_TRUE = frozenset({"true", "1", "yes", "on"})
_FALSE = frozenset({"false", "0", "no", "off"})
_NONE = frozenset({"none", "null"})


class SettingsError(ValueError):
    """A bad setting; the message names its source (flag, environment variable or YAML key)."""


class Settings(BaseModel):
    """Everything `pagedserve serve` needs: the engine's configuration and the HTTP server's."""

    model_config = ConfigDict(extra="forbid")

    engine: EngineConfig = Field(default_factory=EngineConfig)
    server: ServerConfig = Field(default_factory=ServerConfig)


Kind = Literal["str", "int", "float", "bool", "size", "keys", "list", "names", "json", "lora_modules"]


@dataclass(frozen=True)
class Option:
    """One setting reachable by a flag and by the environment variable named after it."""

    flag: str
    path: Optional[FieldPath]  # None: --config, which names the preset rather than a field
    kind: Kind
    help: str
    metavar: Optional[str] = None
    default_text: Optional[str] = None  # what "default:" says when the field's default reads badly
    nullable: bool = False  # "none" resets to the default of None
    negates: bool = False  # a bool flag that sets its field to False (vLLM's --disable-*), no --no- form
    aliases: Optional[Mapping[str, str]] = None  # other names of its choices (vLLM's `--dtype half`)
    short: Optional[str] = None  # vLLM's short spelling of the flag (`-tp 2`)
    # vLLM's flag of something this server always does (no field): these values are taken and change nothing,
    # any other is refused naming the flag (() : any value, there being nothing it could change)
    always: Optional[tuple[Any, ...]] = None

    @property
    def dest(self) -> str:
        return self.flag[2:].replace("-", "_")

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.dest.upper()


# Where each section's fields live in Settings (an option's path is its section's plus the field name).
MODEL, CACHE, SCHEDULER, SERVER = ("engine", "model"), ("engine", "cache"), ("engine", "scheduler"), ("server",)
PARALLEL, LORA = ("engine", "parallel"), ("engine", "lora")
MODEL_TAG = "model_tag"  # the dest of the positional MODEL (`pagedserve serve ./model`, as `vllm serve` takes it)
RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"  # vLLM's switch of the load/unload endpoints, taken too

OPTIONS: tuple[Option, ...] = (
    Option(
        "--config",
        None,
        "str",
        "YAML preset with sections model/cache/scheduler/server (e.g. configs/default.yaml)",
        "FILE",
        "none",
    ),
    Option(
        "--model",
        (*MODEL, "model"),
        "str",
        "checkpoint directory, .gguf file or hub id",
        "MODEL",
        "the embedded SmolLM2-135M-Instruct",
    ),
    Option("--tokenizer", (*MODEL, "tokenizer"), "str", "tokenizer source", "TOKENIZER", "the model's"),
    Option(
        "--served-model-name",
        (*SERVER, "served_model_name"),
        "names",
        "model ids that clients may send (several after the flag, as vLLM's); the first is the one reported "
        "where a request names none, and in the metrics",
        "NAME",
        "the --model value",
    ),
    Option("--host", (*SERVER, "host"), "str", "address to bind", "HOST"),
    Option("--port", (*SERVER, "port"), "int", "TCP port; 0 = any free port", "PORT"),
    Option(
        "--api-key",
        (*SERVER, "api_keys"),
        "keys",
        "accepted bearer token; repeat the flag for several (the environment variable takes a comma-separated list)",
        "KEY",
        "none, no authentication",
    ),
    Option(
        "--dtype",
        (*MODEL, "dtype"),
        "str",
        "weight and activation dtype; auto = bfloat16 on CUDA and on CPUs with native bf16, else float32; "
        "vLLM's half and float are float16 and float32",
        aliases=DTYPE_ALIASES,
    ),
    Option("--device", (*MODEL, "device"), "str", "where the model runs"),
    Option(
        "--max-model-len",
        (*MODEL, "max_model_len"),
        "int",
        "prompt + output tokens at most",
        "N",
        "the model's context length",
        nullable=True,
    ),
    Option("--block-size", (*CACHE, "block_size"), "int", "tokens per KV cache block", "N"),
    Option(
        "--num-kv-blocks",
        (*CACHE, "num_blocks"),
        "int",
        "KV cache blocks (overrides --kv-cache-memory and --gpu-memory-utilization)",
        "N",
        "derived from the memory budget",
        nullable=True,
    ),
    Option(
        "--kv-cache-memory",
        (*CACHE, "kv_cache_memory"),
        "size",
        "KV cache budget on CPU, e.g. 1GiB, 512MiB, 2000000000",
        "SIZE",
        "1GiB on CPU",
        nullable=True,
    ),
    Option(
        "--kv-cache-dir",
        (*CACHE, "kv_cache_dir"),
        "str",
        "directory of the disk KV tier: full KV blocks are written through to it and restored instead of "
        "recomputed on a prefix-cache miss, also after a restart (files keyed by the model's identity)",
        "PATH",
        "none, no disk tier",
        nullable=True,
    ),
    Option(
        "--kv-cache-dir-size",
        (*CACHE, "kv_cache_dir_size"),
        "float",
        "GiB the --kv-cache-dir files may take; the least recently used blocks are deleted beyond it",
        "GIB",
    ),
    Option(
        "--swap-space",
        (*CACHE, "swap_space"),
        "float",
        "GiB of host memory (over all ranks) for the memory KV tier: blocks the prefix cache evicts are "
        "restored from it instead of computed, before the disk tier is asked (pinned on CUDA; on CPU a second "
        "bounded pool beside the cache)",
        "GIB",
    ),
    Option(
        "--kv-offloading-size",
        (*CACHE, "swap_space"),
        "float",
        "the same as --swap-space (vLLM's newer name)",
        "GIB",
    ),
    Option(
        "--num-gpu-blocks-override",
        (*CACHE, "num_blocks"),
        "int",
        "the same as --num-kv-blocks (vLLM's name)",
        "N",
        "derived from the memory budget",
        nullable=True,
    ),
    Option(
        "--kv-cache-memory-bytes",
        (*CACHE, "kv_cache_memory"),
        "size",
        "the same as --kv-cache-memory (vLLM's name)",
        "SIZE",
        "1GiB on CPU",
        nullable=True,
    ),
    Option(
        "--gpu-memory-utilization",
        (*CACHE, "gpu_memory_utilization"),
        "float",
        "fraction of GPU memory for weights, activations and KV cache",
        "F",
    ),
    Option("--max-num-seqs", (*SCHEDULER, "max_num_seqs"), "int", "requests in the running batch at most", "N"),
    Option(
        "--max-num-batched-tokens",
        (*SCHEDULER, "max_num_batched_tokens"),
        "int",
        "tokens computed per engine step at most",
        "N",
    ),
    Option(
        "--enable-prefix-caching",
        (*CACHE, "enable_prefix_caching"),
        "bool",
        "reuse the KV blocks of shared prompt prefixes",
    ),
    Option(
        "--state-snapshots",
        (*CACHE, "state_snapshots"),
        "int",
        "a hybrid model's snapshots of its recurrent layers' states at block boundaries, which its prefix-cache "
        "hits restore, from the KV cache budget; 0 = none (prefix caching off for such a model)",
        "N",
        "as many as --max-num-seqs",
        nullable=True,
    ),
    Option(
        "--mamba-cache-mode",
        (*CACHE, "mamba_cache_mode"),
        "str",
        "vLLM's: how a hybrid model's prefix-cache hits restore its recurrent states: align, from snapshots at "
        "block boundaries (--state-snapshots); none, no prefix caching for such a model",
    ),
    Option("--scheduling-policy", (*SCHEDULER, "policy"), "str", "order of admission to the running batch"),
    Option(
        "--long-prefill-token-threshold",
        (*SCHEDULER, "long_prefill_token_threshold"),
        "int",
        "prompt tokens one request computes per step at most (vLLM's): a long prompt goes in chunks this large, "
        "so prompts behind it share the step; 0 = only --max-num-batched-tokens",
        "N",
    ),
    Option(
        "--max-num-partial-prefills",
        None,
        "int",
        "vLLM's: taken at 1 (its V1 engine's value); prompts share a step through --long-prefill-token-threshold",
        "N",
        default_text="1",
        always=(1,),
    ),
    Option(
        "--max-long-partial-prefills",
        None,
        "int",
        "vLLM's: taken at 1 (its V1 engine's value)",
        "N",
        default_text="1",
        always=(1,),
    ),
    Option(
        "--tensor-parallel-size",
        (*PARALLEL, "tensor_parallel_size"),
        "int",
        "processes that each hold 1/N of every layer (every family, docs/models.md; all-reduce over shared "
        "memory on one CPU host, gloo across hosts, NCCL on CUDA)",
        "N",
        short="-tp",
    ),
    Option(
        "--pipeline-parallel-size",
        (*PARALLEL, "pipeline_parallel_size"),
        "int",
        "stages of consecutive layers, each in its own process(es), steps overlapped (every text family)",
        "N",
        short="-pp",
    ),
    Option(
        "--enable-expert-parallel",
        (*PARALLEL, "enable_expert_parallel"),
        "bool",
        "a mixture of experts' routed experts shared out whole among the tensor-parallel ranks (E/N each) "
        "instead of cut by width; attention and shared experts cut as without it",
        short="-ep",
    ),
    Option(
        "--distributed-executor-backend",
        (*PARALLEL, "distributed_executor_backend"),
        "str",
        "how tensor-parallel ranks 1..N-1 start: mp (processes here and on --headless nodes) or ray (actors on "
        "the Ray cluster at RAY_ADDRESS or the local `ray start`; pip install 'pagedserve[ray]')",
    ),
    Option(
        "--ray-cpus-per-rank",
        (*PARALLEL, "ray_cpus_per_rank"),
        "int",
        "with the ray backend: CPUs each rank's placement-group bundle reserves (its threads)",
        "N",
    ),
    Option("--nnodes", (*PARALLEL, "nnodes"), "int", "hosts the tensor-parallel ranks are spread over", "N"),
    Option("--node-rank", (*PARALLEL, "node_rank"), "int", "this host's place among them (0 serves the API)", "R"),
    Option("--master-addr", (*PARALLEL, "master_addr"), "str", "node 0's address for the ranks' rendezvous", "ADDR"),
    Option("--master-port", (*PARALLEL, "master_port"), "int", "node 0's port for the ranks' rendezvous", "PORT"),
    Option(
        "--headless",
        (*PARALLEL, "headless"),
        "bool",
        "run this node's tensor-parallel ranks without an API server (every node but node 0)",
    ),
    Option(
        "--distributed-timeout",
        (*PARALLEL, "distributed_timeout"),
        "float",
        "seconds a tensor-parallel rank waits for another before the engine fails instead of hanging",
        "SECONDS",
    ),
    Option(
        "--attention-backend",
        ("engine", "attention_backend"),
        "str",
        "attention kernels; auto picks from the device and what imports",
    ),
    Option(
        "--batch-invariant",
        ("engine", "batch_invariant"),
        "bool",
        "kernels whose per-request arithmetic does not depend on the batch: a request gives the same "
        "tokens and logprobs whatever runs beside it, in float32 and bfloat16 (CPU)",
    ),
    Option(
        "--cpu-threads",
        ("engine", "cpu_threads"),
        "int",
        "threads of the CPU operator pools (OpenMP), split among tensor-parallel ranks; logged at start-up with "
        "where the number came from",
        "N",
        "OMP_NUM_THREADS if set, else min(CPUs in the affinity mask, the cgroup CPU quota), at least 1",
        nullable=True,
    ),
    Option(
        "--enforce-eager",
        ("engine", "enforce_eager"),
        "bool",
        "never use CUDA graphs (by default decode steps on CUDA replay graphs captured at start-up)",
    ),
    Option(
        "--profile",
        ("engine", "profile"),
        "bool",
        "log where each engine step's time goes (schedule, prepare, forward, sample, update, detokenize, "
        "between steps), every 1000 steps",
    ),
    Option(
        "--speculative-config",
        ("engine", "speculative_config"),
        "json",
        'speculative decoding as vLLM spells it, a JSON object: {"method": "ngram", '
        '"num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}; a request opts '
        'out with "speculative": false',
        "JSON",
        "none, off",
        nullable=True,
    ),
    Option(
        "--quantization",
        (*MODEL, "quantization"),
        "str",
        "weight storage: gguf keeps a .gguf file's "
        "Q4_0/Q4_1/Q8_0 blocks quantized (native CPU kernels); int8 or int4 quantize a float checkpoint at "
        "load; awq loads an AWQ int4 checkpoint, gptq (or gptq_marlin) a GPTQ one; none loads float weights; "
        "auto = awq or gptq for such checkpoints, else none",
        short="-q",
    ),
    Option(
        "--quantization-group-size",
        (*MODEL, "quantization_group_size"),
        "int",
        "input columns per int4 scale and zero: 32, 64 or 128, with --quantization int4 (or, unchanged, an "
        "AWQ or GPTQ checkpoint's own); refused with --quantization none, gguf or int8, where no groups apply",
        "N",
        "32 with int4, the checkpoint's with awq or gptq",
        nullable=True,
    ),
    Option(
        "--kv-cache-dtype",
        (*CACHE, "kv_cache_dtype"),
        "str",
        "dtype the KV cache stores: auto = the model's "
        "dtype; bfloat16 halves an fp32 model's KV memory and attention reads; fp8 = fp8_e4m3 halves a bf16 "
        "model's (cpu, torch and triton backends); fp8_e5m2 too, with 2 mantissa bits (torch and triton)",
    ),
    Option("--seed", (*MODEL, "seed"), "int", "random seed of the engine", "N"),
    Option(
        "--strict-params",
        (*SERVER, "strict_params"),
        "bool",
        "also reject request fields that the OpenAI API does not define (by default they are ignored)",
    ),
    Option(
        "--stream-interval",
        (*SERVER, "stream_interval"),
        "int",
        "vLLM's flag: a streamed choice sends its first token at once, then a chunk every N new tokens (and its last)",
        "N",
        "1",
    ),
    Option(
        "--allowed-origins",
        (*SERVER, "allowed_origins"),
        "list",
        "CORS allowed origins, comma-separated (or repeat the flag, or vLLM's JSON list); each *, null or scheme://host[:port]",
        "ORIGINS",
    ),
    Option(
        "--allowed-methods",
        (*SERVER, "allowed_methods"),
        "list",
        "CORS allowed methods, comma-separated (or repeat the flag, or a JSON list)",
        "METHODS",
    ),
    Option(
        "--allowed-headers",
        (*SERVER, "allowed_headers"),
        "list",
        "CORS allowed request headers, comma-separated (or repeat the flag, or a JSON list)",
        "HEADERS",
    ),
    Option(
        "--allow-credentials",
        (*SERVER, "allow_credentials"),
        "bool",
        "CORS: browsers may send cookies and HTTP authentication",
    ),
    Option(
        "--enable-request-id-headers",
        (*SERVER, "enable_request_id_headers"),
        "bool",
        "each response carries X-Request-Id: the one the request sent, else a new one",
    ),
    Option(
        "--disable-fastapi-docs",
        (*SERVER, "disable_fastapi_docs"),
        "bool",
        "serve no /docs, /redoc or /openapi.json",
    ),
    Option(
        "--middleware",
        (*SERVER, "middleware"),
        "list",
        "an ASGI middleware by import path (the flag repeats): a class is added as middleware, an async function "
        "as @app.middleware('http'); checked before the model loads",
        "MODULE.NAME",
    ),
    Option(
        "--disable-access-log-for-endpoints",
        (*SERVER, "disable_access_log_for_endpoints"),
        "list",
        "paths whose requests get no access-log line, comma-separated (e.g. /health,/metrics)",
        "PATHS",
    ),
    Option(
        "--uds",
        (*SERVER, "uds"),
        "str",
        "listen on this Unix domain socket instead of --host/--port",
        "PATH",
        "none",
        nullable=True,
    ),
    Option(
        "--h11-max-incomplete-event-size",
        (*SERVER, "h11_max_incomplete_event_size"),
        "int",
        "bytes an HTTP request head may take before it is complete (uvicorn's h11 limit)",
        "BYTES",
        "h11's, 16KiB",
        nullable=True,
    ),
    Option(
        "--h11-max-header-count",
        (*SERVER, "h11_max_header_count"),
        "int",
        "headers a request may carry; more is a 431 (none: no limit)",
        "N",
        nullable=True,
    ),
    Option(
        "--log-config-file",
        (*SERVER, "log_config_file"),
        "str",
        "a JSON logging config (Python's logging.config.dictConfig) for pagedserve and uvicorn, in place of "
        "--log-level's",
        "FILE",
        "none",
        nullable=True,
    ),
    Option(
        "--log-error-stack",
        (*SERVER, "log_error_stack"),
        "bool",
        "log the traceback of every error response (500s are always logged with theirs)",
    ),
    Option(
        "--enable-server-load-tracking",
        None,
        "bool",
        "vLLM's: GET /load always reports the requests in flight here",
        default_text="on",
        always=(),
    ),
    Option(
        "--tool-parser-plugin",
        None,
        "str",
        "vLLM's: no parser plugins are loaded here (--tool-call-parser: hermes or llama3_json); only an empty "
        "value is taken",
        default_text="none",
        always=("",),
    ),
    Option("--log-level", (*SERVER, "log_level"), "str", "log level of pagedserve and uvicorn"),
    Option(
        "--tool-call-parser",
        (*SERVER, "tool_call_parser"),
        "str",
        "the tool-call format parsed from the text under tool_choice auto: hermes "
        "(<tool_call>{...}</tool_call>, Qwen and SmolLM templates) or llama3_json",
        "PARSER",
    ),
    Option(
        "--enable-auto-tool-choice",
        (*SERVER, "enable_auto_tool_choice"),
        "bool",
        "vLLM's switch of tool_choice auto, taken as written (vllm serve ... --enable-auto-tool-choice "
        "--tool-call-parser hermes): this server always serves it, its calls parsed with --tool-call-parser; "
        "--no-enable-auto-tool-choice is refused",
    ),
    Option(
        "--metrics-require-auth", (*SERVER, "metrics_require_auth"), "bool", "with --api-key, /metrics needs a key too"
    ),
    Option(
        "--reasoning-parser",
        (*SERVER, "reasoning_parser"),
        "str",
        "vLLM's: a reasoning model's thinking (<think>...</think>) returned apart from its answer, in chat's "
        "`reasoning` (deepseek_r1 or qwen3)",
        "PARSER",
        "none",
        nullable=True,
    ),
    Option(
        "--uvicorn-log-level",
        (*SERVER, "uvicorn_log_level"),
        "str",
        "vLLM's: the log level of uvicorn alone (none: --log-level's)",
        default_text="--log-level's",
        nullable=True,
    ),
    Option(
        "--disable-uvicorn-access-log",
        (*SERVER, "uvicorn_access_log"),
        "bool",
        "vLLM's: no access log line per HTTP request",
        default_text="not set",
        negates=True,
    ),
    Option(
        "--enable-chunked-prefill",
        None,
        "bool",
        "vLLM's: long prompts are always prefilled in chunks of --max-num-batched-tokens here",
        default_text="on",
        always=(True,),
    ),
    Option(
        "--tokenizer-mode",
        None,
        "str",
        "vLLM's: the tokenizer is always the checkpoint's fast (Rust) one; only auto is taken",
        default_text="auto",
        always=("auto",),
    ),
    Option(
        "--load-format",
        None,
        "str",
        "vLLM's: weights load from what the checkpoint holds (safetensors, or a GGUF file); "
        "auto, safetensors and gguf are taken",
        default_text="auto",
        always=("auto", "safetensors", "gguf"),
    ),
    Option(
        "--task",
        (*MODEL, "runner"),
        "str",
        "vLLM's older name of --runner: generate, or embed (embedding), classify or score for the pooling runner "
        "(which classifies with a ...ForSequenceClassification checkpoint, else embeds)",
        "auto|generate|embed|classify|score",
        "auto",
        aliases={"embed": "pooling", "embedding": "pooling", "classify": "pooling", "score": "pooling"},
    ),
    Option(
        "--guided-decoding-backend",
        None,
        "str",
        "vLLM's: structured output always runs on xgrammar; auto and xgrammar are taken",
        default_text="auto",
        always=("auto", "xgrammar"),
    ),
    Option(
        "--data-parallel-size",
        None,
        "int",
        "vLLM's: one engine serves here (scale out with replicas behind a load balancer); only 1 is taken",
        "N",
        default_text="1",
        always=(1,),
        short="-dp",
    ),
    Option(
        "--expert-placement-strategy",
        None,
        "str",
        "vLLM's: with --enable-expert-parallel each rank holds a contiguous run of experts here; only linear is taken",
        default_text="linear",
        always=("linear",),
    ),
    Option(
        "--enable-eplb",
        None,
        "bool",
        "vLLM's: experts are not rebalanced between ranks here (no redundant experts); only the default is taken",
        default_text="not set",
        always=(False,),
    ),
    Option(
        "--cpu-offload-gb",
        None,
        "float",
        "vLLM's: weights are never offloaded to CPU memory here; only 0 is taken",
        "GIB",
        default_text="0",
        always=(0.0,),
    ),
    Option(
        "--disable-log-stats",
        None,
        "bool",
        "vLLM's: no periodic statistics lines are logged here (/metrics has them)",
        default_text="set",
        always=(True,),
    ),
    Option(
        "--disable-sliding-window",
        None,
        "bool",
        "vLLM's: a model's sliding window is always kept here; only --no-disable-sliding-window is taken",
        default_text="not set",
        always=(False,),
    ),
    Option(
        "--calculate-kv-scales",
        None,
        "bool",
        "vLLM's: an fp8 KV cache stores values unscaled here (no scales to calculate); only the default is taken",
        default_text="not set",
        always=(False,),
    ),
    Option(
        "--model-impl",
        None,
        "str",
        "vLLM's: models run this server's own implementations; auto and vllm are taken",
        default_text="auto",
        always=("auto", "vllm"),
    ),
    Option(
        "--config-format",
        None,
        "str",
        "vLLM's: the model's config is read as an HF config.json (or from a GGUF file); auto and hf are taken",
        default_text="auto",
        always=("auto", "hf"),
    ),
    Option(
        "--max-parallel-loading-workers",
        None,
        "int",
        "vLLM's: taken, with nothing to change (each rank loads its own shard)",
        "N",
        default_text="none",
        always=(),
    ),
    Option(
        "--disable-custom-all-reduce",
        None,
        "bool",
        "vLLM's: taken, with nothing to change (CPU ranks all-reduce over shared memory, CUDA ones through NCCL)",
        default_text="not set",
        always=(),
    ),
    Option(
        "--max-log-len",
        None,
        "int",
        "vLLM's: taken, with nothing to shorten (prompts and outputs are never logged here)",
        default_text="none",
        always=(),
    ),
    Option(
        "--max-queued-requests",
        (*SERVER, "max_queued_requests"),
        "int",
        "sequences waiting for their first "
        "token at most (n > 1 counts n); beyond it a request gets 429 with Retry-After",
        "N",
        "4 x --max-num-seqs",
        nullable=True,
    ),
    Option(
        "--max-queued-tokens",
        (*SERVER, "max_queued_tokens"),
        "int",
        "prompt tokens of the waiting sequences at most (a request is always admitted into an empty queue)",
        "N",
        "the KV cache's capacity in tokens",
        nullable=True,
    ),
    Option(
        "--request-timeout",
        (*SERVER, "request_timeout"),
        "float",
        "seconds a request may wait and run; past it, it is aborted and its client gets a 504",
        "SECONDS",
        "none, no deadline",
        nullable=True,
    ),
    Option(
        "--shutdown-timeout",
        (*SERVER, "shutdown_timeout"),
        "float",
        "seconds in-flight requests get to finish after SIGTERM or SIGINT before they are aborted",
        "SECONDS",
    ),
    Option(
        "--max-request-body",
        (*SERVER, "max_request_body"),
        "size",
        "request body size at most, e.g. 4MiB (413 beyond, checked before the body is parsed)",
        "SIZE",
    ),
    Option(
        "--limit-mm-per-prompt",
        (*MODEL, "limit_mm_per_prompt"),
        "json",
        "a vision-language model's most images per prompt, as vLLM's JSON: '{\"image\": 4}' (default 999); "
        "0 serves it as a text model, its vision encoder not loaded",
        "JSON",
        "999 images",
    ),
    Option(
        "--allowed-local-media-path",
        (*MODEL, "allowed_local_media_path"),
        "str",
        "a folder whose files requests may name as images by file:// URLs (vLLM's flag; trusted clients only)",
        "DIR",
        "none: no file is read",
        nullable=True,
    ),
    Option(
        "--allowed-media-domains",
        (*SERVER, "allowed_media_domains"),
        "list",
        "the hosts whose http(s) image URLs the server fetches, comma-separated (vLLM's flag); default any host",
        "HOSTS",
        "any host",
        nullable=True,
    ),
    Option(
        "--media-fetch-timeout",
        (*SERVER, "media_fetch_timeout"),
        "float",
        "seconds an image URL's fetch may take, redirects included (vLLM's VLLM_IMAGE_FETCH_TIMEOUT); a request's "
        "fetched images together are bounded by --max-request-body",
        "SECONDS",
    ),
    # vLLM's flags where users reach for them
    Option(
        "--revision",
        (*MODEL, "revision"),
        "str",
        "branch, tag or commit of a hub --model",
        "REV",
        "main",
        nullable=True,
    ),
    Option(
        "--download-dir",
        (*MODEL, "download_dir"),
        "str",
        "where hub models are downloaded and looked up (a Hugging Face cache layout)",
        "DIR",
        "the Hugging Face cache",
        nullable=True,
    ),
    Option(
        "--trust-remote-code",
        (*MODEL, "trust_remote_code"),
        "bool",
        "let a checkpoint's own Python code build "
        "its config and tokenizer (the model always runs pagedserve's own implementation)",
    ),
    Option(
        "--hf-overrides",
        (*MODEL, "hf_overrides"),
        "json",
        "a JSON object of keys set on the model's HF config after it is read (vLLM's flag), e.g. "
        '\'{"rope_scaling": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 8192}}\' '
        "to serve twice the trained context",
        "JSON",
        "none",
        nullable=True,
    ),
    Option(
        "--generation-config",
        (*MODEL, "generation_config"),
        "str",
        "where requests' sampling defaults come from (vLLM's flag): auto = the model's generation_config.json "
        "(repetition_penalty, temperature, top_k, top_p, min_p; a request's own values win), vllm = none, else a "
        "directory holding a generation_config.json",
        "auto|vllm|DIR",
        "auto",
    ),
    Option(
        "--runner",
        (*MODEL, "runner"),
        "str",
        "vLLM's flag: generate (completions, chat, responses) or pooling (/v1/embeddings); auto: pooling for a "
        "checkpoint whose architecture is a base model without an LM head (LlamaModel, Qwen2Model, ...), else generate",
        "auto|generate|pooling",
        "auto",
    ),
    Option(
        "--convert",
        (*MODEL, "convert"),
        "str",
        "vLLM's flag: embed serves a generative checkpoint (Qwen3-Embedding's Qwen3ForCausalLM, ...) for "
        "embeddings, classify a checkpoint's score.weight classifier, as --runner pooling",
        "auto|none|embed|classify",
        "auto",
    ),
    Option(
        "--pooler-config",
        (*MODEL, "pooler_config"),
        "json",
        "a pooling model's pooler as a JSON object (vLLM's flag): pooling_type LAST, MEAN or CLS, normalize, "
        "dimensions; unset keys keep the checkpoint's Sentence Transformers files', else LAST and normalized",
        "JSON",
        "none",
        nullable=True,
    ),
    Option(
        "--override-pooler-config",
        (*MODEL, "pooler_config"),
        "json",
        "the same as --pooler-config (vLLM's older name)",
        "JSON",
        "none",
        nullable=True,
    ),
    Option(
        "--override-generation-config",
        (*MODEL, "override_generation_config"),
        "json",
        "a JSON object of sampling defaults set over --generation-config's (vLLM's flag), e.g. "
        """'{"temperature": 0.5}': repetition_penalty, temperature, top_k, top_p, min_p; a request's own win""",
        "JSON",
        "none",
        nullable=True,
    ),
    Option(
        "--tokenizer-revision",
        (*MODEL, "tokenizer_revision"),
        "str",
        "branch, tag or commit of a hub --tokenizer",
        "REV",
        "main",
        nullable=True,
    ),
    Option(
        "--chat-template",
        (*MODEL, "chat_template"),
        "str",
        "chat template replacing the tokenizer's: a file, or the Jinja text itself",
        "TEMPLATE",
        "the tokenizer's",
        nullable=True,
    ),
    Option(
        "--chat-template-content-format",
        (*SERVER, "chat_template_content_format"),
        "str",
        "how a message's content reaches the chat template: string (the text) or openai (a list of "
        '{"type": "text", "text": ...} parts, for templates that loop over content); auto reads it from the '
        "template",
    ),
    Option(
        "--default-chat-template-kwargs",
        (*SERVER, "default_chat_template_kwargs"),
        "json",
        "a JSON object of chat template variables every request gets (a request's chat_template_kwargs win), "
        """e.g. '{"enable_thinking": false}'""",
        "JSON",
        "none",
        nullable=True,
    ),
    Option(
        "--trust-request-chat-template",
        (*SERVER, "trust_request_chat_template"),
        "bool",
        "render a request's own chat_template (chat and /tokenize); without it such a request is a 400",
    ),
    Option(
        "--response-role",
        (*SERVER, "response_role"),
        "str",
        "the role of a chat answer when add_generation_prompt is true (else the last message's role)",
        "ROLE",
    ),
    Option(
        "--exclude-tools-when-tool-choice-none",
        None,
        "bool",
        "vLLM's: with tool_choice none the tools are never shown to the chat template here",
        default_text="on",
        always=(True,),
    ),
    Option(
        "--return-tokens-as-token-ids",
        (*SERVER, "return_tokens_as_token_ids"),
        "bool",
        "logprobs name each token 'token_id:<id>' (tokens that decode alike told apart) unless a request's "
        "return_tokens_as_token_ids says otherwise",
    ),
    Option(
        "--enable-force-include-usage",
        (*SERVER, "enable_force_include_usage"),
        "bool",
        "every stream ends with a usage chunk, as if its stream_options asked for it",
    ),
    Option(
        "--enable-prompt-tokens-details",
        None,
        "bool",
        "vLLM's: usage always holds prompt_tokens_details (cached_tokens) here",
        default_text="on",
        always=(True,),
    ),
    Option(
        "--max-logprobs",
        (*SERVER, "max_logprobs"),
        "int",
        "alternatives per token a request may ask for "
        "(logprobs, top_logprobs), 0-20; a request asking for more gets a 400",
        "N",
    ),
    Option(
        "--enable-log-requests",
        (*SERVER, "enable_log_requests"),
        "bool",
        "log each generation request at info (id, route, token counts, sampling settings; never its text)",
    ),
    Option(
        "--disable-log-requests",
        (*SERVER, "enable_log_requests"),
        "bool",
        "vLLM's older spelling of --no-enable-log-requests",
        default_text="not set",
        negates=True,
    ),
    Option(
        "--root-path",
        (*SERVER, "root_path"),
        "str",
        "path prefix under which a proxy serves the API, e.g. /llm (FastAPI's root_path)",
        "PATH",
        "none",
    ),
    Option(
        "--ssl-keyfile",
        (*SERVER, "ssl_keyfile"),
        "str",
        "TLS private key file (PEM); with --ssl-certfile the server speaks HTTPS",
        "FILE",
        "none",
        nullable=True,
    ),
    Option(
        "--ssl-certfile",
        (*SERVER, "ssl_certfile"),
        "str",
        "TLS certificate chain file (PEM)",
        "FILE",
        "none",
        nullable=True,
    ),
    Option(
        "--ssl-ca-certs",
        (*SERVER, "ssl_ca_certs"),
        "str",
        "CA certificates (PEM) client certificates are checked against (with --ssl-cert-reqs)",
        "FILE",
        "none",
        nullable=True,
    ),
    Option(
        "--ssl-cert-reqs",
        (*SERVER, "ssl_cert_reqs"),
        "int",
        "client certificates: 0 not asked for, 1 checked when sent, 2 required (mutual TLS)",
        "0|1|2",
    ),
    Option(
        "--ssl-ciphers",
        (*SERVER, "ssl_ciphers"),
        "str",
        "OpenSSL cipher list for TLS 1.2 and below",
        "CIPHERS",
        "OpenSSL's",
        nullable=True,
    ),
    Option(
        "--enable-ssl-refresh",
        (*SERVER, "enable_ssl_refresh"),
        "bool",
        "read the key, certificate and CA files again when they change (a renewed certificate), for new "
        "connections, without a restart",
    ),
    Option("--enable-lora", (*LORA, "enable_lora"), "bool", "serve LoRA adapters over the base model"),
    Option(
        "--lora-modules",
        (*LORA, "lora_modules"),
        "lora_modules",
        "adapters served from start (the first --max-cpu-loras loaded then), each NAME=PATH (a PEFT "
        "directory or a llama.cpp LoRA .gguf file) or a JSON object "
        '{"name": ..., "path": ..., "base_model_name": ...}; a request picks one by its model field '
        "(the environment variable takes them space-separated)",
        "NAME=PATH",
        "none",
    ),
    Option("--max-loras", (*LORA, "max_loras"), "int", "distinct adapters in one step's batch at most", "N"),
    Option("--max-lora-rank", (*LORA, "max_lora_rank"), "int", "largest adapter rank accepted", "N"),
    Option(
        "--max-cpu-loras",
        (*LORA, "max_cpu_loras"),
        "int",
        "adapters kept loaded at most (least recently used evicted, reloaded when asked for again)",
        "N",
        "--max-loras",
        nullable=True,
    ),
    Option(
        "--allow-runtime-lora-updating",
        (*LORA, "allow_runtime_lora_updating"),
        "bool",
        "serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (behind --api-key); "
        f"{RUNTIME_LORA_ENV}=true does too",
    ),
)


# ---------------------------------------------------------------------------- loading


def load_settings(argv: Sequence[str], environ: Mapping[str, str]) -> Settings:
    """Settings from `pagedserve serve` arguments and an environment, in that order of precedence.

    Raises SettingsError with a message naming the source of a bad value; `--help`
    prints the help and raises SystemExit(0), as argparse does.
    """
    args = vars(build_parser().parse_args(list(argv)))
    data: dict[str, Any] = {}
    origins: dict[FieldPath, str] = {}
    config_env = ENV_PREFIX + "CONFIG"
    config_source = "--config" if "config" in args else config_env
    config_path = args.get("config") or environ.get(config_env) or None
    if config_path:
        _apply_preset(data, origins, config_path, config_source)
    if environ.get(RUNTIME_LORA_ENV):  # below PAGEDSERVE_ALLOW_RUNTIME_LORA_UPDATING and the flag
        runtime_lora = next(option for option in OPTIONS if option.dest == "allow_runtime_lora_updating")
        value = _convert_env(runtime_lora, environ[RUNTIME_LORA_ENV], RUNTIME_LORA_ENV)
        _set(data, origins, (*LORA, runtime_lora.dest), value, RUNTIME_LORA_ENV)
    for option in OPTIONS:
        raw = environ.get(option.env)
        if option.always is not None and raw:
            _check_always(option, _convert_env(option, raw), option.env)
        if option.path is not None and raw:  # an empty variable counts as unset
            _set(data, origins, option.path, _negated(option, _convert_env(option, raw)), option.env)
    for option in OPTIONS:
        if option.always is not None and option.dest in args:
            _check_always(option, args[option.dest], option.flag)
        if option.path is not None and option.dest in args:
            _set(data, origins, option.path, _negated(option, args[option.dest]), option.flag)
    if MODEL_TAG in args:  # vLLM's `vllm serve MODEL`: the positional model, a flag's equal
        if "model" in args and args["model"] != args[MODEL_TAG]:
            raise SettingsError(
                f"the model is given twice, as {args[MODEL_TAG]!r} and as --model {args['model']!r}: give one"
            )
        _set(data, origins, (*MODEL, "model"), args[MODEL_TAG], "MODEL (the positional argument)")
    try:
        return Settings.model_validate(data)
    except ValidationError as error:
        raise SettingsError(_describe(error, origins)) from None


def warn_unknown_variables(environ: Mapping[str, str]) -> None:
    """A WARNING for each PAGEDSERVE_* variable that is neither a setting nor in NOT_SETTINGS, with the
    closest known name: a misspelled flag is an error, a misspelled variable would otherwise be silently
    ignored."""
    settings = {option.env for option in OPTIONS}
    for name in sorted(environ):
        if not name.startswith(ENV_PREFIX) or name in settings or name in NOT_SETTINGS:
            continue
        # compared without the prefix, which every name shares and which would make any two look alike
        known = sorted(known_name.removeprefix(ENV_PREFIX) for known_name in settings | NOT_SETTINGS)
        close = difflib.get_close_matches(name.removeprefix(ENV_PREFIX), known, n=1)
        hint = (
            f"did you mean {ENV_PREFIX}{close[0]}?"
            if close
            else "each flag --x-y is PAGEDSERVE_X_Y: pagedserve serve --help"
        )
        logger.warning("%s is not a pagedserve setting, ignored (%s)", name, hint)


def _check_always(option: Option, value: Any, source: str) -> None:
    """A vLLM flag of what this server always does: its value must be one that asks for that."""
    if option.always and value not in option.always:
        shown = "--no-" + option.flag[2:] if option.kind == "bool" and value is False else repr(value)
        why = option.help.removeprefix("vLLM's: ")
        raise SettingsError(f"{source}: {shown} is refused: {why}")


def _negated(option: Option, value: Any) -> Any:
    return not value if option.negates else value


def _set(data: dict, origins: dict[FieldPath, str], path: FieldPath, value: Any, source: str) -> None:
    node = data
    for key in path[:-1]:
        node = node.setdefault(key, {})
    node[path[-1]] = value
    origins[path] = source


def _apply_preset(data: dict, origins: dict[FieldPath, str], path: str, source: str) -> None:
    """Lay a YAML preset's sections onto `data`; unknown keys are errors (`tiny_model` excepted)."""
    try:
        preset = yaml.safe_load(Path(path).read_text())
    except OSError as error:
        raise SettingsError(f"{source}: cannot read {path!r}: {error.strerror or error}") from None
    except yaml.YAMLError as error:
        raise SettingsError(f"{path}: not valid YAML: {error}") from None
    if preset is None:
        return
    if not isinstance(preset, dict):
        raise SettingsError(f"{path}: the top level must be a mapping of sections, not {type(preset).__name__}")
    known = sorted([*_YAML_SECTIONS, *_YAML_SCALARS])
    for key, value in preset.items():
        if key in _YAML_IGNORED:
            continue
        if key in _YAML_SCALARS:
            _set(data, origins, _YAML_SCALARS[key], value, f"{path}: {key}")
        elif key in _YAML_SECTIONS:
            if value is None:
                continue
            if not isinstance(value, dict):
                raise SettingsError(f"{path}: {key}: must be a mapping of settings, not {type(value).__name__}")
            for name, item in value.items():
                _set(data, origins, (*_YAML_SECTIONS[key], str(name)), item, f"{path}: {key}.{name}")
        else:
            raise SettingsError(f"{path}: unknown key {key!r} (expected one of: {', '.join(known)})")


def _describe(error: ValidationError, origins: Mapping[FieldPath, str]) -> str:
    """One line per pydantic error, each led by the source of the value it is about."""
    lines = []
    for item in error.errors():
        loc = tuple(str(part) for part in item["loc"])
        source = _source_of(loc, origins)
        message = item["msg"].removeprefix("Value error, ")
        if item["type"] == "extra_forbidden":
            message = f"unknown key (expected one of: {', '.join(sorted(_model_at(loc[:-1]).model_fields))})"
        elif not any(loc[: len(secret)] == secret for secret in _SECRET_FIELDS) and _is_scalar(item.get("input")):
            message += f" (got {item['input']!r})"
        inside = next((loc[end:] for end in range(len(loc), 0, -1) if loc[:end] in origins), ())
        if inside:  # a key of a value given whole (a JSON object): missing, unknown or out of range
            message = f"{'.'.join(inside)}: {message}"
        lines.append(f"{source}: {message}")
    return "\n".join(lines)


def _source_of(loc: tuple[str, ...], origins: Mapping[FieldPath, str]) -> str:
    for end in range(len(loc), 0, -1):
        if loc[:end] in origins:
            return origins[loc[:end]]
    below = [origin for path, origin in origins.items() if path[: len(loc)] == loc]
    where = ".".join(loc[1:] if loc[:1] == ("engine",) else loc) or "settings"
    return f"{where} (set by {', '.join(below)})" if below else f"{where} (defaults)"


def _is_scalar(value: Any) -> bool:
    return isinstance(value, (str, int, float, bool)) or value is None


def _model_at(path: Sequence[str]) -> Any:
    """The config model at `path` in Settings (() is Settings itself)."""
    model: Any = Settings
    for key in path:
        model = model.model_fields[key].annotation
        if get_origin(model) is Union:  # an optional section (speculative_config): the model inside
            model = next(arg for arg in get_args(model) if arg is not type(None))
    return model


# ---------------------------------------------------------------------------- flags and variables


def build_parser(prog: str = "pagedserve serve") -> argparse.ArgumentParser:
    """The `serve` flags; every flag is also `PAGEDSERVE_<FLAG>`. Only flags given appear in the result."""
    parser = _Parser(
        prog=prog,
        description="Serve an OpenAI-compatible API (/v1/completions, /v1/chat/completions, /v1/responses, /metrics).",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        argument_default=argparse.SUPPRESS,
        allow_abbrev=False,
    )
    parser.add_argument(
        MODEL_TAG,
        nargs="?",
        metavar="MODEL",
        help="the model, as vLLM's `vllm serve MODEL` takes it: the same as --model (put it before flags that "
        "take several values, --served-model-name and --lora-modules)",
    )
    for option in OPTIONS:
        help_text = f"{option.help} (default: {_default_text(option)}; env: {option.env})".replace("%", "%%")
        kwargs: dict[str, Any] = {"help": help_text}
        choices = _choices(option)
        if option.negates:
            kwargs["action"] = "store_true"
        elif option.kind == "bool":
            kwargs["action"] = argparse.BooleanOptionalAction
        elif option.kind in ("keys", "list"):
            kwargs.update(action="extend", type=_flag_type(option), metavar=option.metavar)
        elif option.kind in ("lora_modules", "names"):  # vLLM's: several after one flag (or the flag repeated)
            kwargs.update(action="extend", nargs="+", type=_flag_type(option), metavar=option.metavar)
        else:
            metavar = option.metavar or ("{" + ",".join(choices) + "}" if choices else None)
            kwargs.update(type=_flag_type(option), metavar=metavar)
        parser.add_argument(*((option.flag, option.short) if option.short else (option.flag,)), **kwargs)
    return parser


_EPILOG = """\
Precedence: defaults < --config FILE.yaml < PAGEDSERVE_* environment variables < flags.
An empty environment variable counts as unset. Booleans in the environment: true/false/1/0/yes/no/on/off.
Another PAGEDSERVE_* variable gets a warning, unless read elsewhere (PAGEDSERVE_CACHE_DIR: the cache of
converted models and built kernels; the compose files' and scripts' own).
--max-model-len, --num-kv-blocks, --kv-cache-memory, --max-queued-requests, --max-queued-tokens,
--request-timeout, --revision, --download-dir, --chat-template, --max-cpu-loras and --ssl-* accept "none" (back to
the default). VLLM_ALLOW_RUNTIME_LORA_UPDATING counts as PAGEDSERVE_ALLOW_RUNTIME_LORA_UPDATING (which wins).
Examples:
  pagedserve serve --config configs/default.yaml
  pagedserve serve ./my-model --max-model-len 4096     (as vllm serve: the model first, or --model)
  PAGEDSERVE_API_KEY=secret pagedserve serve --model ./my-model --port 8080"""


class _Parser(argparse.ArgumentParser):
    """argparse that raises SettingsError instead of exiting on a bad flag."""

    def error(self, message: str):
        # a flag with a short spelling is named by its long one ("--quantization/-q: ..." reads as two flags)
        raise SettingsError(re.sub(r"^(--[\w-]+)/-\w+: ", r"\1: ", message.removeprefix("argument ")))


def _field(path: FieldPath):
    return _model_at(path[:-1]).model_fields[path[-1]]


def _choices(option: Option) -> Optional[tuple[str, ...]]:
    if option.path is None:
        return None if option.kind == "bool" or not option.always else tuple(option.always)
    annotation = _field(option.path).annotation
    return tuple(get_args(annotation)) if get_origin(annotation) is Literal else None


def _default_text(option: Option) -> str:
    if option.default_text is not None:
        return option.default_text
    assert option.path is not None, "an option without a field says its default_text"
    default = _field(option.path).get_default(call_default_factory=True)
    if option.kind == "bool":
        return "on" if default else "off"
    if isinstance(default, list):
        return ",".join(default) or "none"
    return "none" if default is None else str(default)


def _flag_type(option: Option):
    """argparse `type=` for an option: the environment's conversion, with argparse's error type."""

    def convert(raw: str) -> Any:
        try:
            return convert_value(option, raw)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None

    convert.__name__ = option.kind
    return convert


def _convert_env(option: Option, raw: str, variable: Optional[str] = None) -> Any:
    try:
        return convert_value(option, raw, from_env=True)
    except ValueError as error:
        raise SettingsError(f"{variable or option.env}: {error}") from None


def convert_value(option: Option, raw: str, *, from_env: bool = False) -> Any:
    """A flag's or an environment variable's string as the field's type; ValueError says why not.

    A flag value of a list option is one item (the flag repeats); an environment
    value is the whole list, comma-separated. Either may also be a JSON list of strings (vLLM's spelling).
    The result of a list option is a list.
    """
    text = raw.strip()
    if option.nullable and text.lower() in _NONE:
        return None
    if option.kind == "keys":
        return [key.strip() for key in raw.split(",") if key.strip()] if from_env else [raw]
    if option.kind == "list":
        if text.startswith("["):  # vLLM's spelling: a JSON list (`--allowed-origins '["https://a.example"]'`)
            try:
                items = json.loads(text)
            except json.JSONDecodeError:
                items = None
            if not isinstance(items, list) or not all(isinstance(item, str) for item in items):
                raise ValueError(f"not a JSON list of strings: {raw!r}")
            return [item.strip() for item in items if item.strip()]
        return [item.strip() for item in raw.split(",") if item.strip()]
    if option.kind == "names":  # a flag value is one name; a variable's value all of them, comma-separated
        return [name.strip() for name in raw.split(",") if name.strip()] if from_env else text
    if option.kind == "lora_modules":  # a flag value is one module; a variable's value all of them
        return [_lora_module(item) for item in shlex.split(raw)] if from_env else _lora_module(text)
    if option.kind == "bool":
        if text.lower() in _TRUE | _FALSE:
            return text.lower() in _TRUE
        raise ValueError(f"expected a boolean (true/false/1/0), got {raw!r}")
    if option.kind == "int":
        try:
            return int(text)
        except ValueError:
            raise ValueError(f"expected an integer, got {raw!r}") from None
    if option.kind == "float":
        try:
            return float(text)
        except ValueError:
            raise ValueError(f"expected a number, got {raw!r}") from None
    if option.kind == "size":
        return parse_size(text)
    if option.kind == "json":
        try:
            value = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"not valid JSON ({error.msg} at character {error.pos}): {raw!r}") from None
        if not isinstance(value, dict):
            raise ValueError(f"expected a JSON object, got {raw!r}")
        return value
    choices = _choices(option)
    text = (option.aliases or {}).get(text, text)
    if choices is not None and text not in choices:
        raise ValueError(f"expected one of {', '.join(choices)}, got {raw!r}")
    return text


def _lora_module(text: str) -> dict[str, Any]:
    """One --lora-modules item, NAME=PATH or vLLM's JSON object, as the LoRAModule fields."""
    if text.startswith("{"):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"not valid JSON ({error.msg} at character {error.pos}): {text!r}") from None
        if not isinstance(value, dict):
            raise ValueError(f"expected a JSON object, got {text!r}")
        return value
    name, equals, path = text.partition("=")
    if not equals or not name.strip() or not path.strip():
        raise ValueError(f"expected NAME=PATH or a JSON object, got {text!r}")
    return {"name": name.strip(), "path": path.strip()}
