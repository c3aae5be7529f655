#!/usr/bin/env bash
# The checks that need a GPU (`make gpu-check`), as one script for a machine with CUDA and a CUDA build of torch
# already installed: builds accel with its CUDA kernels in place, then runs every test marked gpu or native_cuda
# and the native-op tests on the GPU. Any failure stops it with a non-zero status, naming the step; each step's
# full output is kept in $OUT (default build/gpu).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-build/gpu}
python=${PYTHON:-python3}
mkdir -p "$out"

step() {  # step NAME COMMAND...: runs COMMAND with its output in $out/NAME.log; on failure shows its end and stops
  local name=$1
  shift
  echo "gpu-check: $name"
  if ! "$@" >"$out/$name.log" 2>&1; then
    tail -n 40 "$out/$name.log"
    echo "gpu-check: FAILED at $name (full output: $out/$name.log)" >&2
    exit 1
  fi
  tail -n 3 "$out/$name.log"
}

step torch "$python" -c "import torch, sys; print('torch', torch.__version__, 'cuda', torch.version.cuda); sys.exit(not torch.cuda.is_available())"
step install env ACCEL_BUILD_NATIVE=1 ACCEL_BUILD_CUDA=1 "$python" -m pip install --no-build-isolation --no-deps -e .
step build env ACCEL_BUILD_NATIVE=1 ACCEL_BUILD_CUDA=1 "$python" setup.py build_ext --inplace
step kernels "$python" -c "from accel import _ext; s = _ext.status(); print(s); assert s.loaded and s.cuda_kernels, s"
step gpu-tests "$python" -m pytest -q -p no:cacheprovider -m "gpu or native_cuda" tests/ --junitxml="$out/gpu-tests.xml"
step op-tests "$python" -m pytest -q -p no:cacheprovider tests/ops tests/checkpoint/test_safetensors_io.py
echo "gpu-check: passed"
