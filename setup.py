"""Builds accel's one native extension, ``accel._C``, from ``csrc/``.

Environment toggles:
  ACCEL_BUILD_NATIVE  unset: build it, and if the compile fails print why and install pure Python;
                      1: build it or fail the install; 0: pure-Python install, no compiler needed.
  ACCEL_BUILD_CUDA    unset: add csrc/cuda/*.cu when torch is a CUDA build and nvcc is found;
                      1: always add them (fails without nvcc); 0: never.
  DEBUG               1: -O0 -g instead of -O3.

Build with ``pip install --no-build-isolation .`` so the extension is compiled against the torch you run.
The build writes ``accel/_build_info.json`` (torch/CUDA/Python versions, CPU capability, or the compile
error) that ``accel env`` and the loader read.
"""

import glob
import json
import os
import platform
import sys
import tempfile

from setuptools import setup


def env_toggle(name):
    """Returns True/False for 1/0 (yes/no, true/false) and None when the variable is unset or empty."""
    value = os.environ.get(name, "").strip().lower()
    if not value:
        return None
    if value in ("1", "yes", "true", "on"):
        return True
    if value in ("0", "no", "false", "off"):
        return False
    raise SystemExit(f"{name}={value!r}: expected 0 or 1")


def cuda_wanted(torch, cuda_home):
    forced = env_toggle("ACCEL_BUILD_CUDA")
    if forced is not None:
        return forced
    return torch.version.cuda is not None and cuda_home is not None


# Compiled once per CPU instruction set, each copy in its own namespace (see csrc/cpu/vec/grad_kernels.h).
VEC_SOURCES = sorted(glob.glob("csrc/cpu/vec/*.cpp"))
HEADERS = sorted(glob.glob("csrc/**/*.h", recursive=True))


def cpu_isa_variants():
    """(name, flags) of each copy of VEC_SOURCES: a generic one everywhere, AVX2 and AVX512 on x86-64."""
    variants = [("DEFAULT", [])]
    if platform.machine().lower() in ("x86_64", "amd64") and sys.platform != "win32":
        variants.append(("AVX2", ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY_AVX2"]))
        variants.append(
            (
                "AVX512",
                ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c", "-DCPU_CAPABILITY_AVX512"],
            )
        )
    return variants


def get_extensions():
    if env_toggle("ACCEL_BUILD_NATIVE") is False:
        return []
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME, CppExtension, CUDAExtension
    except ImportError as exc:
        if env_toggle("ACCEL_BUILD_NATIVE"):
            raise
        print(f"accel: torch is not importable ({exc}); installing pure Python", file=sys.stderr)
        return []
    debug = env_toggle("DEBUG")
    cxx_flags = ["-O0", "-g"] if debug else ["-O3"]
    sources = ["csrc/ops.cpp"]
    # CPU kernels, the shared-memory core, its torch bindings, the lease-guarded checkpoint mapping
    for folder in ("cpu", "shm", "shm_bindings", "leased_mapping"):
        sources += sorted(glob.glob(f"csrc/{folder}/*.cpp"))
    variants = cpu_isa_variants()
    args = {
        "extra_compile_args": {"cxx": cxx_flags + ["-fopenmp"]},
        "extra_link_args": ["-fopenmp"],
        "define_macros": [(f"ACCEL_CPU_{name}", "1") for name, _ in variants if name != "DEFAULT"],
        "depends": VEC_SOURCES + HEADERS,
    }
    if cuda_wanted(torch, CUDA_HOME):
        # No --use_fast_math: it flushes denormals, and kernels must match torch's results bit for bit.
        args["extra_compile_args"]["nvcc"] = ["-O0", "-g"] if debug else ["-O3"]
        args["define_macros"].append(("ACCEL_WITH_CUDA", "1"))
        extension = CUDAExtension("accel._C", sources + sorted(glob.glob("csrc/cuda/*.cu")), **args)
    else:
        extension = CppExtension("accel._C", sources, **args)
    extension.accel_isa_variants = variants
    return [extension]


def build_info(extensions, error=None):
    import torch

    info = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda if any(src.endswith(".cu") for ext in extensions for src in ext.sources) else None,
        "python": platform.python_version(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu_kernels": [name for ext in extensions for name, _ in getattr(ext, "accel_isa_variants", [])],
        "platform": platform.platform(),
        "native": bool(extensions) and error is None,
    }
    if error is not None:
        info["build_error"] = error[-4000:]
    return info


def run_logged(function, log):
    """Runs function() with fd 1 (where ninja and the compiler print) copied into `log` too."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(log.fileno(), 1)
    try:
        function()
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)
        log.seek(0)
        sys.stdout.write(log.read().decode(errors="replace"))


def compiler_errors(log, limit=20):
    """The compiler's error lines from the build log: what a user needs to see in `accel env`."""
    log.seek(0)
    lines = log.read().decode(errors="replace").splitlines()
    return "\n".join([line for line in lines if "error" in line.lower()][:limit])


def build_ext_class():
    """torch's BuildExtension, made optional unless ACCEL_BUILD_NATIVE=1, and recording build_info."""
    try:
        from torch.utils.cpp_extension import BuildExtension
    except ImportError:
        return {}

    class OptionalBuildExtension(BuildExtension):
        def run(self):
            error = None
            with tempfile.TemporaryFile() as log:
                try:
                    run_logged(super().run, log)
                except Exception as exc:  # noqa: BLE001 - any compile failure falls back to pure Python
                    if env_toggle("ACCEL_BUILD_NATIVE"):
                        raise
                    error = f"{type(exc).__name__}: {exc}\n{compiler_errors(log)}"
                    print(f"accel: native build failed, installing pure Python:\n{error}", file=sys.stderr)
            self.write_build_info(error)

        def build_extension(self, ext):
            ext.extra_objects = [*ext.extra_objects, *self.compile_isa_variants(ext)]
            super().build_extension(ext)

        def compile_isa_variants(self, ext):
            """Objects of VEC_SOURCES, once per instruction set, each under its own flags and ninja file."""
            cxx = ext.extra_compile_args["cxx"] if isinstance(ext.extra_compile_args, dict) else ext.extra_compile_args
            objects = []
            for name, flags in getattr(ext, "accel_isa_variants", []):
                objects += self.compiler.compile(
                    VEC_SOURCES,
                    output_dir=os.path.join(self.build_temp, f"isa-{name.lower()}"),
                    macros=ext.define_macros,
                    include_dirs=ext.include_dirs,
                    debug=self.debug,
                    extra_postargs=[*cxx, f"-DCPU_CAPABILITY=ACCEL_{name}", *flags],
                    depends=ext.depends,
                )
            return objects

        def write_build_info(self, error):
            target = os.path.join(os.path.dirname(self.get_ext_fullpath("accel._C")), "_build_info.json")
            os.makedirs(os.path.dirname(target), exist_ok=True)
            with open(target, "w") as f:
                json.dump(build_info(self.extensions, error), f, indent=2)

        def get_outputs(self):
            # A failed optional build produced no .so; don't let install look for one.
            return [p for p in super().get_outputs() if os.path.exists(p)]

    return {"build_ext": OptionalBuildExtension.with_options(use_ninja=True)}


# Installed into site-packages: at every interpreter start, turns on `import accelerate` -> accel when the environment
# asks for it (accel/accelerate_alias.py). With the switch off it costs two environment lookups.
ALIAS_PTH = "accel_as_accelerate.pth"
ALIAS_PTH_LINE = (
    'import os; ("ACCEL_AS_ACCELERATE" in os.environ or "ACCELERATE_AS_ACCELERATE" in os.environ) '
    'and __import__("accel.accelerate_alias").accelerate_alias.install_if_asked()\n'
)


def write_alias_pth(folder):
    with open(os.path.join(folder, ALIAS_PTH), "w") as f:
        f.write(ALIAS_PTH_LINE)
    return os.path.join(folder, ALIAS_PTH)


def alias_pth_classes():
    """build_py puts the .pth at the root of a wheel (site-packages); an editable install gets it through the
    folder setuptools turns into its editable wheel's root."""
    from setuptools.command.build_py import build_py
    from setuptools.command.editable_wheel import editable_wheel

    class BuildPyWithAliasPth(build_py):
        def run(self):
            super().run()
            write_alias_pth(self.build_lib)

        def get_outputs(self, include_bytecode=True):
            return [*super().get_outputs(include_bytecode), os.path.join(self.build_lib, ALIAS_PTH)]

    class EditableWheelWithAliasPth(editable_wheel):
        # setuptools writes everything in this folder (its unpacked wheel) into the editable wheel.
        def _install_namespaces(self, installation_dir, pth_prefix):
            super()._install_namespaces(installation_dir, pth_prefix)
            write_alias_pth(installation_dir)

    return {"build_py": BuildPyWithAliasPth, "editable_wheel": EditableWheelWithAliasPth}


setup(ext_modules=get_extensions(), cmdclass={**build_ext_class(), **alias_pth_classes()})
