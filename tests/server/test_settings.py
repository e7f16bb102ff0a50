"""Settings: defaults < YAML preset < PAGEDSERVE_* variables < flags, with errors that name their source."""

import logging
from pathlib import Path

import pytest
import yaml

from server.config.settings import OPTIONS, Settings, SettingsError, build_parser, load_settings

CONFIGS = Path(__file__).resolve().parents[2] / "configs"

# flag, value given, place in Settings, value expected there
FLAG_CASES = [
    ("--model", "/models/llama", ("engine", "model", "model"), "/models/llama"),
    ("--tokenizer", "/models/tok", ("engine", "model", "tokenizer"), "/models/tok"),
    ("--served-model-name", "my-model", ("server", "served_model_name"), ["my-model"]),
    ("--host", "0.0.0.0", ("server", "host"), "0.0.0.0"),
    ("--port", "9000", ("server", "port"), 9000),
    ("--api-key", "k1", ("server", "api_keys"), ["k1"]),
    ("--dtype", "bfloat16", ("engine", "model", "dtype"), "bfloat16"),
    ("--device", "cpu", ("engine", "model", "device"), "cpu"),
    ("--quantization", "gguf", ("engine", "model", "quantization"), "gguf"),
    (
        "--speculative-config",
        '{"num_speculative_tokens": 3}',
        ("engine", "speculative_config", "num_speculative_tokens"),
        3,
    ),
    ("--max-model-len", "512", ("engine", "model", "max_model_len"), 512),
    (
        "--hf-overrides",
        '{"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}',
        ("engine", "model", "hf_overrides"),
        {"rope_scaling": {"rope_type": "yarn", "factor": 2.0}},
    ),
    ("--runner", "pooling", ("engine", "model", "runner"), "pooling"),
    ("--task", "embed", ("engine", "model", "runner"), "pooling"),
    ("--task", "classify", ("engine", "model", "runner"), "pooling"),
    ("--convert", "embed", ("engine", "model", "convert"), "embed"),
    ("--pooler-config", '{"pooling_type": "MEAN"}', ("engine", "model", "pooler_config", "pooling_type"), "MEAN"),
    ("--override-pooler-config", '{"normalize": false}', ("engine", "model", "pooler_config", "normalize"), False),
    ("--block-size", "32", ("engine", "cache", "block_size"), 32),
    ("--stream-interval", "4", ("server", "stream_interval"), 4),
    ("--limit-mm-per-prompt", '{"image": 3}', ("engine", "model", "limit_mm_per_prompt"), {"image": 3}),
    ("--allowed-local-media-path", "media", ("engine", "model", "allowed_local_media_path"), "media"),
    ("--allowed-media-domains", "a.com,b.org", ("server", "allowed_media_domains"), ["a.com", "b.org"]),
    ("--media-fetch-timeout", "2.5", ("server", "media_fetch_timeout"), 2.5),
    ("--num-kv-blocks", "100", ("engine", "cache", "num_blocks"), 100),
    ("--kv-cache-memory", "512MiB", ("engine", "cache", "kv_cache_memory"), 512 * 2**20),
    ("--kv-cache-dir", "kv", ("engine", "cache", "kv_cache_dir"), "kv"),
    ("--kv-cache-dir-size", "2.5", ("engine", "cache", "kv_cache_dir_size"), 2.5),
    ("--swap-space", "4", ("engine", "cache", "swap_space"), 4.0),
    ("--state-snapshots", "12", ("engine", "cache", "state_snapshots"), 12),
    ("--mamba-cache-mode", "none", ("engine", "cache", "mamba_cache_mode"), "none"),
    ("--kv-offloading-size", "4", ("engine", "cache", "swap_space"), 4.0),
    ("--gpu-memory-utilization", "0.5", ("engine", "cache", "gpu_memory_utilization"), 0.5),
    ("--max-num-seqs", "8", ("engine", "scheduler", "max_num_seqs"), 8),
    ("--max-num-batched-tokens", "4096", ("engine", "scheduler", "max_num_batched_tokens"), 4096),
    ("--scheduling-policy", "priority", ("engine", "scheduler", "policy"), "priority"),
    ("--tensor-parallel-size", "2", ("engine", "parallel", "tensor_parallel_size"), 2),
    ("--distributed-timeout", "7.5", ("engine", "parallel", "distributed_timeout"), 7.5),
    ("--nnodes", "1", ("engine", "parallel", "nnodes"), 1),
    ("--pipeline-parallel-size", "1", ("engine", "parallel", "pipeline_parallel_size"), 1),
    ("--distributed-executor-backend", "mp", ("engine", "parallel", "distributed_executor_backend"), "mp"),
    ("--ray-cpus-per-rank", "4", ("engine", "parallel", "ray_cpus_per_rank"), 4),
    ("--node-rank", "0", ("engine", "parallel", "node_rank"), 0),
    ("--master-addr", "10.0.0.2", ("engine", "parallel", "master_addr"), "10.0.0.2"),
    ("--master-port", "29511", ("engine", "parallel", "master_port"), 29511),
    ("--attention-backend", "torch", ("engine", "attention_backend"), "torch"),
    ("--seed", "7", ("engine", "model", "seed"), 7),
    ("--cpu-threads", "3", ("engine", "cpu_threads"), 3),
    (
        "--allowed-origins",
        "http://a.test,http://b.test",
        ("server", "allowed_origins"),
        ["http://a.test", "http://b.test"],
    ),
    ("--log-level", "debug", ("server", "log_level"), "debug"),
    ("--tool-call-parser", "llama3_json", ("server", "tool_call_parser"), "llama3_json"),
    ("--max-queued-requests", "12", ("server", "max_queued_requests"), 12),
    ("--max-queued-tokens", "5000", ("server", "max_queued_tokens"), 5000),
    ("--request-timeout", "2.5", ("server", "request_timeout"), 2.5),
    ("--shutdown-timeout", "5", ("server", "shutdown_timeout"), 5.0),
    ("--max-request-body", "1MiB", ("server", "max_request_body"), 2**20),
    ("--revision", "v1.0", ("engine", "model", "revision"), "v1.0"),
    ("--download-dir", "/models/hf", ("engine", "model", "download_dir"), "/models/hf"),
    ("--chat-template", "{{ messages[0].content }}", ("engine", "model", "chat_template"), "{{ messages[0].content }}"),
    ("--generation-config", "vllm", ("engine", "model", "generation_config"), "vllm"),
    ("--max-logprobs", "5", ("server", "max_logprobs"), 5),
    ("--root-path", "/llm", ("server", "root_path"), "/llm"),
    ("--ssl-keyfile", "key.pem", ("server", "ssl_keyfile"), "key.pem"),  # needs its pair: see below
    ("--ssl-certfile", "cert.pem", ("server", "ssl_certfile"), "cert.pem"),
    ("--quantization", "int4", ("engine", "model", "quantization"), "int4"),
    ("--quantization-group-size", "64", ("engine", "model", "quantization_group_size"), 64),
    ("--kv-cache-dtype", "bfloat16", ("engine", "cache", "kv_cache_dtype"), "bfloat16"),
    ("--max-loras", "2", ("engine", "lora", "max_loras"), 2),
    ("--max-lora-rank", "64", ("engine", "lora", "max_lora_rank"), 64),
    ("--max-cpu-loras", "8", ("engine", "lora", "max_cpu_loras"), 8),
    ("--uvicorn-log-level", "warning", ("server", "uvicorn_log_level"), "warning"),
    ("--reasoning-parser", "qwen3", ("server", "reasoning_parser"), "qwen3"),
    ("--chat-template-content-format", "openai", ("server", "chat_template_content_format"), "openai"),
    (
        "--default-chat-template-kwargs",
        '{"enable_thinking": false}',
        ("server", "default_chat_template_kwargs"),
        {"enable_thinking": False},
    ),
    ("--response-role", "model", ("server", "response_role"), "model"),
    ("--allowed-methods", "GET,POST", ("server", "allowed_methods"), ["GET", "POST"]),
    ("--allowed-headers", "Authorization", ("server", "allowed_headers"), ["Authorization"]),
    ("--middleware", "json.JSONDecoder", ("server", "middleware"), ["json.JSONDecoder"]),
    (
        "--disable-access-log-for-endpoints",
        "/health,/metrics",
        ("server", "disable_access_log_for_endpoints"),
        ["/health", "/metrics"],
    ),
    ("--uds", "pagedserve.sock", ("server", "uds"), "pagedserve.sock"),
    ("--h11-max-incomplete-event-size", "65536", ("server", "h11_max_incomplete_event_size"), 65536),
    ("--h11-max-header-count", "64", ("server", "h11_max_header_count"), 64),
    ("--log-config-file", "logging.json", ("server", "log_config_file"), "logging.json"),
    ("--ssl-ca-certs", "ca.pem", ("server", "ssl_ca_certs"), "ca.pem"),  # these need HTTPS: see below
    ("--ssl-cert-reqs", "2", ("server", "ssl_cert_reqs"), 2),
    ("--ssl-ciphers", "ECDHE+AESGCM", ("server", "ssl_ciphers"), "ECDHE+AESGCM"),
    (
        "--override-generation-config",
        '{"temperature": 0.5}',
        ("engine", "model", "override_generation_config"),
        {"temperature": 0.5},
    ),
    ("--tokenizer-revision", "v2", ("engine", "model", "tokenizer_revision"), "v2"),
    ("--num-gpu-blocks-override", "64", ("engine", "cache", "num_blocks"), 64),
    ("--long-prefill-token-threshold", "256", ("engine", "scheduler", "long_prefill_token_threshold"), 256),
    ("--kv-cache-memory-bytes", "256MiB", ("engine", "cache", "kv_cache_memory"), 256 * 2**20),
]
_HTTPS = ("--ssl-keyfile", "key.pem", "--ssl-certfile", "cert.pem")
_PAIRS = {
    "--ssl-keyfile": ("--ssl-certfile", "cert.pem"),
    "--ssl-certfile": ("--ssl-keyfile", "key.pem"),
    "--ssl-ca-certs": _HTTPS,
    "--ssl-cert-reqs": (*_HTTPS, "--ssl-ca-certs", "ca.pem"),
    "--ssl-ciphers": _HTTPS,
}
# boolean flags: place in Settings, default
BOOL_FLAGS = {
    "--enable-prefix-caching": (("engine", "cache", "enable_prefix_caching"), True),
    "--strict-params": (("server", "strict_params"), False),
    "--batch-invariant": (("engine", "batch_invariant"), False),
    "--metrics-require-auth": (("server", "metrics_require_auth"), False),
    "--enforce-eager": (("engine", "enforce_eager"), False),
    "--profile": (("engine", "profile"), False),
    "--trust-remote-code": (("engine", "model", "trust_remote_code"), False),
    "--enable-log-requests": (("server", "enable_log_requests"), False),
    "--enable-lora": (("engine", "lora", "enable_lora"), False),
    "--enable-expert-parallel": (("engine", "parallel", "enable_expert_parallel"), False),
    "--allow-runtime-lora-updating": (("engine", "lora", "allow_runtime_lora_updating"), False),
    "--trust-request-chat-template": (("server", "trust_request_chat_template"), False),
    "--return-tokens-as-token-ids": (("server", "return_tokens_as_token_ids"), False),
    "--enable-force-include-usage": (("server", "enable_force_include_usage"), False),
    "--allow-credentials": (("server", "allow_credentials"), False),
    "--enable-request-id-headers": (("server", "enable_request_id_headers"), False),
    "--disable-fastapi-docs": (("server", "disable_fastapi_docs"), False),
    "--log-error-stack": (("server", "log_error_stack"), False),
}
# vLLM's flags of what this server always does: (a value taken, a value refused)
ALWAYS_FLAGS = {
    "--enable-chunked-prefill": (["--enable-chunked-prefill"], ["--no-enable-chunked-prefill"]),
    "--tokenizer-mode": (["--tokenizer-mode", "auto"], ["--tokenizer-mode", "slow"]),
    "--load-format": (["--load-format", "safetensors"], ["--load-format", "pt"]),
    "--guided-decoding-backend": (["--guided-decoding-backend", "xgrammar"], ["--guided-decoding-backend", "outlines"]),
    "--max-log-len": (["--max-log-len", "100"], ["--max-log-len", "many"]),
    "--enable-server-load-tracking": (["--no-enable-server-load-tracking"], None),  # either way: nothing refused
    "--tool-parser-plugin": (["--tool-parser-plugin", ""], ["--tool-parser-plugin", "my_parsers.py"]),
    "--max-num-partial-prefills": (["--max-num-partial-prefills", "1"], ["--max-num-partial-prefills", "4"]),
    "--max-long-partial-prefills": (["--max-long-partial-prefills", "1"], ["--max-long-partial-prefills", "2"]),
    "--data-parallel-size": (["--data-parallel-size", "1"], ["-dp", "2"]),
    "--cpu-offload-gb": (["--cpu-offload-gb", "0"], ["--cpu-offload-gb", "4"]),
    "--expert-placement-strategy": (
        ["--expert-placement-strategy", "linear"],
        ["--expert-placement-strategy", "round_robin"],
    ),
    "--enable-eplb": (["--no-enable-eplb"], ["--enable-eplb"]),
    "--disable-log-stats": (["--disable-log-stats"], ["--no-disable-log-stats"]),
    "--disable-sliding-window": (["--no-disable-sliding-window"], ["--disable-sliding-window"]),
    "--calculate-kv-scales": (["--no-calculate-kv-scales"], ["--calculate-kv-scales"]),
    "--model-impl": (["--model-impl", "vllm"], ["--model-impl", "transformers"]),
    "--config-format": (["--config-format", "hf"], ["--config-format", "mistral"]),
    "--max-parallel-loading-workers": (
        ["--max-parallel-loading-workers", "4"],
        ["--max-parallel-loading-workers", "x"],
    ),
    "--disable-custom-all-reduce": (["--disable-custom-all-reduce"], None),
    "--enable-prompt-tokens-details": (["--enable-prompt-tokens-details"], ["--no-enable-prompt-tokens-details"]),
    "--exclude-tools-when-tool-choice-none": (
        ["--exclude-tools-when-tool-choice-none"],
        ["--no-exclude-tools-when-tool-choice-none"],
    ),
}
ALL_FLAGS = (
    {case[0] for case in FLAG_CASES}
    | set(BOOL_FLAGS)
    | {
        "--config",
        "--disable-log-requests",
        "--enable-auto-tool-choice",
        "--headless",
        "--lora-modules",
        "--disable-uvicorn-access-log",
        "--enable-ssl-refresh",  # needs HTTPS: test_ssl_refresh_and_client_certificates_need_https
    }
    | set(ALWAYS_FLAGS)
)


def get(settings: Settings, path):
    value = settings
    for key in path:
        value = getattr(value, key)
    return value


def env_name(flag: str) -> str:
    return "PAGEDSERVE_" + flag[2:].upper().replace("-", "_")


def write_yaml(tmp_path, data) -> str:
    path = tmp_path / "preset.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def test_defaults_are_the_config_models_defaults():
    assert load_settings([], {}) == Settings()


def test_the_flags_are_vllms_names_and_nothing_else():
    flags = {action.option_strings[0] for action in build_parser()._actions if action.option_strings} - {"-h"}
    assert flags == ALL_FLAGS
    assert {option.flag for option in OPTIONS} == ALL_FLAGS


@pytest.mark.parametrize("flag,value,path,expected", FLAG_CASES, ids=[case[0] for case in FLAG_CASES])
def test_every_flag_and_its_variable_set_their_field(flag, value, path, expected):
    pair = list(_PAIRS.get(flag, ()))
    assert get(load_settings([flag, value, *pair], {}), path) == expected
    assert get(load_settings(pair, {env_name(flag): value}), path) == expected


def test_disable_log_requests_is_vllms_spelling_of_no_enable():
    path = ("server", "enable_log_requests")
    assert get(load_settings(["--disable-log-requests"], {"PAGEDSERVE_ENABLE_LOG_REQUESTS": "1"}), path) is False
    assert get(load_settings([], {"PAGEDSERVE_DISABLE_LOG_REQUESTS": "true"}), path) is False
    assert get(load_settings(["--enable-log-requests"], {"PAGEDSERVE_DISABLE_LOG_REQUESTS": "1"}), path) is True
    with pytest.raises(SettingsError):
        load_settings(["--no-disable-log-requests"], {})


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--max-logprobs", "21"], "--max-logprobs: Input should be less than or equal to 20"),
        (["--root-path", "llm/"], "--root-path: must start with /"),
        (["--ssl-certfile", "cert.pem"], "ssl_keyfile and ssl_certfile go together"),
        (
            ["--quantization", "int3"],
            "--quantization: expected one of auto, none, gguf, int8, int4, awq, gptq, gptq_marlin, got 'int3'",
        ),
        (["--quantization-group-size", "48"], "--quantization-group-size: Input should be 32, 64 or 128"),
        (["--kv-cache-dtype", "int8"], "kv-cache-dtype: expected one of auto, float32, bfloat16, float16, fp8"),
        (["--hf-overrides", "[1]"], "--hf-overrides: expected a JSON object"),
        (["--hf-overrides", "{bad"], "--hf-overrides: not valid JSON"),
    ],
)
def test_new_flags_refuse_bad_values_naming_the_flag(argv, expected):
    with pytest.raises(SettingsError, match=expected):
        load_settings(argv, {})


@pytest.mark.parametrize("flag", sorted(BOOL_FLAGS))
def test_boolean_flags_both_ways(flag):
    path, default = BOOL_FLAGS[flag]
    assert get(load_settings([], {}), path) is default
    assert get(load_settings([flag], {}), path) is True
    assert get(load_settings(["--no-" + flag[2:]], {}), path) is False


def test_ssl_refresh_and_client_certificates_need_https():
    https = list(_HTTPS)
    assert get(load_settings([*https, "--enable-ssl-refresh"], {}), ("server", "enable_ssl_refresh")) is True
    for flags in (["--enable-ssl-refresh"], ["--ssl-ca-certs", "ca.pem"], ["--ssl-ciphers", "HIGH"]):
        with pytest.raises(SettingsError, match="needs HTTPS"):
            load_settings(flags, {})
    with pytest.raises(SettingsError, match="--ssl-ca-certs"):
        load_settings([*https, "--ssl-cert-reqs", "2"], {})


# YAML section, YAML key, flag, YAML value, env value, flag value, place, expected for YAML / env / flag
PRECEDENCE_CASES = [
    ("model", "seed", "--seed", 1, "2", "3", ("engine", "model", "seed"), (1, 2, 3)),
    (
        "model",
        "dtype",
        "--dtype",
        "float32",
        "bfloat16",
        "float16",
        ("engine", "model", "dtype"),
        ("float32", "bfloat16", "float16"),
    ),
    ("cache", "block_size", "--block-size", 8, "32", "64", ("engine", "cache", "block_size"), (8, 32, 64)),
    (
        "cache",
        "enable_prefix_caching",
        "--no-enable-prefix-caching",
        True,
        "true",
        None,
        ("engine", "cache", "enable_prefix_caching"),
        (True, True, False),
    ),
    ("scheduler", "max_num_seqs", "--max-num-seqs", 4, "8", "16", ("engine", "scheduler", "max_num_seqs"), (4, 8, 16)),
    (
        "scheduler",
        "policy",
        "--scheduling-policy",
        "priority",
        "fcfs",
        "priority",
        ("engine", "scheduler", "policy"),
        ("priority", "fcfs", "priority"),
    ),
    ("server", "port", "--port", 1111, "2222", "3333", ("server", "port"), (1111, 2222, 3333)),
    ("server", "strict_params", "--strict-params", False, "0", None, ("server", "strict_params"), (False, False, True)),
    (
        "server",
        "allowed_origins",
        "--allowed-origins",
        ["http://y.test"],
        "http://e1.test,http://e2.test",
        "http://f.test",
        ("server", "allowed_origins"),
        (["http://y.test"], ["http://e1.test", "http://e2.test"], ["http://f.test"]),
    ),
    (
        None,
        "attention_backend",
        "--attention-backend",
        "torch",
        "auto",
        "torch",
        ("engine", "attention_backend"),
        ("torch", "auto", "torch"),
    ),
    (None, "batch_invariant", "--batch-invariant", True, "0", None, ("engine", "batch_invariant"), (True, False, True)),
]


@pytest.mark.parametrize("case", PRECEDENCE_CASES, ids=[case[2] for case in PRECEDENCE_CASES])
def test_precedence_defaults_yaml_env_flags(tmp_path, case):
    section, key, flag, yaml_value, env_value, flag_value, path, expected = case
    preset = {key: yaml_value} if section is None else {section: {key: yaml_value}}
    config = ["--config", write_yaml(tmp_path, preset)]
    env = {env_name(flag.replace("--no-", "--")): env_value}
    flag_args = [flag] if flag_value is None else [flag, flag_value]
    assert get(load_settings(config, {}), path) == expected[0]
    assert get(load_settings(config, env), path) == expected[1]
    assert get(load_settings([*config, *flag_args], env), path) == expected[2]


def test_layers_combine_field_by_field(tmp_path):
    config = write_yaml(tmp_path, {"scheduler": {"max_num_seqs": 4, "max_num_batched_tokens": 64}})
    settings = load_settings(["--config", config, "--port", "7"], {"PAGEDSERVE_MAX_NUM_SEQS": "32"})
    assert settings.engine.scheduler.max_num_seqs == 32
    assert settings.engine.scheduler.max_num_batched_tokens == 64
    assert settings.server.port == 7


def test_config_file_from_the_environment_and_the_flag_overrides_it(tmp_path):
    env_preset = tmp_path / "env.yaml"
    env_preset.write_text("server: {port: 1}\n")
    flag_preset = tmp_path / "flag.yaml"
    flag_preset.write_text("server: {port: 2}\n")
    assert load_settings([], {"PAGEDSERVE_CONFIG": str(env_preset)}).server.port == 1
    assert load_settings(["--config", str(flag_preset)], {"PAGEDSERVE_CONFIG": str(env_preset)}).server.port == 2


@pytest.mark.parametrize(
    "raw,expected",
    [
        ("true", True),
        ("false", False),
        ("1", True),
        ("0", False),
        ("TRUE", True),
        ("yes", True),
        ("off", False),
    ],
)
def test_environment_booleans(raw, expected):
    assert load_settings([], {"PAGEDSERVE_STRICT_PARAMS": raw}).server.strict_params is expected
    assert load_settings([], {"PAGEDSERVE_ENABLE_PREFIX_CACHING": raw}).engine.cache.enable_prefix_caching is expected


def test_environment_numbers_lists_and_nulls(tmp_path):
    settings = load_settings(
        [],
        {
            "PAGEDSERVE_PORT": " 8080 ",
            "PAGEDSERVE_GPU_MEMORY_UTILIZATION": "0.75",
            "PAGEDSERVE_KV_CACHE_MEMORY": "2GiB",
            "PAGEDSERVE_API_KEY": "k1, k2,,k3",
            "PAGEDSERVE_ALLOWED_ORIGINS": "http://a.test, http://b.test",
        },
    )
    assert settings.server.port == 8080
    assert settings.engine.cache.gpu_memory_utilization == 0.75
    assert settings.engine.cache.kv_cache_memory == 2 * 2**30
    assert settings.server.api_keys == ["k1", "k2", "k3"]
    assert settings.server.allowed_origins == ["http://a.test", "http://b.test"]
    preset = write_yaml(tmp_path, {"model": {"max_model_len": 128}})
    assert load_settings(["--config", preset], {"PAGEDSERVE_MAX_MODEL_LEN": "none"}).engine.model.max_model_len is None


def test_quantization_group_size_is_unset_by_default_and_none_resets_it(tmp_path):
    """Unset (None) is not 32: the builder refuses an explicit value where no int4 groups apply."""
    path = ("engine", "model", "quantization_group_size")
    assert get(load_settings([], {}), path) is None
    preset = write_yaml(tmp_path, {"model": {"quantization_group_size": 64}})
    assert get(load_settings(["--config", preset], {}), path) == 64
    assert get(load_settings(["--config", preset, "--quantization-group-size", "none"], {}), path) is None


def test_empty_variables_and_foreign_variables_count_as_unset():
    settings = load_settings([], {"PAGEDSERVE_PORT": "", "PAGEDSERVE_API_KEY": "", "PAGEDSERVE_CACHE_DIR": "/x"})
    assert settings == Settings()


def test_repeated_list_flags_accumulate_and_replace_lower_layers():
    settings = load_settings(
        [
            "--api-key",
            "a",
            "--api-key",
            "b",
            "--allowed-origins",
            "http://1.test,http://2.test",
            "--allowed-origins",
            "http://3.test",
        ],
        {"PAGEDSERVE_API_KEY": "from-env"},
    )
    assert settings.server.api_keys == ["a", "b"]
    assert settings.server.allowed_origins == ["http://1.test", "http://2.test", "http://3.test"]


@pytest.mark.parametrize(
    "argv,env,expected",
    [
        (["--port", "abc"], {}, "--port: expected an integer, got 'abc'"),
        (["--max-num-seqs", "0"], {}, "--max-num-seqs: Input should be greater than or equal to 1"),
        (["--dtype", "fp8"], {}, "--dtype: expected one of auto, float32, bfloat16, float16, got 'fp8'"),
        (["--kv-cache-memory", "lots"], {}, "--kv-cache-memory: not a size"),
        (["--gpu-memory-utilization", "1.5"], {}, "--gpu-memory-utilization: Input should be less than or equal to 1"),
        (["--bogus"], {}, "unrecognized arguments: --bogus"),
        ([], {"PAGEDSERVE_PORT": "x"}, "PAGEDSERVE_PORT: expected an integer, got 'x'"),
        ([], {"PAGEDSERVE_PORT": "70000"}, "PAGEDSERVE_PORT: Input should be less than or equal to 65535"),
        ([], {"PAGEDSERVE_STRICT_PARAMS": "maybe"}, "PAGEDSERVE_STRICT_PARAMS: expected a boolean"),
        ([], {"PAGEDSERVE_GPU_MEMORY_UTILIZATION": "half"}, "PAGEDSERVE_GPU_MEMORY_UTILIZATION: expected a number"),
        ([], {"PAGEDSERVE_SCHEDULING_POLICY": "lifo"}, "PAGEDSERVE_SCHEDULING_POLICY: expected one of fcfs, priority"),
        (["--config", "missing.yaml"], {}, "--config: cannot read 'missing.yaml'"),
        ([], {"PAGEDSERVE_CONFIG": "missing.yaml"}, "PAGEDSERVE_CONFIG: cannot read 'missing.yaml'"),
    ],
)
def test_errors_name_the_flag_or_variable(argv, env, expected):
    with pytest.raises(SettingsError) as raised:
        load_settings(argv, env)
    assert expected in str(raised.value)


@pytest.mark.parametrize(
    "preset,expected",
    [
        (
            {"schedular": {}},
            "preset.yaml: unknown key 'schedular' (expected one of: attention_backend, "
            "batch_invariant, cache, cpu_threads, enforce_eager, lora, model, parallel, profile, scheduler, server, "
            "speculative_config)",
        ),
        (
            {"scheduler": {"max_num_seq": 3}},
            "preset.yaml: scheduler.max_num_seq: unknown key (expected one of: long_prefill_token_threshold, "
            "max_concurrent_batches, max_model_len, max_num_batched_tokens, max_num_seqs, policy)",
        ),
        ({"server": {"port": "eighty"}}, "preset.yaml: server.port: Input should be a valid integer"),
        ({"cache": {"block_size": 0}}, "preset.yaml: cache.block_size: Input should be greater than or equal to 1"),
        (
            {"model": {"chat_template": "no-such-file"}},
            "preset.yaml: model.chat_template: neither a file nor a Jinja template",
        ),
        (
            {"server": {"ssl_keyfile": "key.pem"}},
            "preset.yaml: server.ssl_keyfile): ssl_keyfile and ssl_certfile go together",
        ),
        ({"attention_backend": "cudnn"}, "preset.yaml: attention_backend: Input should be"),
        ({"cache": [1, 2]}, "preset.yaml: cache: must be a mapping"),
        ([1, 2], "preset.yaml: the top level must be a mapping"),
    ],
)
def test_errors_name_the_yaml_key(tmp_path, preset, expected):
    with pytest.raises(SettingsError) as raised:
        load_settings(["--config", write_yaml(tmp_path, preset)], {})
    assert expected in str(raised.value)


def test_invalid_yaml_names_the_file(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("server: [unclosed\n")
    with pytest.raises(SettingsError, match="broken.yaml: not valid YAML"):
        load_settings(["--config", str(path)], {})


def test_a_cross_field_error_names_every_source_involved(tmp_path):
    preset = write_yaml(tmp_path, {"scheduler": {"max_num_batched_tokens": 8}})
    with pytest.raises(SettingsError) as raised:
        load_settings(["--config", preset], {"PAGEDSERVE_MAX_NUM_SEQS": "32"})
    message = str(raised.value)
    assert "scheduler.max_num_batched_tokens" in message and "PAGEDSERVE_MAX_NUM_SEQS" in message
    assert "must be >= max_num_seqs" in message


@pytest.mark.parametrize("name", ["default.yaml", "tiny.yaml"])
def test_the_presets_load(name):
    settings = load_settings(["--config", str(CONFIGS / name)], {})
    preset = yaml.safe_load((CONFIGS / name).read_text())
    assert settings.engine.scheduler.max_num_seqs == preset["scheduler"]["max_num_seqs"]
    assert settings.engine.cache.block_size == preset["cache"]["block_size"]
    assert settings.server.port == preset["server"]["port"]
    assert settings.engine.model.max_model_len == preset["model"]["max_model_len"]


def test_the_tiny_model_section_is_the_only_extra_key_allowed(tmp_path):
    assert load_settings(["--config", write_yaml(tmp_path, {"tiny_model": {"vocab_size": 8}})], {}) == Settings()
    with pytest.raises(SettingsError, match="unknown key 'tiny'"):
        load_settings(["--config", write_yaml(tmp_path, {"tiny": {}})], {})


def test_an_empty_preset_and_empty_sections_are_defaults(tmp_path):
    assert load_settings(["--config", write_yaml(tmp_path, None)], {}) == Settings()
    assert load_settings(["--config", write_yaml(tmp_path, {"server": None})], {}) == Settings()


def test_api_keys_never_show(tmp_path):
    preset = write_yaml(tmp_path, {"server": {"api_keys": ["yaml-secret-1"]}})
    for argv, env in [
        (["--config", preset], {}),
        ([], {"PAGEDSERVE_API_KEY": "env-secret-1,env-secret-2"}),
        (["--api-key", "flag-secret-1"], {}),
    ]:
        settings = load_settings(argv, env)
        assert settings.server.api_keys
        for text in (repr(settings), str(settings), repr(settings.server), str(settings.server)):
            assert "secret" not in text


def test_a_bad_api_key_error_does_not_echo_the_key(tmp_path):
    for argv, env in [
        ([], {"PAGEDSERVE_API_KEY": "ok, bad secret "}),
        (["--api-key", " bad-secret"], {}),
        (["--config", write_yaml(tmp_path, {"server": {"api_keys": [" bad-secret", 5]}})], {}),
        (["--api-key", "ok", "--api-key", "clé-secret"], {}),  # was taken, and no client could send it
        ([], {"PAGEDSERVE_API_KEY": "bell\x07secret"}),
    ]:
        with pytest.raises(SettingsError) as raised:
            load_settings(argv, env)
        assert "api" in str(raised.value).lower() and "secret" not in str(raised.value)


def test_help_exits_zero(capsys):
    with pytest.raises(SystemExit) as raised:
        load_settings(["--help"], {})
    assert raised.value.code == 0
    assert "--max-num-seqs" in capsys.readouterr().out


def test_unknown_pagedserve_variables_are_named_with_the_closest_setting(caplog):
    from server.config.settings import NOT_SETTINGS, warn_unknown_variables

    environ = {
        "PAGEDSERVE_PROT": "8011",
        "PAGEDSERVE_MAX_NUM_SEQ": "4",
        "PAGEDSERVE_WHATEVER_ELSE": "1",
        "PAGEDSERVE_PORT": "8011",
        "PAGEDSERVE_CONFIG": "x.yaml",
        "HOME": "/home/u",
        **{name: "1" for name in NOT_SETTINGS},
    }
    with caplog.at_level(logging.WARNING, logger="server.config.settings"):
        warn_unknown_variables(environ)
    assert [r.levelno for r in caplog.records] == [logging.WARNING] * 3
    assert [r.getMessage() for r in caplog.records] == [
        "PAGEDSERVE_MAX_NUM_SEQ is not a pagedserve setting, ignored (did you mean PAGEDSERVE_MAX_NUM_SEQS?)",
        "PAGEDSERVE_PROT is not a pagedserve setting, ignored (did you mean PAGEDSERVE_PORT?)",
        "PAGEDSERVE_WHATEVER_ELSE is not a pagedserve setting, ignored (each flag --x-y is PAGEDSERVE_X_Y: "
        "pagedserve serve --help)",
    ]


def test_every_variable_read_elsewhere_is_allowed():
    """A PAGEDSERVE_* variable that the engine, a compose file or a script reads, and that is no setting, is in
    NOT_SETTINGS (else the server would warn about it)."""
    import re

    from server.config.settings import NOT_SETTINGS

    repo = Path(__file__).resolve().parents[2]
    files = [
        *repo.glob("docker-compose*.yml"),
        *repo.glob("deploy/**/*.yml"),
        *repo.glob("scripts/*.sh"),
        *(path for folder in ("engine", "server", "scheduler") for path in (repo / folder).rglob("*.py")),
    ]
    read = set()
    for path in files:
        text = path.read_text()
        read |= set(re.findall(r"\$\{(PAGEDSERVE_[A-Z0-9_]+)", text))  # shell, compose
        read |= set(re.findall(r"environ(?:\.get\(|\[)\"(PAGEDSERVE_[A-Z0-9_]+)", text))  # Python
    assert "PAGEDSERVE_CACHE_DIR" in read and "PAGEDSERVE_IMAGE" in read
    assert read - {option.env for option in OPTIONS} <= NOT_SETTINGS


def test_a_headless_node_names_its_place_among_the_nodes():
    argv = ["--headless", "--nnodes", "2", "--node-rank", "1", "--master-port", "29511", "--tensor-parallel-size", "2"]
    parallel = load_settings(argv, {}).engine.parallel
    assert parallel.headless and parallel.ranks_per_node == 1
    with pytest.raises(SettingsError, match="give both or neither"):
        load_settings(["--headless"], {})
    with pytest.raises(SettingsError, match="needs master_port"):
        load_settings(["--nnodes", "2", "--tensor-parallel-size", "2"], {})
    with pytest.raises(SettingsError, match="do not spread evenly"):
        load_settings(["--nnodes", "2", "--tensor-parallel-size", "3", "--master-port", "29511"], {})


def test_parallel_layouts_and_the_ray_backend_s_refusal():
    parallel = load_settings(["--pipeline-parallel-size", "2", "--tensor-parallel-size", "2"], {}).engine.parallel
    assert (parallel.pipeline_parallel_size, parallel.world_size) == (2, 4)
    with pytest.raises(SettingsError, match="ray places every rank on the Ray cluster itself"):
        load_settings(["--distributed-executor-backend", "ray", "--headless", "--nnodes", "2", "--node-rank", "1",
                       "--master-port", "29511", "--tensor-parallel-size", "2"], {})  # fmt: skip
    assert (
        load_settings(["--distributed-executor-backend", "ray"], {}).engine.parallel.distributed_executor_backend
        == "ray"
    )


def test_lora_modules_take_vllms_two_forms_after_one_flag_and_from_the_environment(tmp_path):
    argv = ["--enable-lora", "--lora-modules", "a=/ad/a", '{"name": "b", "path": "/ad/b", "base_model_name": "m"}']
    lora = load_settings(argv, {}).engine.lora
    assert lora.enable_lora
    assert [(m.name, m.path, m.base_model_name) for m in lora.lora_modules] == [
        ("a", "/ad/a", None),
        ("b", "/ad/b", "m"),
    ]
    env = {"PAGEDSERVE_LORA_MODULES": 'c=/ad/c \'{"name": "d", "path": "/ad/d"}\'', "PAGEDSERVE_ENABLE_LORA": "1"}
    assert [m.name for m in load_settings([], env).engine.lora.lora_modules] == ["c", "d"]
    assert [m.name for m in load_settings(["--lora-modules", "e=/ad/e"], env).engine.lora.lora_modules] == ["e"]
    with pytest.raises(SettingsError, match=r"lora_modules \(e\) need enable_lora"):  # (they would be ignored)
        load_settings(["--lora-modules", "e=/ad/e"], {})
    preset = write_yaml(tmp_path, {"lora": {"enable_lora": True, "lora_modules": [{"name": "f", "path": "/ad/f"}]}})
    assert load_settings(["--config", preset], {}).engine.lora.lora_modules[0].name == "f"
    with pytest.raises(SettingsError, match="--lora-modules: expected NAME=PATH or a JSON object, got 'a'"):
        load_settings(["--lora-modules", "a"], {})
    with pytest.raises(SettingsError, match="--lora-modules: not valid JSON"):
        load_settings(["--lora-modules", "{name"], {})


def test_vllms_runtime_lora_variable_allows_the_endpoints_below_ours():
    vllm = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
    assert load_settings([], vllm).engine.lora.allow_runtime_lora_updating
    ours = {**vllm, "PAGEDSERVE_ALLOW_RUNTIME_LORA_UPDATING": "false"}
    assert not load_settings([], ours).engine.lora.allow_runtime_lora_updating
    assert load_settings(["--allow-runtime-lora-updating"], ours).engine.lora.allow_runtime_lora_updating
    with pytest.raises(SettingsError, match="VLLM_ALLOW_RUNTIME_LORA_UPDATING: expected a boolean"):
        load_settings([], {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "maybe"})


def test_allowed_origins_take_vllms_json_list():
    """vLLM's `--allowed-origins` is a JSON list (`'["https://a.test"]'`); it was split at the comma into two
    strings that no browser's Origin header ever equals, so CORS silently refused the origins it was given."""
    vllm_style = '["https://a.test", "http://b.test:8080"]'
    assert load_settings(["--allowed-origins", vllm_style], {}).server.allowed_origins == [
        "https://a.test",
        "http://b.test:8080",
    ]
    from_env = load_settings([], {"PAGEDSERVE_ALLOWED_ORIGINS": vllm_style})
    assert from_env.server.allowed_origins == ["https://a.test", "http://b.test:8080"]
    with pytest.raises(SettingsError, match="--allowed-origins: not a JSON list of strings"):
        load_settings(["--allowed-origins", '["https://a.test", 3]'], {})


@pytest.mark.parametrize(
    "origin", ['["https://a.test"', "https://a.test/", "https://a.test/app", "a.test", "'https://a.test'"]
)
def test_an_allowed_origin_that_no_browser_sends_is_refused(origin):
    """An Origin header is `scheme://host[:port]`, no path: an entry that can never equal one is a bad setting
    (exit 2), not a silent CORS refusal of every request."""
    with pytest.raises(SettingsError, match="--allowed-origins"):
        load_settings(["--allowed-origins", origin], {})


def test_allowed_origins_that_browsers_send_are_kept():
    origins = ["*", "null", "http://localhost:3000", "https://app.example.com", "http://[::1]:8080"]
    assert load_settings(["--allowed-origins", ",".join(origins)], {}).server.allowed_origins == origins


def test_the_model_as_a_positional_argument_as_vllm_serve_takes_it():
    """`vllm serve MODEL` is how vLLM users start a server; `pagedserve serve ./model` was 'unrecognized
    arguments'. The positional model is the flag's equal: above the environment, and with --model only when
    both say the same."""
    path = ("engine", "model", "model")
    assert get(load_settings(["/models/llama"], {}), path) == "/models/llama"
    assert get(load_settings(["/models/llama", "--port", "9000"], {"PAGEDSERVE_MODEL": "/other"}), path) == (
        "/models/llama"
    )
    assert get(load_settings(["--port", "9000", "/models/llama"], {}), path) == "/models/llama"
    assert get(load_settings(["/models/llama", "--model", "/models/llama"], {}), path) == "/models/llama"
    with pytest.raises(SettingsError, match="given twice, as '/models/llama' and as --model '/other'"):
        load_settings(["/models/llama", "--model", "/other"], {})
    with pytest.raises(SettingsError, match="unrecognized arguments: /second"):
        load_settings(["/models/llama", "/second"], {})
    assert get(load_settings([], {}), path) is None


@pytest.mark.parametrize("name, expected", [("half", "float16"), ("float", "float32"), ("bfloat16", "bfloat16")])
def test_dtype_takes_vllms_names(name, expected, tmp_path):
    """vLLM's --dtype takes half and float beside float16 and float32; `--dtype half` was an exit 2. The flag,
    the variable, a preset and the offline LLM's ModelConfig (which also takes a torch dtype) read them alike."""
    import torch

    from engine.loading.model_config import ModelConfig

    path = ("engine", "model", "dtype")
    assert get(load_settings(["--dtype", name], {}), path) == expected
    assert get(load_settings([], {"PAGEDSERVE_DTYPE": name}), path) == expected
    assert get(load_settings(["--config", write_yaml(tmp_path, {"model": {"dtype": name}})], {}), path) == expected
    assert ModelConfig(dtype=name).dtype == expected
    assert ModelConfig(dtype=getattr(torch, expected)).dtype == expected
    with pytest.raises(SettingsError, match="--dtype: expected one of auto, float32, bfloat16, float16, got 'double'"):
        load_settings(["--dtype", "double"], {})


def test_enable_auto_tool_choice_is_taken_as_vllms_guides_write_it():
    """`vllm serve M --enable-auto-tool-choice --tool-call-parser hermes` is how vLLM serves tool calls; the flag
    was 'unrecognized arguments' (exit 2). tool_choice auto is always served here: the flag is taken, and turning
    it off is refused rather than ignored."""
    path = ("server", "enable_auto_tool_choice")
    settings = load_settings(["--enable-auto-tool-choice", "--tool-call-parser", "hermes"], {})
    assert get(settings, path) is True and settings.server.tool_call_parser == "hermes"
    assert get(load_settings([], {"PAGEDSERVE_ENABLE_AUTO_TOOL_CHOICE": "true"}), path) is True
    assert get(load_settings([], {}), path) is True
    for argv, environ in ((["--no-enable-auto-tool-choice"], {}), ([], {"PAGEDSERVE_ENABLE_AUTO_TOOL_CHOICE": "0"})):
        with pytest.raises(SettingsError, match="tool_choice auto is always served"):
            load_settings(argv, environ)


def test_vllms_short_flags():
    """vLLM's -tp, -pp, -q and -ep (`vllm serve M -tp 2`) were unrecognized arguments; they are the long flags'."""
    settings = load_settings(["-tp", "2", "-pp", "3", "-q", "int8", "-ep"], {})
    assert (settings.engine.parallel.tensor_parallel_size, settings.engine.parallel.pipeline_parallel_size) == (2, 3)
    assert settings.engine.parallel.enable_expert_parallel
    assert settings.engine.model.quantization == "int8"
    with pytest.raises(SettingsError, match="^--tensor-parallel-size: expected an integer, got 'x'"):
        load_settings(["-tp", "x"], {})


@pytest.mark.parametrize("flag", list(ALWAYS_FLAGS))
def test_vllms_flags_of_what_this_server_always_does(flag):
    """vLLM's serve flags for what this server always does (chunked prefill, the fast tokenizer, xgrammar, ...)
    were 'unrecognized arguments' (exit 2) in vLLM's commands: the values that ask for it are taken and change
    nothing, by flag or variable; another is refused naming the flag, never ignored."""
    taken, refused = ALWAYS_FLAGS[flag]
    assert load_settings(taken, {}) == Settings()
    if len(taken) == 2:
        assert load_settings([], {env_name(flag): taken[1]}) == Settings()
    if refused is None:  # a flag whose every value is what this server does
        assert load_settings([flag], {}) == Settings()
        return
    with pytest.raises(SettingsError, match=flag):
        load_settings(refused, {})


def test_uvicorns_log_level_and_access_log():
    settings = load_settings(["--uvicorn-log-level", "error", "--disable-uvicorn-access-log"], {})
    assert settings.server.uvicorn_log_level == "error" and settings.server.uvicorn_access_log is False
    assert load_settings([], {}).server.uvicorn_access_log is True
    with pytest.raises(SettingsError, match="--uvicorn-log-level"):
        load_settings(["--uvicorn-log-level", "loud"], {})
