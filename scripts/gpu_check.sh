#!/usr/bin/env bash
# The GPU check (issue 7), in one run of a few minutes on a machine with an NVIDIA GPU:
#   (a) numerics and (d) TensorRT: the pytest tests marked gpu (tests/test_gpu_*.py), then
#   (b) the AOT PTX launched as TensorRT launches it, (c) the bandwidth table, (e) device pools and (f) kernels
#       recorded as CUDA graphs: scripts/gpu_check.py, whose table
#       (OUT/gpu_check.md) lists the tests' verdicts too.
#
#   bash scripts/gpu_check.sh [--dry-run]      # from any directory
#
# v4engine need not be installed: this checkout is installed into a throwaway folder, without its dependencies (the
# machine's Python has torch, triton, onnx, ...) and without network (no package index; the machine's setuptools
# builds it). --dry-run, on a machine without a GPU (tests/test_gpu_check.py): the same install, the gpu tests
# collected but not run, and the driver's --dry-run.
#
# Environment: OUT (results folder, default ./gpu-check-out), PYTHON (default python3), GPU_CHECK_TEST_LIMIT (seconds
# after which the tests are interrupted, default 230) and GPU_CHECK_TIME_LIMIT (seconds after which the driver starts
# no new check, default 170; it is interrupted 30 s later). Interrupted like Ctrl-C, each step still writes its
# results; it is killed 20 s later if it does not stop: the whole run stays under 8 minutes. Reads the GPU's
# description with nvidia-smi and never changes its settings. Exit status: the driver's (0 pass, 1 a check or test
# failed, 2 checks not started at the time limit), or 1 if only pytest failed.
set -euo pipefail
case "${1:-}" in
    "" | --dry-run) ;;
    *) echo "usage: bash scripts/gpu_check.sh [--dry-run]" >&2; exit 2 ;;
esac

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
mkdir -p "${OUT:-gpu-check-out}"
OUT_DIR="$(cd "${OUT:-gpu-check-out}" && pwd)"
TEST_LIMIT="${GPU_CHECK_TEST_LIMIT:-230}"
LIMIT="${GPU_CHECK_TIME_LIMIT:-170}"
unset TRITON_INTERPRET     # the driver compiles kernels (tests/conftest.py sets it for the tests where no GPU is)

SITE="$(mktemp -d)"
trap 'rm -rf "$SITE"' EXIT
"$PYTHON" -m pip install --quiet --no-deps --no-index --no-build-isolation --target "$SITE" "$REPO"
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"

echo "gpu: $(nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap --format=csv,noheader 2>/dev/null \
             || echo 'nvidia-smi not available')"
cd "$REPO"
if [ "${1:-}" = --dry-run ]; then
    "$PYTHON" -m pytest -p no:cacheprovider -m gpu --collect-only -q tests/test_gpu_*.py
    "$PYTHON" scripts/gpu_check.py --dry-run --out "$OUT_DIR"
    exit
fi

rm -f "$OUT_DIR/tests.xml"          # the driver must not read an earlier run's verdicts
tests=0
timeout --signal=INT --kill-after=20 "$TEST_LIMIT" \
    "$PYTHON" -m pytest -p no:cacheprovider -m gpu -rfEs -o junit_family=xunit1 --junitxml "$OUT_DIR/tests.xml" \
    tests/test_gpu_*.py 2>&1 | tee "$OUT_DIR/tests.log" || tests=$?
check=0
timeout --signal=INT --kill-after=20 "$((LIMIT + 30))" \
    "$PYTHON" scripts/gpu_check.py --out "$OUT_DIR" --tests "$OUT_DIR/tests.xml" --time-limit "$LIMIT" || check=$?
exit $((check ? check : tests ? 1 : 0))
