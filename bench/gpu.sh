#!/usr/bin/env bash
# One prepared run for a machine with a GPU: the CUDA tests, then the whole bench, results under $OUT.
#
# The GPU machine has torch (for its Python 3.12) but neither wrapt nor expecttest, and no network. Before the
# run, on a machine with the package registry, fetch their wheels into bench/wheels (git-ignored; carry it):
#
#   pip download --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
#       --platform manylinux_2_17_x86_64 -d bench/wheels "wrapt>=1.17" expecttest
#
# and run, from the repository root:  OUT=/some/dir bash bench/gpu.sh
set -uo pipefail
OUT=${OUT:-$(mktemp -d)}
SITE=$(mktemp -d)
python3 -m pip install -q --no-index --no-deps --find-links bench/wheels -t "$SITE" wrapt expecttest
export PYTHONPATH="$PWD:$SITE"
{
  date -u +"%Y-%m-%dT%H:%M:%SZ"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, wrapt; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'wrapt', wrapt.__version__)"
} > "$OUT/machine.txt" 2>&1
# The tests that need CUDA (they skip elsewhere), then the whole suite on the GPU machine.
python3 -m pytest -q -p no:cacheprovider -k "cuda" tests/ > "$OUT/cuda-tests.txt" 2>&1
echo "cuda tests exit $?" >> "$OUT/cuda-tests.txt"
SAFETORCH_REPORT=0 timeout 420 python3 -m bench --json "$OUT/gpu-bench.json" > "$OUT/gpu-bench.md" 2>&1
echo "bench exit $?" >> "$OUT/gpu-bench.md"
cat "$OUT/machine.txt" "$OUT/cuda-tests.txt" "$OUT/gpu-bench.md"
