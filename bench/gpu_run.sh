#!/usr/bin/env bash
# The GPU check in one command, from the repository root on the GPU machine (issue 32):
#     bash bench/gpu_run.sh            # results and logs into $OUT (the run tool's folder; else artifacts/gpu-run)
# 1. bench/gpu.py (SmolLM2-1.7B and -135M shapes, random weights, bf16; first: what a run is for), 2. the `gpu` tests
#    of tests/decoding/test_graph.py (no host sync in a decode step, a recall replayed exactly, batched = alone).
# Installs nothing from the network: pytest, Pillow and pydantic come from artifacts/gpu/wheels (appended to the path:
# the machine's own packages come first), the tokenizer from artifacts/gpu/tokenizer (both made by
# bench/gpu_prepare.sh; carry "artifacts/gpu").
# About 6-8 minutes on an H200 (bench budget 340 s, then the tests ~60-120 s; under the run tool's 600 s a command);
# each part has its own timeout (TESTS_TIMEOUT=0: no tests, a second call's), and the bench skips what its budget
# cannot fit (a measure is started only when its estimated cost fits the time left).
set -uo pipefail
OUT=${OUT:-artifacts/gpu-run}
mkdir -p "$OUT"
PY=${PY:-python}
command -v "$PY" >/dev/null || PY=python3
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
export PYTHONPATH="$PWD:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}"  # tests/: the helpers the tests import (--noconftest)
TESTS_TIMEOUT=${TESTS_TIMEOUT:-180}
BENCH_BUDGET=${BENCH_BUDGET:-340}
{
  echo "== $(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null)"
  "$PY" -c "import sys, torch, transformers; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__, 'gpu', torch.cuda.is_available())"
  if ls artifacts/gpu/wheels/*.whl >/dev/null 2>&1; then  # what the machine lacks (its own packages come first)
    for w in artifacts/gpu/wheels/*.whl; do "$PY" -m zipfile -e "$w" /tmp/gpu-site; done
    export PYTHONPATH="$PYTHONPATH:/tmp/gpu-site"
    echo "wheels from artifacts/gpu/wheels: $(ls artifacts/gpu/wheels | tr '\n' ' ')"
  else
    echo "!! no artifacts/gpu/wheels: no pytest (the gpu tests) nor the chat service (bench/gpu_prepare.sh here first)"
  fi
  echo "== 1. bench/gpu.py (budget ${BENCH_BUDGET} s)"
  t0=$(date +%s)
  timeout $(( BENCH_BUDGET + 75 )) "$PY" bench/gpu.py --out "$OUT" --budget "$BENCH_BUDGET" "$@"
  echo "== bench: exit $? in $(( $(date +%s) - t0 )) s"
  if [ "$TESTS_TIMEOUT" != 0 ]; then
    echo "== 2. gpu tests (timeout ${TESTS_TIMEOUT} s)"
    t0=$(date +%s)
    timeout "$TESTS_TIMEOUT" "$PY" -m pytest -p no:cacheprovider -o addopts="" --noconftest -p no:logging -m gpu \
      -rfEsp -q --junitxml="$OUT/gpu_tests.xml" tests/decoding/test_graph.py
    echo "== gpu tests: exit $? in $(( $(date +%s) - t0 )) s"
  else
    echo "== 2. gpu tests: not run (TESTS_TIMEOUT=0)"
  fi
} 2>&1 | tee -a "$OUT/gpu_run.log"
