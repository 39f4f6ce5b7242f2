#!/usr/bin/env bash
# One prepared run for a machine with a GPU (about 6 minutes on an H200), results under $OUT:
#   machine.txt         the GPU, driver, torch, CUDA, wrapt, date
#   cuda-tests.txt      the tests that need CUDA (they skip elsewhere)
#   nosync.json         a loop with every rule on under torch.cuda.set_sync_debug_mode("error") (bench/nosync.py)
#   gpu-steps.json      step time, safetorch on vs SAFETORCH_DISABLE=1: GPT-2 small, ResNet-50 (bench/gpu.py)
#   gpu-memory.json     the seed's validation loop: peak memory with and without safetorch
#
# The GPU machine has torch but neither wrapt nor expecttest, and no network. Before the run, on a machine with the
# package registry, fetch their wheels into bench/wheels (git-ignored; carry it):
#
#   pip download --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
#       --platform manylinux_2_17_x86_64 -d bench/wheels "wrapt>=1.17" expecttest
#
# and run, from the repository root:  OUT=/some/dir bash bench/gpu.sh
# `bash bench/gpu.sh --dry-run` runs every step on the CPU at tiny sizes (the test suite does, so that this script
# cannot rot): nothing is installed when wrapt imports, and CPU tensors take the accelerator path.
set -uo pipefail
DRY=0
[ "${1:-}" = "--dry-run" ] && DRY=1
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
if ! "$PY" -c "import wrapt" 2>/dev/null; then
  SITE=$(mktemp -d)
  "$PY" -m pip install -q --no-index --no-deps --find-links bench/wheels -t "$SITE" wrapt expecttest
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
STATUS=0
{
  date -u +"%Y-%m-%dT%H:%M:%SZ"
  if [ $DRY = 1 ]; then echo "dry run: no GPU"; else
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; fi
  "$PY" -c "import torch, wrapt; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'wrapt', wrapt.__version__)"
} > "$OUT/machine.txt" 2>&1
if [ $DRY = 1 ]; then
  DEVICE=cpu; STEPS=20; export SAFETORCH_DEFERRED_CPU=1
else
  DEVICE=cuda; STEPS=1100
  timeout 240 "$PY" -m pytest -q -p no:cacheprovider -k "cuda" tests/ > "$OUT/cuda-tests.txt" 2>&1
  echo "cuda tests exit $?" >> "$OUT/cuda-tests.txt"
fi
SAFETORCH_REPORT=0 timeout 180 "$PY" -m bench.nosync --device $DEVICE --steps $STEPS > "$OUT/nosync.json" 2> "$OUT/nosync.err"
RC=$?; [ $RC = 0 ] || { STATUS=1; echo "nosync exit $RC" >> "$OUT/nosync.err"; }
unset SAFETORCH_DEFERRED_CPU
timeout 420 "$PY" -m bench.gpu --out "$OUT" $([ $DRY = 1 ] && echo --dry-run) > "$OUT/gpu-bench.txt" 2>&1
RC=$?; [ $RC = 0 ] || { STATUS=1; echo "bench exit $RC" >> "$OUT/gpu-bench.txt"; }
cat "$OUT/machine.txt" "$OUT/nosync.json" "$OUT/gpu-bench.txt"
[ $DRY = 1 ] || cat "$OUT/cuda-tests.txt" | tail -5
exit $STATUS
