#!/usr/bin/env bash
# The first thing to run on a GPU machine (no network): by default the Triton kernels' six steps (about 7 minutes
# on one H100/H200: the bin-0 index_add_ hypothesis, the fused site kernel's GB/s and contract, the flash + statistics
# kernel against SDPA and eager attention, the whole profiled forward eager and graphed, kernel against wall time,
# DIFF's attention); `--steps all` adds the earlier steps (the GPU benchmark sections, results-cuda.json; a bf16
# profile against fp32; one real low-bit backend's kernel; the GPU recipe's first minutes: about 7 more minutes),
# `--steps NAME...` runs any; one JSON summary, $OUT/gpu_check.json, written after every step
# (benchmarks/gpu_check.py holds the steps and their limits).
#
#     bash benchmarks/gpu_check.sh               # on the GPU machine; exit 0 when every step is ok
#     bash benchmarks/gpu_check.sh --steps kernels   # the Triton kernels' steps only (issue 47; about 7 minutes)
#     bash benchmarks/gpu_check.sh --cpu-smoke   # anywhere: every step on CPU with tiny settings (the suite runs it)
#
# The GPU machine reaches no package registry: what its Python lacks travels as wheels in .whl/ in the checkout
# (copied to the machine with it), installed there into /tmp/gpu_check-site first. Fetch them once where pip
# works, for the GPU machine's Python (its `python3 --version`; 3.12 below) and processor:
#     echo /.whl/ >> .git/info/exclude
#     python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#         --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#         -d .whl transformers==5.25.0 torchao==0.18.0 huggingface_hub==2.4.0 httpx2==2.17.0 httpcore2==2.17.0 \
#         truststore==0.10.5 hf-xet==1.8.0 kernels==0.19.1 regex==2026.12.2 click==8.5.1 gguf==0.19.0
# (the set that ran on an H100 on 2026-12-05, 26 MB, beside an image with torch 2.11, transformers 5.17 and
# huggingface_hub 1.33). Every prerequisite is checked up front, one line each. This script installs whatever
# .whl/ holds, also with --cpu-smoke: move the folder away before running the test suite on another Python.
# The recipe step is stopped at its time limit on purpose (its summary says "stopped at the limit": not a failure).
# Settings: OUT (summary folder, default /tmp/gpu_check-out), GPU_CHECK_MODEL (a transformers folder to profile
# in bf16, e.g. SmolLM2-135M saved with save_pretrained; default the tiny preset), GPU_CHECK_BACKEND (default
# torchao-int8wo), GPU_CHECK_WORK (scratch, default /tmp/gpu_check), PYTHON (default python3).
set -uo pipefail
cd "$(dirname "$0")/.."
SMOKE=()
STEPS=()
for arg in "$@"; do
    case "$arg" in
        --cpu-smoke) SMOKE=(--cpu-smoke) ;;
        --steps) STEPS=(--steps) ;;
        -h|--help) sed -n '2,27p' "$0"; exit 0 ;;
        *) if [ ${#STEPS[@]} -gt 0 ]; then STEPS+=("$arg"); else
               echo "gpu_check.sh: unknown argument $arg (--cpu-smoke, --steps NAME..., or none)"; exit 2; fi ;;
    esac
done
PY=${PYTHON:-python3}
command -v "$PY" >/dev/null || { echo "MISSING $PY: no Python on this machine"; exit 2; }
echo "ok $PY: $("$PY" --version 2>&1)"
if compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/gpu_check-site \
        .whl/*.whl || { echo "FAILED installing the wheels in .whl/ (one version of each?)"; exit 2; }
    export PYTHONPATH=/tmp/gpu_check-site${PYTHONPATH:+:$PYTHONPATH}
    echo "ok wheels from .whl/: $(cd .whl && ls *.whl | tr '\n' ' ')"
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export OUT=${OUT:-/tmp/gpu_check-out} HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
exec "$PY" -m benchmarks.gpu_check "${SMOKE[@]}" "${STEPS[@]}" --out "$OUT"
