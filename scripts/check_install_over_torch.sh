#!/usr/bin/env bash
# Shows that `pip install -e ".[http]"` installs on top of an existing torch without replacing it:
# a fresh venv first gets a torch other than our CPU pin (default 2.14.1, a CUDA build, as on a GPU
# machine), then the project with its http extra, a real install with dependencies; torch's
# version and files must be the same afterwards, and the package must import against it.
#   scripts/check_install_over_torch.sh [python]      (TORCH_VERSION=2.14.1 by default)
# Too heavy for CI (the CUDA torch wheels are ~2.7 GB); run by hand: docs/deployment.md ("Installing on a
# GPU machine") says what a run showed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-python3}
TORCH_VERSION=${TORCH_VERSION:-2.14.1}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
VENV=$WORK/venv
"$PY" -m venv "$VENV"
PIP="$VENV/bin/pip"
start=$(date +%s)
"$PIP" install -q "torch==$TORCH_VERSION"
torch_state() {
  "$VENV/bin/python" - <<'PY'
import hashlib, importlib.metadata as md
dist = md.distribution("torch")
record = dist.read_text("RECORD") or ""
print(dist.version, hashlib.sha256(record.encode()).hexdigest()[:16], len(record.splitlines()), "files")
PY
}
before=$(torch_state)
echo "torch before: $before  ($(( $(date +%s) - start )) s)"
start=$(date +%s)
"$PIP" install -e ".[http]" > "$WORK/install.log" 2>&1 || { tail -30 "$WORK/install.log"; exit 1; }
grep -iE "^(Requirement already satisfied: torch|Successfully installed)" "$WORK/install.log" | cut -c1-400
after=$(torch_state)
echo "torch after:  $after  ($(( $(date +%s) - start )) s for the project)"
"$VENV/bin/python" -c "
import torch, av, fastapi, uvicorn
import async_cosyvoice.audio_encoding, grpc_async.client
print('imports OK with torch', torch.__version__)"
"$PIP" check
if [ "$before" != "$after" ]; then
  echo "FAIL: installing the project changed torch ($before -> $after)"; exit 1
fi
echo "OK: torch $TORCH_VERSION untouched"
