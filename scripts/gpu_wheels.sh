#!/usr/bin/env bash
# Download the wheels the GPU machine's Python lacks into .gpu-wheels/ (ignored by git), for
# scripts/gpu_check.sh. That machine runs CPython 3.12 on x86-64 Linux with torch, triton,
# transformers, tokenizers, safetensors, numpy, pyyaml, tqdm and jinja2, but without pydantic,
# which engine/ and scheduler/ import (their configs are pydantic models). pydantic-core is
# compiled: its cp312 manylinux wheel is taken. typing-extensions comes too: pydantic needs a
# newer one than the image may hold (the target directory shadows it for the check only).
#
#   scripts/gpu_wheels.sh            # needs pip and PyPI here; about 3 MB
#
# Versions: those installed in the Python that runs this (.venv's when present: what the tests
# ran with), else the pins below. Override the target with GPU_PYTHON_VERSION (default 3.12).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -n "${PYTHON:-}" ]; then python=$PYTHON
elif [ -x .venv/bin/python ]; then python=.venv/bin/python
else python=python3; fi
version=${GPU_PYTHON_VERSION:-3.12}
dest=.gpu-wheels

declare -A pins=([pydantic]=2.14.4 [pydantic-core]=2.50.5 [annotated-types]=0.8.0
                 [typing-inspection]=0.4.5 [typing-extensions]=4.16.0)
specs=()
for name in pydantic pydantic-core annotated-types typing-inspection typing-extensions; do
    installed=$("$python" -c 'import importlib.metadata as m, sys; print(m.version(sys.argv[1]))' "$name" \
                2>/dev/null || true)
    specs+=("$name==${installed:-${pins[$name]}}")
done

rm -rf "$dest"  # one version of each: two would stop the install there
mkdir -p "$dest"
"$python" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version "$version" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$dest" "${specs[@]}"
ls -l "$dest"
echo "carry .gpu-wheels with scripts/gpu_check.sh (it installs them with pip --no-index --find-links)"
