#!/usr/bin/env bash
# bash bench/gpu.sh      (on a machine with a CUDA GPU; on one without a registry, run bash bench/gpu_wheels.sh first)
# The GPU checks of bench/gpu.py in one call, under 8 minutes on one H200; the last line printed is one JSON
# object. Without CUDA it prints a JSON line saying it skipped and exits 0. Extra arguments go to bench/gpu.py.
# Installs the carried wheels (.whl/) into a temporary folder put on PYTHONPATH, with --no-deps: the image's
# torch and everything else it has stay untouched (never `pip install -e .`, whose torch pin would replace them).
set -uo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
LIMIT_S=${GPU_BENCH_LIMIT_S:-450}   # hard stop; bench/gpu.py stops starting sections at --budget-s (430)
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=offline PYTHONUNBUFFERED=1

fail() {  # one JSON line even when the python part never ran
  "$PYTHON" -c 'import json,sys; print(json.dumps({"bench": "gpu", "ok": False, "error": sys.argv[1]}))' "$1"
  exit 1
}

if ! "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 3)' 2>/dev/null; then
  exec "$PYTHON" bench/gpu.py "$@"   # no CUDA: it prints the skipped line (or runs --device cpu)
fi

if compgen -G ".whl/*.whl" >/dev/null; then
  SITE=$(mktemp -d "${TMPDIR:-/tmp}/bpd-site.XXXXXX")
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
    || fail "pip install of the carried wheels (.whl/) failed: rebuild them with bash bench/gpu_wheels.sh"
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# the decoding sections need none of the carried packages: a broken one fails the training section, in the JSON
"$PYTHON" -c 'import hydra, omegaconf, datasets, deepspeed' >/dev/null 2>&1 \
  || echo "gpu.sh: hydra/omegaconf/datasets/deepspeed do not all import (see \"packages\" in the JSON);" \
          "on a node without internet access: bash bench/gpu_wheels.sh first (docs/GPU.md)" >&2

PARTIAL=$(mktemp "${TMPDIR:-/tmp}/bpd-gpu-partial.XXXXXX")
timeout -k 10 "$LIMIT_S" "$PYTHON" bench/gpu.py --partial "$PARTIAL" "$@"
rc=$?
if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
  # killed at the hard stop: report what finished
  "$PYTHON" - "$PARTIAL" "$LIMIT_S" <<'EOF'
import json, sys
try:
    r = json.loads(open(sys.argv[1]).read() or "{}")
except ValueError:
    r = {}
r.update(bench="gpu", ok=False, timed_out=True, error=f"killed after {sys.argv[2]} s")
print(json.dumps(r))
EOF
fi
rm -f "$PARTIAL"
exit "$rc"
