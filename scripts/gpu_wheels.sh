#!/usr/bin/env bash
# Download the wheels the GPU machine's Python lacks into .gpu-wheels/ (ignored by git), for
# scripts/gpu_check.sh. That machine runs CPython 3.12 on x86-64 Linux with torch (CUDA 13), triton,
# transformers, tokenizers, safetensors, numpy, pyyaml, tqdm, jinja2, einops, protobuf and
# cuda-bindings, but without pydantic, which engine/ and scheduler/ import (their configs are
# pydantic models), and without flash-attn.
#
#   scripts/gpu_wheels.sh                  # pydantic and its needs: .gpu-wheels/a, about 3 MB
#   scripts/gpu_wheels.sh --flash-attn-4   # and flash-attn 4 with its CUTLASS DSL: about 100 MB more
#
# pydantic-core is compiled: its cp312 manylinux wheel is taken. typing-extensions comes too:
# pydantic needs a newer one than the image may hold (gpu_check.sh installs a carried wheel only
# where the machine lacks it or has it older, into a target directory that shadows it for the check).
# Versions: those installed in the Python that runs this (.venv's when present: what the tests ran
# with), else the pins below.
#
# flash-attn 4: the distributions `pip install --dry-run --report 'flash-attn-4[cu13]>=4.0.0b5'`
# resolved, less those the image has (torch, einops, protobuf, cuda-bindings, cuda-pathfinder,
# typing-extensions) and less nvidia-cutlass-dsl-libs-cu12 (the CUTLASS DSL loads whichever CUDA
# flavour is installed; the machine's torch and driver are CUDA 13). The cu13 libraries are one
# 92 MB wheel, more than one call of the device tool carries (64 MiB, the repository included), so
# wheels over CHUNK_MB are split: the first part goes into .gpu-wheels/a with every other wheel,
# the rest into .gpu-wheels/b, and gpu_check.sh joins the parts (checked against their SHA-256)
# before installing. Carry them in two calls of the device tool, less than 30 s apart (the
# machine stays warm that long and keeps ignored files between calls): first carry
# [".gpu-wheels/b"] with a command that only lists them, then carry [".gpu-wheels/a"] and run
# scripts/gpu_check.sh. Where part b is missing the check runs without flash-attn 4 and says why.
#
# Override the target Python with GPU_PYTHON_VERSION (default 3.12), the part size with CHUNK_MB.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -n "${PYTHON:-}" ]; then python=$PYTHON
elif [ -x .venv/bin/python ]; then python=.venv/bin/python
else python=python3; fi
version=${GPU_PYTHON_VERSION:-3.12}
chunk_mb=${CHUNK_MB:-40}
dest=.gpu-wheels
flash=0
case "${1:-}" in
    --flash-attn-4) flash=1 ;;
    "") ;;
    *) echo "usage: $0 [--flash-attn-4]" >&2; exit 2 ;;
esac

declare -A pins=([pydantic]=2.14.4 [pydantic-core]=2.50.5 [annotated-types]=0.8.0
                 [typing-inspection]=0.4.5 [typing-extensions]=4.16.0)
specs=()
for name in pydantic pydantic-core annotated-types typing-inspection typing-extensions; do
    installed=$("$python" -c 'import importlib.metadata as m, sys; print(m.version(sys.argv[1]))' "$name" \
                2>/dev/null || true)
    specs+=("$name==${installed:-${pins[$name]}}")
done
if [ "$flash" = 1 ]; then
    specs+=(flash-attn-4==4.0.0b36 nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1
            nvidia-cutlass-dsl-libs-core==4.8.1 nvidia-cutlass-dsl-libs-cu13==4.8.1 apache-tvm-ffi==0.1.15.post2
            quack-kernels==0.6.5 torch-c-dlpack-ext==0.1.5)
fi

rm -rf "$dest"  # one version of each: two would stop the install there
mkdir -p "$dest/a"
"$python" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version "$version" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$dest/a" "${specs[@]}"

for wheel in "$dest"/a/*.whl; do
    if [ "$(stat -c %s "$wheel")" -gt $((chunk_mb * 1024 * 1024)) ]; then
        (cd "$dest/a" && sha256sum "$(basename "$wheel")" >"$(basename "$wheel").sha256")
        split -b "${chunk_mb}M" "$wheel" "$wheel.part-"
        rm "$wheel"
        mkdir -p "$dest/b"
        for part in "$wheel".part-*; do
            [ "$part" = "$wheel.part-aa" ] || mv "$part" "$dest/b/"
        done
    fi
done
du -sh "$dest"/*
if [ -d "$dest/b" ]; then
    echo "carry .gpu-wheels/b in one device call, then .gpu-wheels/a with scripts/gpu_check.sh in the next"
else
    echo "carry .gpu-wheels with scripts/gpu_check.sh (it installs them with pip --no-index --no-deps)"
fi
