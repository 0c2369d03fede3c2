#!/usr/bin/env bash
# Contract tests of the agent's vLLM / SGLang adapters on the engines' own route code.
# Fetches the pinned releases' wheels from PyPI (pip download --no-deps, cached under
# .ci-work/engines/), unpacks their Python sources, and runs integration/engines/ with them on
# PYTHONPATH; heavy dependencies (torch, triton, CUDA kernels) are shimmed, see
# integration/engines/shims.py and stub_engines.py.
#
# Moving to a newer release: change the two versions below, run this script, and read the
# diff of the route files named in docs/engines/*.md between the old and new unpacked trees.
set -euo pipefail
VLLM_VERSION=0.33.0
SGLANG_VERSION=0.5.23
# What the route modules import for real (pure Python or small wheels), pinned.
PY_DEPS=(fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 pydantic==2.14.3 msgspec==0.22.0 orjson==3.13.0
  transformers==5.23.0 openai==3.54.0 anthropic==2.12.0 regex cachetools python-multipart jinja2 jsonschema dill
  uvloop aiohttp requests numpy pyzmq psutil prometheus_client pyyaml cloudpickle pytest safetensors ml_dtypes)

cd "$(dirname "$0")/.."
root=$(pwd)
w=.ci-work/engines
mkdir -p "$w/wheels"
if [ ! -x "$w/venv/bin/python" ]; then python3 -m venv "$w/venv"; fi
"$w/venv/bin/pip" install -q --disable-pip-version-check "${PY_DEPS[@]}"
src="$w/src-vllm-$VLLM_VERSION-sglang-$SGLANG_VERSION"
if [ ! -d "$src" ]; then
  pip_dl() { "$w/venv/bin/pip" download -q --disable-pip-version-check --no-deps --only-binary :all: \
    --python-version 3.11 -d "$w/wheels" "$1"; }
  pip_dl "vllm==$VLLM_VERSION"
  pip_dl "sglang==$SGLANG_VERSION"
  rm -rf "$src.tmp" && mkdir -p "$src.tmp"
  (cd "$src.tmp" && unzip -q -o "$root/$w"/wheels/vllm-"$VLLM_VERSION"-*.whl 'vllm/*.py' \
    && unzip -q -o "$root/$w"/wheels/sglang-"$SGLANG_VERSION"-*.whl 'sglang/*')
  mv "$src.tmp" "$src"
fi
bin=${DRIFTLESS_BIN:-$root/target/debug/driftless}
[ -x "$bin" ] || cargo build -q -p driftless-cli
PYTHONPATH="$root/$src" DRIFTLESS_BIN="$bin" "$w/venv/bin/python" -m pytest -q integration/engines "$@"
