#!/usr/bin/env bash
# bash bench/gpu_wheels.sh            (here, with registry access; then run bench/gpu.sh on the device: docs/GPU.md)
# Downloads into .whl/ (git-ignored) exactly the packages bench/gpu.sh needs that the device image lacks, as wheels
# for its python (CPython 3.12, manylinux x86_64), each with --no-deps so nothing the image already has (torch above
# all) is fetched or replaced. Versions are this project's pins (pyproject.toml) and, for their own needs, the
# versions our pinned environment resolved. wandb is left out: the GPU runs log with logger=csv.
set -euo pipefail
cd "$(dirname "$0")/.."

OUT=${WHEELS_DIR:-.whl}
# building deepspeed's wheel imports torch: use a python that has it (the project venv), never a build-isolated one
PYTHON=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
LIMIT_MB=64   # what one device call carries in all (working tree + carried paths)

# published as wheels: fetched for the device's interpreter and platform
BINARY=(
  hydra-core==1.3.8 omegaconf==2.3.1                       # configs (train.py)
  datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19        # corpus loading; dill/multiprocess: datasets' needs
  hjson==3.1.0 pydantic==2.14.4 pydantic-core==2.50.5      # deepspeed's needs missing from the image
  annotated-types==0.8.0 typing-inspection==0.4.5          # pydantic's needs missing from the image
)
# published as source only: pure python, built here into py3-none-any wheels
SOURCE=(antlr4-python3-runtime==4.9.3)                     # omegaconf's grammar runtime
DEEPSPEED=deepspeed==0.19.8                                # DS_BUILD_OPS=0: no compiled ops; JIT on the GPU if asked

# more pins for a second try, if the device's JSON says an image package is too old for these (e.g. "pyarrow==26.0.1")
read -r -a EXTRA <<< "${GPU_WHEELS_EXTRA:-}"
BINARY+=("${EXTRA[@]}")

PLATFORM=(--python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
          --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64)

mkdir -p "$OUT"
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: "${PLATFORM[@]}" -d "$OUT" "${BINARY[@]}"
"$PYTHON" -m pip wheel -q --no-deps -w "$OUT" "${SOURCE[@]}"
DS_BUILD_OPS=0 "$PYTHON" -m pip wheel -q --no-deps --no-build-isolation -w "$OUT" "$DEEPSPEED"

# one version of each package: two would stop the install on the device
dups=$(ls "$OUT"/*.whl | xargs -n1 basename | cut -d- -f1 | tr '[:upper:]_' '[:lower:]-' | sort | uniq -d)
if [ -n "$dups" ]; then
  echo "gpu_wheels: $OUT holds several versions of: $dups -- delete $OUT and run this again" >&2
  exit 1
fi
n=$(ls "$OUT"/*.whl | wc -l)
kb=$(du -sk "$OUT" | cut -f1)
echo "gpu_wheels: $n wheels, $((kb / 1024)) MiB in $OUT (limit ${LIMIT_MB} MiB per device call, repo included)"
if [ "$kb" -gt $((LIMIT_MB * 1024)) ]; then
  echo "gpu_wheels: $OUT is over ${LIMIT_MB} MiB: it cannot travel to the device" >&2
  exit 1
fi
