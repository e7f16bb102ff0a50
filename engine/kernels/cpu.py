"""Native CPU kernels (csrc/*.cpp), compiled on first use and cached, called through ctypes.

The sources are built with the machine's C++ compiler (`$CXX`, else `c++`/`g++`)
for the CPU it runs on (`-march=native`) and OpenMP. The shared library lands in
`<cache_dir>/kernels/<key>.so`, the key hashing the source, the flags, the
compiler's version and the CPU's feature flags, so a second start loads it in
milliseconds and a cache shared by different machines never runs code built for
another CPU. The library is loaded after torch, whose OpenMP runtime has the
same soname, so kernels and torch ops share one thread pool.

Everything here is optional: without a compiler, or when the build or a
self-check fails, `load_cpu_kernels` returns None with the reason logged and
the torch backend does the work.
"""

from __future__ import annotations

import array
import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, NamedTuple, Optional, Sequence

import numpy as np
import torch

from engine.kernels import cpu_ops
from engine.cache_dir import default_cache_dir
from engine.cpu_threads import machine_cpu_threads
from engine.file_lock import exclusive_lock

logger = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
SOURCES = (
    "paged_decode.cpp",
    "layer_ops.cpp",
    "invariant_linear.cpp",
    "gemv.cpp",
    "decode_layer.cpp",
    "quant_gemm.cpp",
    "quant_dense_bf16.cpp",
    "lora_add.cpp",
    "prefill_attention.cpp",
    "prefill_attention_f32.cpp",
    "sample_rows.cpp",
    "logit_processors.cpp",
    "team_split.cpp",
)
HEADERS = (
    "common.h",
    "column_blocks.h",
    "gemv.h",
    "row_ops.h",
    "quant_blocks.h",
    "quant_product.h",
    "lora_delta.h",
    "exp16.h",
    "team_split.h",
    "fp8.h",
    "prefill_items.h",
)
FLAGS = ("-O3", "-fno-trapping-math", "-fno-math-errno", "-fopenmp", "-shared", "-fPIC", "-std=c++17")
NATIVE_ARCH = "native"
_DTYPE_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}
KERNEL_DTYPES = frozenset(_DTYPE_SUFFIX)
FP8_CACHE_KERNELS = ("paged_decode", "decode_layers")
"""The kernels that also read and write a KV cache of float8 e4m3 (`pagedserve_<name>_<f32|bf16>_fp8`:
queries, activations and outputs in the model's dtype)."""
PREFILL_HEAD_DIMS = (64, 128)
"""The head sizes csrc/prefill_attention.cpp and prefill_attention_f32.cpp are built for (others keep torch's
attention)."""
BUILD_SECONDS = 15
"""What a first start's build of all SOURCES takes on a 2-core development machine, beside the model's
conversion (one compiler process per source, as many at once as the process has CPUs; paged_decode.cpp alone
takes most of a core's share); the first start says so before it goes quiet for that long."""
COMPILE_TIMEOUT_S = 300
"""Longest a compiler process may take on one source (or the link) before the build is given up."""
DECODE_WEIGHT_COLUMNS = 10 + 6 * 4
"""Values per layer in decode_layers' weight table (csrc/decode_layer.cpp's WeightColumn)."""
DECODE_LAYER_COLUMNS = 7
"""Values per layer in decode_layers' layer table (csrc/decode_layer.cpp's LayerColumn)."""
DECODE_LORA_COLUMNS = 8
"""Addresses per layer in decode_layers' LoRA table: the stacked A and B of qkv, o, gate_up, down."""


class DecodeLoRA(NamedTuple):
    """A decode step's LoRA adapters for `decode_layers` (csrc/lora_delta.h): per layer the stacks' addresses
    [num_layers, DECODE_LORA_COLUMNS] int64, each token's slots [rows, width] int32 (-1: none) and scales
    [rows, width] float32, each slot's rank [max_loras] int32, and the stacks' padded rank."""

    table: torch.Tensor
    slots: torch.Tensor
    scales: torch.Tensor
    ranks: torch.Tensor
    max_rank: int


def compiler() -> Optional[str]:
    for candidate in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if candidate and shutil.which(candidate):
            return candidate
    return None


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


GEMV_PREFETCH_BYTES = 2048
"""The weight-streaming kernel (csrc/gemv.h) and the column-block kernel's vdpbf16ps path (csrc/column_blocks.h)
prefetch their weight streams this far ahead on every CPU but AMD's with AVX-512: on a Xeon the batch-1 products
read their weights markedly faster with it (2048 bytes beat 1024 and 4096), and on an AVX2 EPYC (Zen 3) bf16
decode steps ran faster at 1 and 8 sequences; on an AMD EPYC with AVX-512 an earlier software prefetch was slower
than the hardware prefetcher alone. Measured in docs/performance.md."""


def _cpu_vendor() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("vendor_id"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def _gemv_prefetches() -> bool:
    """Whether the weight streams prefetch in software here (see GEMV_PREFETCH_BYTES): all but AMD's AVX-512 CPUs."""
    return not (_cpu_vendor() == "AuthenticAMD" and "avx512f" in _cpu_flags().split())


def _flags(arch: str) -> tuple[str, ...]:
    prefetch = (f"-DPAGEDSERVE_GEMV_PREFETCH={GEMV_PREFETCH_BYTES}",) if _gemv_prefetches() else ()
    return (*FLAGS, f"-march={arch}", *prefetch)


def _build_key(compiler_path: str, flags: tuple[str, ...], sources: tuple[str, ...]) -> str:
    version = subprocess.run([compiler_path, "--version"], capture_output=True, text=True, timeout=30).stdout
    digest = hashlib.sha256()
    texts = [name.encode() + (CSRC / name).read_bytes() for name in (*sources, *HEADERS)]
    for part in (
        *texts,
        " ".join(flags).encode(),
        version.encode(),
        _cpu_flags().encode(),
        platform.machine().encode(),
    ):
        digest.update(part)
        digest.update(b"\0")
    return digest.hexdigest()[:32]


def build_library(
    cache_dir: Optional[Path] = None, arch: str = NATIVE_ARCH, *, sources: tuple[str, ...] = SOURCES
) -> Path:
    """Compile the kernels (or find the cached build) for `-march=<arch>` (this CPU by default; another,
    older one such as "haswell" to test the AVX2 code paths here), of `sources` (all by default, a subset
    in tests); each combination is cached under its own key. Raises RuntimeError with the reason."""
    if platform.system() != "Linux":
        raise RuntimeError(f"native CPU kernels are built on Linux only (this is {platform.system()})")
    compiler_path = compiler()
    if compiler_path is None:
        raise RuntimeError("no C++ compiler found (set $CXX or install g++)")
    target_dir = (cache_dir or default_cache_dir()) / "kernels"
    flags = _flags(arch)
    target = target_dir / f"cpu-kernels-{_build_key(compiler_path, flags, sources)}.so"
    if target.exists():
        return target
    target_dir.mkdir(parents=True, exist_ok=True)
    # one builder per library: the others (a background build, tensor-parallel ranks) wait, then find it
    with exclusive_lock(target.with_suffix(".lock")):
        if target.exists():
            return target
        prefix = f".build-{target.stem}-"
        _remove_stale_builds(target_dir, prefix)
        work = Path(tempfile.mkdtemp(dir=target_dir, prefix=prefix))  # this builder's objects and library
        estimate = f", about {BUILD_SECONDS} s" if set(sources) == set(SOURCES) else ""
        logger.info("building the native CPU kernels (first start only%s) ...", estimate)
        started = time.monotonic()
        try:
            partial = work / "kernels.so"
            _compile_and_link(compiler_path, flags, sources, work, partial)
            os.replace(partial, target)  # atomic: a reader without the lock sees a complete file or none
            logger.info("built the native CPU kernels in %.1f s (cached in %s)", time.monotonic() - started, target_dir)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return target


def start_build(cache_dir: Optional[Path] = None, *, sources: tuple[str, ...] = SOURCES) -> threading.Thread:
    """`build_library` for this CPU on a thread of its own, for a start with other work to do before it loads
    the kernels (a GGUF to convert, weights to read): the compilers run meanwhile, and `load_cpu_kernels` waits
    for them through the build's lock. A failure is left to that load to report (it tries once more)."""

    def build() -> None:
        try:
            build_library(cache_dir, sources=sources)
        except (OSError, RuntimeError, subprocess.SubprocessError) as error:
            logger.debug("the background build of the native CPU kernels failed: %s", error)

    thread = threading.Thread(target=build, name="kernel-build", daemon=True)
    thread.start()
    return thread


def _compile_and_link(
    compiler_path: str, flags: tuple[str, ...], sources: Sequence[str], work: Path, out: Path
) -> None:
    """Each source compiled to an object in `work` by a compiler process of its own, as many at once as this
    process may use CPUs (one compiler process takes its sources one after another), then linked into `out`.
    The processes are this thread's own (no pool whose workers the interpreter would wait for at exit); the
    first failure stops the others."""
    jobs = machine_cpu_threads(None, {}).count  # the affinity mask and quota, not the engine's OpenMP setting
    waiting = list(sources)  # SOURCES starts with the longest compile
    running: dict[str, tuple[subprocess.Popen, float]] = {}
    try:
        while waiting or running:
            while waiting and len(running) < jobs:
                name = waiting.pop(0)
                stem = Path(name).stem
                with open(work / f"{stem}.log", "w") as log:
                    command = [compiler_path, *flags, "-c", str(CSRC / name), "-o", str(work / f"{stem}.o")]
                    running[name] = (subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT), time.monotonic())
            time.sleep(0.02)
            for name, (process, started) in list(running.items()):
                if process.poll() is None:
                    if time.monotonic() - started > COMPILE_TIMEOUT_S:
                        raise RuntimeError(f"{compiler_path} took over {COMPILE_TIMEOUT_S} s on {name}")
                    continue
                del running[name]
                if process.returncode != 0:
                    output = (work / f"{Path(name).stem}.log").read_text(errors="replace").strip()
                    raise RuntimeError(f"{compiler_path} failed to build the CPU kernels: {output[-2000:]}")
    finally:
        for process, _ in running.values():
            process.kill()
            process.wait()
    objects = [str(work / f"{Path(name).stem}.o") for name in sources]
    result = subprocess.run(
        [compiler_path, *flags, "-o", str(out), *objects], capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S
    )
    if result.returncode != 0:
        raise RuntimeError(f"{compiler_path} failed to link the CPU kernels: {result.stderr.strip()[-2000:]}")


def _remove_stale_builds(target_dir: Path, prefix: str) -> None:
    """Work folders of builds of this library that a killed process left (called under the build's lock: no
    builder of it is running)."""
    for stale in target_dir.glob(f"{prefix}*"):
        shutil.rmtree(stale, ignore_errors=True)


class CpuKernels:
    """The loaded library's entry points (their addresses, per kernel and dtype), called through the
    `torch.ops.pagedserve.cpu_*` operators of cpu_ops.py after checking their arguments: under torch.compile;
    eagerly the methods of a step's hot path (`decode_layers`, `paged_decode`, the per-token ops, the products,
    `lora_add_`) call the operators' kernels themselves, the dispatcher's cost being a share of a step."""

    def __init__(self, path: Path):
        self.path = path
        self.invariant_product_ok = False  # set by the load-time self-check
        self._library = ctypes.CDLL(str(path))  # loaded while this object lives
        probe = self._library.pagedserve_column_blocks_bf16_native
        probe.restype = ctypes.c_int64
        # the column-block product's bf16 kernel runs on vdpbf16ps (AVX512-BF16): the engine's bf16 product
        # there (on AMX CPUs, with its tile path: attention/cpu_backend.py)
        self.bf16_column_blocks = bool(probe())
        probe = self._library.pagedserve_column_blocks_f32_native
        probe.restype = ctypes.c_int64
        # the float32 kernel has vector tiles (AVX2 or AVX-512 builds): the engine's float32 product there
        self.f32_column_blocks = bool(probe())
        # built with AMX and granted the tile state by the OS: bf16 column-block products (K a multiple of 32)
        # may run on the tiles
        tiles = self._library.pagedserve_amx_tiles
        tiles.restype = ctypes.c_int64
        self.amx_tiles = bool(tiles())  # cleared by a failed self-check
        # per (kernel, dtype, KV cache dtype): the cache's is the dtype's own except for FP8_CACHE_KERNELS' fp8
        self._functions: dict[tuple[str, torch.dtype, torch.dtype], int] = {}
        self._ops = cpu_ops.Overloads()
        for name in cpu_ops.SIGNATURES:
            for dtype, suffix in _DTYPE_SUFFIX.items():
                caches = {dtype: suffix}
                if name in FP8_CACHE_KERNELS:
                    caches[torch.float8_e4m3fn] = f"{suffix}_fp8"
                for cache_dtype, symbol in caches.items():
                    function = getattr(self._library, f"pagedserve_{name}_{symbol}")
                    address = ctypes.cast(function, ctypes.c_void_p).value
                    assert address is not None  # a symbol the library exports (getattr raised otherwise)
                    self._functions[name, dtype, cache_dtype] = address
        # prompt chunks' attention: bf16 on vdpbf16ps (csrc/prefill_attention.cpp, AVX512-BF16 builds), float32
        # on FMAs over float32, bf16 or fp8 caches (prefill_attention_f32.cpp, AVX-512 or AVX2 builds); per (query
        # dtype, KV cache dtype), the pairs this build serves
        self._prefill_attention_fns: dict[tuple[torch.dtype, torch.dtype], int] = {}
        pointer, integer = ctypes.c_void_p, ctypes.c_int64
        # sampled rows' tokens (sample_rows), prompt logprobs (row_logprobs), bias and penalties (logit_processors)
        self._sample_rows = _c_function(
            self._library, "pagedserve_sample_rows", pointer, integer, integer, *[pointer] * 6
        )
        self._row_logprobs = _c_function(
            self._library, "pagedserve_row_logprobs", pointer, integer, integer, pointer, integer, *[pointer] * 4
        )
        self._logit_processors = _c_function(
            self._library,
            "pagedserve_logit_processors",
            *(pointer, integer, integer, integer, pointer, pointer),
            *(integer, pointer, pointer),
        )
        builds: dict[str, tuple[tuple[torch.dtype, torch.dtype, str], ...]] = {  # per probe, what it has
            "bf16_native": (
                (torch.bfloat16, torch.bfloat16, "bf16"),
                (torch.bfloat16, torch.float8_e4m3fn, "bf16_fp8"),
            ),
            "f32_native": (
                (torch.float32, torch.float32, "f32"),
                (torch.float32, torch.bfloat16, "f32_bf16"),
                (torch.float32, torch.float8_e4m3fn, "f32_fp8"),
            ),
        }
        for name, pairs in builds.items():
            has = getattr(self._library, f"pagedserve_prefill_attention_{name}")
            has.restype = ctypes.c_int64
            if has():
                for query_dtype, cache_dtype, suffix in pairs:
                    entry = getattr(self._library, f"pagedserve_prefill_attention_{suffix}")
                    address = ctypes.cast(entry, ctypes.c_void_p).value
                    assert address is not None
                    self._prefill_attention_fns[query_dtype, cache_dtype] = address

    def sample_rows(
        self,
        logits: torch.Tensor,  # [rows, vocab] float32, contiguous, on the CPU
        temperature: Sequence[float],  # > 0
        log_min_p: Sequence[float],  # -inf: no min_p
        top_k: Sequence[int],  # >= vocab: no top-k
        top_p: Sequence[float],  # 1: no top-p
        u: torch.Tensor,  # [rows] in [0, 1)
    ) -> torch.Tensor:
        """One token per row, drawn as engine/sampling/sampler.py draws a sampled row (csrc/sample_rows.cpp: the
        whole vocabulary, or the top-k candidates and their top-p, or a top-p nucleus over the whole row),
        each row under its own parameters and uniform. Returns int64 [rows]."""
        rows, vocab = logits.shape
        if logits.dtype != torch.float32 or logits.device.type != "cpu" or not logits.is_contiguous():
            raise ValueError("sample_rows takes contiguous float32 CPU logits")
        with np.errstate(over="ignore"):  # a temperature past float32's range: inf, as torch casts it
            columns = [
                np.ascontiguousarray(values, dtype=dtype)
                for values, dtype in (
                    (temperature, np.float32),
                    (log_min_p, np.float32),
                    (top_k, np.int64),
                    (top_p, np.float32),
                )
            ]
        uniforms = np.ascontiguousarray(u.numpy(), dtype=np.float32)
        if any(column.shape != (rows,) for column in (*columns, uniforms)):
            raise ValueError(f"sample_rows takes one value of each parameter per row ({rows} rows)")
        out = np.empty(rows, dtype=np.int64)
        self._sample_rows(
            logits.data_ptr(), rows, vocab, *(c.ctypes.data for c in columns), uniforms.ctypes.data, out.ctypes.data
        )
        return torch.from_numpy(out)

    def row_logprobs(
        self, logits: torch.Tensor, targets: torch.Tensor, k: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each row's raw log-softmax at its target, that target's rank (1 + the columns more likely) and its k
        best (logprobs and columns, best first), without the [rows, vocab] log-softmax (csrc/sample_rows.cpp).
        logits [rows, vocab] float32 contiguous on the CPU, targets [rows] int64. Returns ([rows] float32,
        [rows] int64, [rows, k] float32, [rows, k] int64)."""
        rows, vocab = logits.shape
        if logits.dtype != torch.float32 or logits.device.type != "cpu" or not logits.is_contiguous():
            raise ValueError("row_logprobs takes contiguous float32 CPU logits")
        ids = np.ascontiguousarray(targets.numpy(), dtype=np.int64)
        if ids.shape != (rows,) or (rows and not 0 <= int(ids.min()) <= int(ids.max()) < vocab):
            raise ValueError(f"row_logprobs takes one target in [0, {vocab}) per row")
        logprob, rank = np.empty(rows, dtype=np.float32), np.empty(rows, dtype=np.int64)
        top_values, top_ids = np.empty((rows, k), dtype=np.float32), np.empty((rows, k), dtype=np.int64)
        arrays = (ids, logprob, rank, top_values, top_ids)
        self._row_logprobs(
            logits.data_ptr(), rows, vocab, arrays[0].ctypes.data, k, *(a.ctypes.data for a in arrays[1:])
        )
        return tuple(torch.from_numpy(a) for a in arrays[1:])  # type: ignore[return-value]

    def logit_processors(
        self,
        x: torch.Tensor,  # [rows, vocab] float32, contiguous, on the CPU: changed in place
        additions: tuple[Sequence[int], Sequence[int], Sequence[float]],  # (rows, ids, values): x[row, id] += value
        penalized: Sequence[int],  # rows with penalties, each once
        repetition: Sequence[float],  # per penalized row; 1: none
        presence: Sequence[float],  # presence and frequency both 0: none
        frequency: Sequence[float],
        prompt_ids: Sequence[Optional[torch.Tensor]],  # int64 (a row without a repetition penalty: None)
        output_ids: Sequence[torch.Tensor],  # int64
    ) -> None:
        """The sampler's logits processors in one call (csrc/logit_processors.cpp): the additions in order, then
        each penalized row's repetition penalty over its prompt and output ids, then its presence and frequency
        penalties over its output ids, with the torch way's float32 arithmetic. Which penalties a row takes is
        decided here on the values as given (as the torch way decides), not on their float32 roundings."""
        rows, vocab = x.shape
        if x.dtype != torch.float32 or x.device.type != "cpu" or not x.is_contiguous():
            raise ValueError("logit_processors takes contiguous float32 CPU logits")
        add_rows, add_ids, add_values = additions
        count = len(penalized)
        if not len(add_rows) == len(add_ids) == len(add_values):
            raise ValueError("logit_processors takes one row, id and value per addition")
        if not count == len(repetition) == len(presence) == len(frequency) == len(prompt_ids) == len(output_ids):
            raise ValueError("logit_processors takes every penalty and both id arrays for each penalized row")
        if len(set(penalized)) != count:
            raise ValueError("logit_processors takes each penalized row once")
        table = array.array("q")  # per penalized row: row, prompt ids' address and length, output ids', flags
        for row, prompt, output, r, p, f in zip(penalized, prompt_ids, output_ids, repetition, presence, frequency):
            for ids in (prompt, output):
                if ids is not None and (
                    ids.dtype != torch.int64 or ids.device.type != "cpu" or not ids.is_contiguous()
                ):
                    raise ValueError("logit_processors takes contiguous int64 CPU id tensors")
            flags = (_REPETITION if r != 1.0 else 0) | (_COUNTS if p != 0.0 or f != 0.0 else 0)
            table.extend((row, *_ids_span(prompt), *_ids_span(output), flags))
        cells = array.array("q", [value for cell in zip(add_rows, add_ids) for value in cell])
        values = array.array("f", add_values)  # float32 as torch casts (past its range: inf)
        penalties = array.array("f", [value for row in zip(repetition, presence, frequency) for value in row])
        self._logit_processors(
            x.data_ptr(),
            rows,
            vocab,
            len(values),
            cells.buffer_info()[0],
            values.buffer_info()[0],
            count,
            table.buffer_info()[0],
            penalties.buffer_info()[0],
        )

    def prefill_attention_serves(self, query_dtype: torch.dtype, cache_dtype: torch.dtype) -> bool:
        """Whether this build has a prefill attention kernel for queries of `query_dtype` over a KV cache of
        `cache_dtype`: bf16 over bf16 or fp8 on AVX512-BF16 builds, float32 over float32, bf16 or fp8 on AVX-512
        or AVX2."""
        return (query_dtype, cache_dtype) in self._prefill_attention_fns

    def paged_decode(
        self,
        query: torch.Tensor,  # [num_seqs, num_heads, head_dim]
        key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        value_cache: torch.Tensor,
        block_tables: torch.Tensor,  # [num_seqs, width] int32
        context_lens: torch.Tensor,  # [num_seqs] int32, each >= 1 and <= width * block_size
        scale: float,
        split: bool = True,
        *,
        window: Optional[int] = None,
        softcap: Optional[float] = None,
        sinks: Optional[torch.Tensor] = None,  # [num_heads]: each head's sink logit (float32 or not)
    ) -> torch.Tensor:
        """Attention of one query per sequence over its cached tokens (the new token included). `split`: with
        few sequences, long ones may be split across threads and merged (faster; the sums grouped by the
        batch's shape and the thread count); False keeps each row's result independent of both. `window`: only
        the last `window` tokens of each sequence are seen; `softcap`: scores capped by softcap * tanh(s / softcap);
        `sinks`: each head's logit joins the softmax's denominator (no value)."""
        num_seqs, num_heads, head_dim = query.shape
        _, block_size, num_kv_heads, cache_head_dim = key_cache.shape
        if cache_head_dim != head_dim or num_heads % num_kv_heads:
            raise ValueError(f"query {tuple(query.shape)} does not fit a cache of {tuple(key_cache.shape)}")
        if block_tables.dtype != torch.int32 or context_lens.dtype != torch.int32:
            raise ValueError("block_tables and context_lens must be int32")
        for tensor in (query, key_cache, value_cache, block_tables, context_lens):
            if tensor.device.type != "cpu" or not tensor.is_contiguous():
                raise ValueError("paged_decode takes contiguous CPU tensors")
        if value_cache.dtype != key_cache.dtype or key_cache.dtype not in (query.dtype, torch.float8_e4m3fn):
            raise ValueError(
                f"query and caches must share one dtype, or the caches be float8_e4m3fn; got {query.dtype}, "
                f"{key_cache.dtype} and {value_cache.dtype}"
            )
        if (window is not None and window < 1) or (softcap is not None and softcap <= 0):
            raise ValueError(f"window must be >= 1 and softcap > 0, got {window} and {softcap}")
        if sinks is not None:
            if sinks.shape != (num_heads,) or sinks.device.type != "cpu":
                raise ValueError(f"sinks must be [{num_heads}] on the CPU, got {tuple(sinks.shape)}")
            sinks = sinks.to(torch.float32).contiguous()
        arguments = (
            query,
            key_cache,
            value_cache,
            block_tables,
            context_lens,
            scale,
            int(split),
            window or 0,
            softcap or 0.0,
            sinks,
            self._function("paged_decode", query.dtype, key_cache.dtype),
        )
        return _dispatch(self._ops.cpu_paged_decode, cpu_ops.paged_decode, *arguments)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x [rows, hidden] contiguous -> a new normalized tensor."""
        fn = self._function("rms_norm", x.dtype)
        return _dispatch(self._ops.cpu_rms_norm, cpu_ops.rms_norm, x, weight, eps, fn)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """residual += x (in place); returns rms_norm(residual). Both [rows, hidden] contiguous."""
        fn = self._function("add_rms_norm", x.dtype)
        return _dispatch(self._ops.cpu_add_rms_norm, cpu_ops.add_rms_norm, x, residual, weight, eps, fn)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up [rows, 2 * width] contiguous -> silu(gate) * up [rows, width]."""
        fn = self._function("silu_and_mul", gate_up.dtype)
        return _dispatch(self._ops.cpu_silu_and_mul, cpu_ops.silu_and_mul, gate_up, fn)

    def gelu_tanh_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up [rows, 2 * width] contiguous -> gelu(gate, approximate="tanh") * up [rows, width] (GeGLU)."""
        fn = self._function("gelu_tanh_and_mul", gate_up.dtype)
        return _dispatch(self._ops.cpu_gelu_tanh_and_mul, cpu_ops.gelu_tanh_and_mul, gate_up, fn)

    def rotary_(
        self, x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor
    ) -> torch.Tensor:
        """Rotate x [rows, heads, head_dim] in place (rows may be strided, heads and dims contiguous): each head's
        first rotary_dim dimensions, the width of the cos / sin tables [positions, rotary_dim]."""
        rows, heads, head_dim = x.shape
        if x.stride(2) != 1 or x.stride(1) != head_dim or positions.dtype != torch.int64:
            raise ValueError("rotary_ takes [rows, heads, head_dim] with contiguous heads and int64 positions")
        rotary_dim = cos.shape[-1]
        if rotary_dim % 2 or rotary_dim > head_dim or sin_signed.shape != cos.shape or not cos.is_contiguous():
            raise ValueError(f"cos / sin tables of width {rotary_dim} do not rotate heads of {head_dim}")
        fn = self._function("rotary", x.dtype)
        _dispatch(self._ops.cpu_rotary_, cpu_ops.rotary_, x, positions, cos, sin_signed, fn)
        return x

    def invariant_linear(
        self, x: torch.Tensor, packed: torch.Tensor, bias: Optional[torch.Tensor], out_features: int, amx: bool = False
    ) -> torch.Tensor:
        """x [rows, in] contiguous, `packed` from `pack_invariant_weight` -> [rows, out_features]; each element
        summed in one fixed order whatever the number of rows (csrc/column_blocks.h). `amx`: bf16 products whose K
        is a multiple of 32 may run on AMX tiles where `amx_tiles` (faster there; their sums grouped by 32 k, so
        other bits than vdpbf16ps's: batch-invariant mode keeps to the latter)."""
        if x.dim() != 2 or not x.is_contiguous() or x.device.type != "cpu":
            raise ValueError("invariant_linear takes x as a contiguous 2-D CPU tensor")
        rows, in_features = x.shape
        if packed.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
            raise ValueError("x, the packed weight and the bias must share one dtype")
        num_blocks = -(-out_features // 64)
        expected = (
            (num_blocks, -(-in_features // 2), 64, 2) if x.dtype == torch.bfloat16 else (num_blocks, in_features, 64)
        )
        if tuple(packed.shape) != expected or not packed.is_contiguous():
            raise ValueError(
                f"packed weight of shape {tuple(packed.shape)}, expected {expected} (contiguous) "
                f"for {out_features} x {in_features}"
            )
        if bias is not None and tuple(bias.shape) != (out_features,):
            raise ValueError(f"bias of shape {tuple(bias.shape)}, expected ({out_features},)")
        fn = self._function("invariant_linear", x.dtype)
        return _dispatch(
            self._ops.cpu_invariant_linear, cpu_ops.invariant_linear, x, packed, bias, out_features, int(amx), fn
        )

    def gemv(self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        """x [rows, in] @ weight [out, in]^T (+ bias [out]) -> [rows, out], all contiguous CPU tensors of one
        dtype; reads the weight once whatever `rows` (csrc/gemv.cpp: for small batches)."""
        if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
            raise ValueError(f"gemv of x {tuple(x.shape)} by a weight of {tuple(weight.shape)}")
        for tensor in (x, weight) if bias is None else (x, weight, bias):
            if tensor.device.type != "cpu" or not tensor.is_contiguous() or tensor.dtype != x.dtype:
                raise ValueError("gemv takes contiguous CPU tensors of one dtype")
        if bias is not None and tuple(bias.shape) != (weight.shape[0],):
            raise ValueError(f"bias of shape {tuple(bias.shape)}, expected ({weight.shape[0]},)")
        fn = self._function("gemv", x.dtype)
        return _dispatch(self._ops.cpu_gemv, cpu_ops.gemv, x, weight, bias, fn)

    def decode_layers(
        self,
        residual: torch.Tensor,
        weights: torch.Tensor,
        key_caches: list[torch.Tensor],
        value_caches: list[torch.Tensor],
        positions: torch.Tensor,
        cos: torch.Tensor,
        sin_signed: torch.Tensor,
        slots: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        heads: int,
        inter: int,
        eps: float,
        scale: float,
        lora: Optional[DecodeLoRA] = None,
        addresses: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
        residual_scale: float = 1.0,
        qk_norm_projection: bool = False,
        gelu: bool = False,
        softcap: float = 0.0,
        layer_table: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """Every layer of a decode step of `rows` sequences, one new token each (csrc/decode_layer.cpp):
        residual [rows, hidden] (the embeddings in, the residual stream after the last layer out) is
        updated in place, K/V written at `slots` [rows] int64 of each layer's cache; returns the last layer's
        MLP output [rows, hidden] as it joined the stream (after its post norm and `residual_scale`, if any).
        `weights` [num_layers, DECODE_WEIGHT_COLUMNS] int64 holds each layer's norm and bias addresses
        and its four matrices (plain or GGUF blocks) as csrc/decode_layer.cpp reads them (`FusedDecode` builds
        it, from weights it checked and the model keeps alive); positions [rows] int64;
        block_tables [rows, width] and context_lens [rows] int32; `lora`: the adapters' deltas added to every
        projection. `addresses`: `cache_addresses(key_caches, value_caches)` of these very caches, kept by a
        caller whose caches stay (read again on every call otherwise). `residual_scale`: each branch's output is
        multiplied by it before it joins the residual stream (Granite's residual_multiplier).
        `qk_norm_projection`: the layers' q and k norms normalize all of q and all of k (OLMo 2), not each head.
        `gelu`: GeGLU MLPs (Gemma), not SwiGLU; `softcap`: the attention scores' (0: none). `cos` and `sin_signed`
        [positions, rotary_dim]: each head's first rotary_dim dimensions rotate (Phi-4-mini's partial rotary; every
        layer's tables that wide). `layer_table`
        [num_layers, DECODE_LAYER_COLUMNS] int64 (None: every layer takes `slots`, `block_tables`,
        `context_lens`, `cos` and `sin_signed` above): per layer its KV group's block tables, context lengths,
        table width and slots, its window (0: none) and its RoPE tables, as csrc/decode_layer.cpp's LayerColumn."""
        rows = residual.shape[0]
        if positions.dtype != torch.int64 or slots.dtype != torch.int64 or positions.shape[0] != rows:
            raise ValueError("decode_layers takes int64 positions and slots, one per row")
        if block_tables.dtype != torch.int32 or context_lens.dtype != torch.int32 or block_tables.shape[0] != rows:
            raise ValueError("decode_layers takes int32 block tables and context lengths, one per row")
        for tensor in (residual, positions, slots, block_tables, context_lens):
            if tensor.device.type != "cpu" or not tensor.is_contiguous():
                raise ValueError("decode_layers takes contiguous CPU tensors")
        if (
            weights.dtype != torch.int64
            or weights.dim() != 2
            or weights.shape[1] != DECODE_WEIGHT_COLUMNS
            or not weights.is_contiguous()
        ):
            raise ValueError(
                f"decode_layers takes a contiguous int64 weight table of {DECODE_WEIGHT_COLUMNS} "
                f"columns per layer, got {weights.dtype} {tuple(weights.shape)}"
            )
        if len(key_caches) != weights.shape[0] or len(value_caches) != weights.shape[0]:
            raise ValueError(f"{weights.shape[0]} layers of weights for {len(key_caches)} caches")
        cache_dtype = key_caches[0].dtype
        if any(cache.dtype != cache_dtype for cache in (*key_caches, *value_caches)):
            raise ValueError("decode_layers takes caches of one dtype")
        if layer_table is not None and (
            layer_table.dtype != torch.int64
            or tuple(layer_table.shape) != (weights.shape[0], DECODE_LAYER_COLUMNS)
            or not layer_table.is_contiguous()
        ):
            raise ValueError(f"decode_layers takes a contiguous int64 layer table of {DECODE_LAYER_COLUMNS} columns")
        if lora is not None and (
            tuple(lora.table.shape) != (weights.shape[0], DECODE_LORA_COLUMNS) or lora.slots.shape[0] != rows
        ):
            raise ValueError("decode_layers takes a LoRA table of 8 addresses per layer and slots for every row")
        head_dim = key_caches[0].shape[-1]
        if (
            cos.dim() != 2
            or cos.shape != sin_signed.shape
            or cos.shape[1] % 2
            or not 0 < cos.shape[1] <= head_dim
            or not (cos.is_contiguous() and sin_signed.is_contiguous())
        ):
            raise ValueError(
                f"decode_layers takes RoPE tables [positions, rotary_dim], rotary_dim even and at most the heads' "
                f"{head_dim}, got {tuple(cos.shape)} and {tuple(sin_signed.shape)}"
            )
        arguments = (
            positions,
            cos,
            sin_signed,
            slots,
            block_tables,
            context_lens,
            *((None,) * 4 if lora is None else (lora.table, lora.slots, lora.scales, lora.ranks)),
            layer_table,
            0 if lora is None else lora.max_rank,
            heads,
            inter,
            qk_norm_projection,
            gelu,
            eps,
            scale,
            residual_scale,
            softcap,
            self._function("decode_layers", residual.dtype, cache_dtype),
        )
        if torch.compiler.is_compiling():
            return self._ops.cpu_decode_layers(residual, weights, key_caches, value_caches, *arguments)
        # eagerly, the operator's kernel itself: the dispatcher's cost is a share of a decode step worth saving
        if addresses is None:
            addresses = cpu_ops.cache_addresses(key_caches, value_caches)
        elif any(len(each) != weights.shape[0] for each in addresses):
            raise ValueError(
                f"{weights.shape[0]} layers of weights for {len(addresses[0])} key and {len(addresses[1])} value "
                "cache addresses"
            )
        return cpu_ops.decode_layers_at(residual, weights, addresses, tuple(key_caches[0].shape), *arguments)

    def lora_add_(
        self,
        x: torch.Tensor,  # [rows, in]
        out: torch.Tensor,  # [rows, sum(widths)]
        a: torch.Tensor,  # [max_loras, parts * max_rank, in]
        b: torch.Tensor,  # [max_loras, parts * max_rank, out]
        slots: torch.Tensor,  # [rows, width] int32, -1: none
        scales: torch.Tensor,  # [rows, width] float32
        ranks: torch.Tensor,  # [max_loras] int32
        widths: Sequence[int],  # each part's output columns
        grouped: bool = True,
    ) -> None:
        """out += each token's LoRA deltas, in place (csrc/lora_delta.h). `grouped` False: each token reads its
        own A rows (benchmarks/lora.py --micro compares)."""
        parts, max_rank = len(widths), a.shape[1] // max(len(widths), 1)
        if not 1 <= parts <= 3 or sum(widths) != out.shape[1] or a.shape[1] != parts * max_rank:
            raise ValueError(f"LoRA stacks {tuple(a.shape)} do not fit parts of widths {tuple(widths)}")
        for tensor in (x, out, a, b, slots, scales, ranks):
            if tensor.device.type != "cpu" or not tensor.is_contiguous():
                raise ValueError("lora_add_ takes contiguous CPU tensors")
        if a.dtype != x.dtype or b.dtype != x.dtype or out.dtype != x.dtype:
            raise ValueError("x, out and the stacks must share one dtype")
        if slots.dtype != torch.int32 or ranks.dtype != torch.int32 or scales.dtype != torch.float32:
            raise ValueError("lora_add_ takes int32 slots and ranks and float32 scales")
        fn = self._function("lora_add", x.dtype)
        arguments = (x, out, a, b, slots, scales, ranks, list(widths), max_rank, int(grouped), fn)
        _dispatch(self._ops.cpu_lora_add_, cpu_ops.lora_add_, *arguments)

    def prefill_attention(
        self,
        query: torch.Tensor,  # [query_len, heads, head_dim] bf16 or float32: the chunk's queries
        key_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim], the chunk's K/V written
        value_cache: torch.Tensor,
        block_table: torch.Tensor,  # [>= blocks of context_len] int32: the sequence's
        context_len: int,  # the cached prefix and the chunk
        scale: float,
    ) -> torch.Tensor:
        """Causal attention of a prompt chunk at positions [context_len - query_len, context_len) over every key
        of its sequence up to its own, read in place from the paged cache (csrc/prefill_attention.cpp for bf16
        queries over bf16 or fp8 caches, prefill_attention_f32.cpp for float32 over float32, bf16 or fp8). Needs
        `prefill_attention_serves(query.dtype, key_cache.dtype)` and a head_dim in PREFILL_HEAD_DIMS."""
        query_len, heads, head_dim = query.shape
        _, block_size, kv_heads, cache_head_dim = key_cache.shape
        function = self._prefill_attention_fns.get((query.dtype, key_cache.dtype))
        if function is None or value_cache.dtype != key_cache.dtype or block_table.dtype != torch.int32:
            raise ValueError(
                f"no prefill attention kernel in this build for {query.dtype} queries over a {key_cache.dtype} "
                f"cache with a {block_table.dtype} block table (bf16 over bf16 or fp8 on AVX512-BF16, float32 over "
                "float32, bf16 or fp8 on AVX-512 or AVX2; int32 tables)"
            )
        if head_dim not in PREFILL_HEAD_DIMS:
            raise ValueError(f"no prefill attention kernel for head_dim {head_dim}")
        if cache_head_dim != head_dim or value_cache.shape != key_cache.shape or heads % kv_heads:
            raise ValueError(f"query {tuple(query.shape)} does not fit a cache of {tuple(key_cache.shape)}")
        if not query_len <= context_len <= block_table.numel() * block_size:
            raise ValueError(f"{query_len} queries at context {context_len} do not fit the block table")
        for tensor in (query, key_cache, value_cache, block_table):
            if tensor.device.type != "cpu" or not tensor.is_contiguous():
                raise ValueError("prefill_attention takes contiguous CPU tensors")
        return self._ops.cpu_prefill_attention(query, key_cache, value_cache, block_table, context_len, scale, function)

    def _function(self, name: str, dtype: torch.dtype, cache_dtype: Optional[torch.dtype] = None) -> int:
        """The entry point of kernel `name` for `dtype` (and a KV cache of `cache_dtype`, by default `dtype`)."""
        function = self._functions.get((name, dtype, dtype if cache_dtype is None else cache_dtype))
        if function is None:
            cache = "" if cache_dtype in (None, dtype) else f" over a {cache_dtype} KV cache"
            raise ValueError(f"the CPU kernels take float32 or bfloat16, not {dtype}{cache}")
        return function


def _c_function(library: ctypes.CDLL, name: str, *argtypes) -> Callable[..., None]:
    """The library's entry point `name`, taking `argtypes` and returning nothing."""
    function = getattr(library, name)
    function.restype = None
    function.argtypes = argtypes
    return function


_REPETITION, _COUNTS = 1, 2
"""A penalized row's flags in logit_processors' table (csrc/logit_processors.cpp's kRepetition, kCounts)."""


def _ids_span(ids: Optional[torch.Tensor]) -> tuple[int, int]:
    """(address, length) of an id tensor's elements; (0, 0) for None."""
    return (0, 0) if ids is None else (ids.data_ptr(), ids.numel())


def _dispatch(operator, kernel, *arguments):
    """`operator(*arguments)` under torch.compile (traced through its fake); eagerly its CPU `kernel` itself, after
    the dispatcher's check that every tensor is on the CPU (the dispatcher's own cost is a share of a step worth
    saving on the per-operation path: docs/performance.md)."""
    if torch.compiler.is_compiling():
        return operator(*arguments)
    for argument in arguments:
        if isinstance(argument, torch.Tensor) and argument.device.type != "cpu":
            raise ValueError(f"{kernel.__name__} takes CPU tensors, got one on {argument.device}")
    return kernel(*arguments)


def load_cpu_kernels(cache_dir: Optional[Path] = None, arch: str = NATIVE_ARCH) -> Optional[CpuKernels]:
    """Build (once per machine, source and `arch`) and load the kernels; None, with the reason logged, if
    unusable."""
    try:
        kernels = CpuKernels(build_library(cache_dir, arch))
        _self_check(kernels)
    except (OSError, RuntimeError, ValueError, subprocess.SubprocessError) as error:
        logger.warning("native CPU kernels unavailable, using the torch backend: %s", error)
        return None
    return kernels


def _self_check(kernels: CpuKernels) -> None:
    """A small decode and a small product against plain torch, so a miscompiled build is never used."""
    generator = torch.Generator().manual_seed(0)
    num_blocks, block_size, kv_heads, head_dim, heads = 6, 4, 2, 8, 4
    keys = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=generator)
    values = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=generator)
    query = torch.randn(2, heads, head_dim, generator=generator)
    tables = torch.tensor([[3, 1, 5], [0, 2, 4]], dtype=torch.int32)
    lens = torch.tensor([9, 4], dtype=torch.int32)
    sinks = torch.randn(heads, generator=generator)
    # plain; a sliding window with soft-capped scores; and with attention sinks
    for window, softcap, sink in ((None, None, None), (5, 1.5, None), (5, 1.5, sinks)):
        got = kernels.paged_decode(query, keys, values, tables, lens, 0.5, window=window, softcap=softcap, sinks=sink)
        for seq in range(2):
            first = 0 if window is None else max(0, int(lens[seq]) - window)
            k = (
                keys[tables[seq]]
                .reshape(-1, kv_heads, head_dim)[first : lens[seq]]
                .repeat_interleave(heads // kv_heads, 1)
            )
            v = (
                values[tables[seq]]
                .reshape(-1, kv_heads, head_dim)[first : lens[seq]]
                .repeat_interleave(heads // kv_heads, 1)
            )
            scores = torch.einsum("hd,thd->ht", query[seq], k) * 0.5
            if softcap is not None:
                scores = softcap * torch.tanh(scores / softcap)
            if sink is not None:  # one more column in the softmax, dropped after
                scores = torch.cat([scores, sink[:, None]], dim=1)
            probs = torch.softmax(scores, dim=-1)[:, : k.shape[0]]
            expected = torch.einsum("ht,thd->hd", probs, v)
            if not torch.allclose(got[seq], expected, atol=1e-5, rtol=1e-4):
                raise RuntimeError(f"{kernels.path} failed its self-check against torch")
    kernels.invariant_product_ok = _invariant_product_ok(kernels, generator)
    if kernels.amx_tiles and not _amx_product_ok(kernels, generator):
        kernels.amx_tiles = False


def _amx_product_ok(kernels: CpuKernels, generator: torch.Generator) -> bool:
    """The column-block product on AMX tiles against a float64 reference: 1, 5 and 17 rows (a partial tile
    of rows, two row groups), K = 64, 70 columns (2 blocks: half blocks) and 200 (4: whole blocks, a column
    tail), a bias."""
    from engine.kernels.column_block_weight import pack_invariant_weight

    for columns in (70, 200):
        weight = torch.randn(columns, 64, generator=generator).bfloat16()
        bias = torch.randn(columns, generator=generator).bfloat16()
        packed = pack_invariant_weight(weight).data
        for rows in (1, 5, 17):
            x = torch.randn(rows, 64, generator=generator).bfloat16()
            got = kernels.invariant_linear(x, packed, bias, columns, amx=True).double()
            reference = x.double() @ weight.double().t() + bias.double()
            if not torch.allclose(got, reference, atol=5e-2, rtol=5e-2):
                logger.warning(
                    "%s: the column-block product on AMX tiles failed its self-check; products stay off the tiles",
                    kernels.path,
                )
                return False
    return True


def _invariant_product_ok(kernels: CpuKernels, generator: torch.Generator) -> bool:
    """The column-block product against a float64 reference, in float32 and in bfloat16 (odd K, a column
    tail; 2 blocks, taken as half blocks, and 4 per thread + 2, taken whole, by 3 and 13 rows). Batch-invariant
    mode, the bf16 product on AVX512-BF16 and the float32 one on AVX2 and AVX-512 depend on it: a failure is
    logged, refuses that mode and keeps those products off it."""
    from engine.kernels.column_block_weight import pack_invariant_weight

    whole_blocks = 4 * torch.get_num_threads() + 2  # csrc/column_blocks.h: half blocks below 4 items per thread
    for columns, k, rows in ((70, 9, 5), (64 * whole_blocks - 6, 33, 3), (64 * whole_blocks - 6, 33, 13)):
        weight, x = torch.randn(columns, k, generator=generator), torch.randn(rows, k, generator=generator)
        for dtype, tolerance in ((torch.float32, 1e-4), (torch.bfloat16, 5e-2)):
            w, xs = weight.to(dtype), x.to(dtype)
            reference = xs.double() @ w.double().t()
            got = kernels.invariant_linear(xs, pack_invariant_weight(w).data, None, columns).double()
            if not torch.allclose(got, reference, atol=tolerance, rtol=tolerance):
                logger.warning(
                    "%s: the column-block %s product failed its self-check; --batch-invariant is "
                    "unavailable and the engine's products stay off it",
                    kernels.path,
                    str(dtype).removeprefix("torch."),
                )
                return False
    return True
