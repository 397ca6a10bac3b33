#!/usr/bin/env bash
# GPU check of the Triton kernels (issue 7): numerics vs the PyTorch references, the AOT PTX launched with
# TensorRT's arguments through cupy, timings vs eager and the memory-bandwidth floor, TensorRT if importable.
# See scripts/gpu_check.py for what is checked and how.
#
#   bash scripts/gpu_check.sh [--quick] [--cpu-dry-run]      # from any directory; needs no pip install
#
# Environment: OUT (details folder, default ./gpu-check-out), PYTHON (default python3), GPU_CHECK_TIME_LIMIT
# (seconds after which no new check starts, default 200; the run is killed 60 s later). Reads the GPU's
# description with nvidia-smi and never changes its settings. Exit status: the driver's (0 pass, 1 a check
# failed, 2 checks skipped at the time limit), 124 (137) if killed at the hard limit.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
OUT_DIR="${OUT:-gpu-check-out}"
LIMIT="${GPU_CHECK_TIME_LIMIT:-200}"

# v4engine is a namespace package whose parts live at the top of the repository (pyproject.toml's
# package-dir): a folder holding v4engine/<part> -> $REPO/<part> links makes `import v4engine.plugins`
# work from this checkout, without installing anything.
SHIM="$(mktemp -d)"
trap 'rm -rf "$SHIM"' EXIT
mkdir "$SHIM/v4engine"
for part in builder plugins runtime triton_repo; do
    if [ -d "$REPO/$part" ]; then ln -s "$REPO/$part" "$SHIM/v4engine/$part"; fi
done
export PYTHONPATH="$SHIM${PYTHONPATH:+:$PYTHONPATH}"

echo "gpu: $(nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap --format=csv,noheader 2>/dev/null \
             || nvidia-smi -L 2>/dev/null || echo 'nvidia-smi not available')"

status=0
timeout --signal=TERM --kill-after=15 "$((LIMIT + 60))" \
    "$PYTHON" "$REPO/scripts/gpu_check.py" --out "$OUT_DIR" --time-limit "$LIMIT" "$@" || status=$?
exit "$status"
