"""Compiles every csrc/cuda/*.cu file with nvcc and torch's CUDA headers, without linking or running.

Machines without a GPU (like CI) still catch CUDA compile errors this way. Run it with a Python whose torch
is a CUDA build (tools/cuda_compile_check.sh makes one). Arch: $TORCH_CUDA_ARCH_LIST, default 9.0 (H100/H200).
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import torch
from torch.utils import cpp_extension

ROOT = Path(__file__).resolve().parent.parent


def nvcc_command(source: Path, output: Path) -> list[str]:
    includes = [*cpp_extension.include_paths(device_type="cuda"), sysconfig.get_paths()["include"]]
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    arch = os.environ.get("TORCH_CUDA_ARCH_LIST", "9.0").replace(".", "")
    return [
        os.path.join(cpp_extension.CUDA_HOME, "bin", "nvcc"),
        "-c",
        str(source),
        "-o",
        str(output),
        *(f"-I{path}" for path in includes),
        *cpp_extension.COMMON_NVCC_FLAGS,
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        "-DTORCH_EXTENSION_NAME=_C",
        "-DACCEL_WITH_CUDA=1",
        "-std=c++20",
        "--compiler-options",
        "-fPIC",
        "-O3",
        f"-gencode=arch=compute_{arch},code=sm_{arch}",
    ]


def main() -> int:
    if torch.version.cuda is None or cpp_extension.CUDA_HOME is None:
        print(f"cuda compile check: needs a CUDA torch and CUDA_HOME (torch {torch.__version__}, CUDA_HOME unset)")
        return 1
    sources = sorted((ROOT / "csrc" / "cuda").glob("*.cu"))
    failed = []
    with tempfile.TemporaryDirectory() as tmp:
        for source in sources:
            start = time.perf_counter()
            result = subprocess.run(
                nvcc_command(source, Path(tmp) / f"{source.stem}.o"), capture_output=True, text=True
            )
            status = "ok" if result.returncode == 0 else "FAILED"
            print(f"cuda compile check: {source.relative_to(ROOT)} {status} ({time.perf_counter() - start:.0f} s)")
            if result.returncode != 0:
                print(result.stdout + result.stderr)
                failed.append(source.name)
    print(f"cuda compile check: {len(sources) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
