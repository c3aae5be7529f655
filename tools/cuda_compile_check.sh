#!/usr/bin/env bash
# Compile-checks csrc/cuda/*.cu against a CUDA build of torch, in a venv cached outside the clone
# ($ACCEL_CUDA_VENV, default ~/.cache/accel/cuda-venv-torch2.14.1). Skips, saying so, when nvcc is absent.
set -euo pipefail
cd "$(dirname "$0")/.."

nvcc_path=$(command -v nvcc || true)
if [ -z "$nvcc_path" ]; then
  echo "cuda compile check: SKIPPED (nvcc not on PATH)"
  exit 0
fi
# nvcc on PATH may be a wrapper script; the toolkit root is where the real binary lives.
real_nvcc=$(grep -oE '/[^ ]*/bin/nvcc' "$nvcc_path" 2>/dev/null | head -1 || true)
export CUDA_HOME=${CUDA_HOME:-$(dirname "$(dirname "$(readlink -f "${real_nvcc:-$nvcc_path}")")")}

venv=${ACCEL_CUDA_VENV:-$HOME/.cache/accel/cuda-venv-torch2.14.1}
if ! "$venv/bin/python" -c "import torch, sys; sys.exit(torch.version.cuda is None)" 2>/dev/null; then
  echo "cuda compile check: creating $venv (torch==2.14.1, a CUDA build; takes a few minutes once)"
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q torch==2.14.1 "setuptools>=64"
fi
site=$("$venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
export CPATH="$site/nvidia/cu13/include${CPATH:+:$CPATH}"
# -W: the CUDA venv has no numpy, and torch warns about that at import.
exec "$venv/bin/python" -W ignore::UserWarning tools/cuda_compile_check.py
