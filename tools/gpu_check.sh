#!/usr/bin/env bash
# The checks that need a GPU, as one script for a machine with CUDA and a CUDA build of torch already installed
# (`python3 -c "import torch; assert torch.cuda.is_available()"`): builds accel with its CUDA kernels in place,
# then runs every GPU-marked test and the native-op tests on the GPU. Output goes to $OUT (default build/gpu).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-build/gpu}
mkdir -p "$out"
python3 -c "import torch, sys; print('torch', torch.__version__, 'cuda', torch.version.cuda); sys.exit(not torch.cuda.is_available())"
python3 -m pip install -q --no-build-isolation --no-deps -e . 2>&1 | tail -3 || true
ACCEL_BUILD_NATIVE=1 ACCEL_BUILD_CUDA=1 python3 setup.py -q build_ext --inplace 2>&1 | tail -5
python3 -c "from accel import _ext; s = _ext.status(); print(s); assert s.loaded and s.cuda_kernels"
python3 -m pytest -q -p no:cacheprovider -m gpu tests/ --junitxml="$out/gpu-tests.xml" 2>&1 | tee "$out/gpu-tests.txt"
python3 -m pytest -q -p no:cacheprovider tests/ops tests/checkpoint/test_safetensors_io.py 2>&1 | tail -5 | tee -a "$out/gpu-tests.txt"
