"""`accel env`: the facts to paste into a bug report, including why the native kernels are or are not used."""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import sys


def system_ram_gib() -> float:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1024**3


def accel_location() -> str:
    # A venv's bin/ need not be on PATH; the accel next to this Python is the one that runs.
    search = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])
    return shutil.which("accel", path=search) or "Not found"


def platform_facts() -> dict[str, str]:
    import numpy
    import torch

    import accel

    facts = {
        "`accel` version": accel.__version__,
        "Platform": platform.platform(),
        "`accel` bash location": accel_location(),
        "Python version": platform.python_version(),
        "Numpy version": numpy.__version__,
        "PyTorch version": f"{torch.__version__} (GPU? {torch.cuda.is_available()})",
        "PyTorch accelerator": "CUDA" if torch.cuda.is_available() else "N/A",
        "System RAM": f"{system_ram_gib():.2f} GB",
    }
    if torch.cuda.is_available():
        facts["GPU type"] = torch.cuda.get_device_name()
    return facts


def native_facts() -> dict[str, str]:
    import torch

    from accel import _ext

    status = _ext.try_load()
    info = status.build_info
    built = (
        f"torch {info.get('torch')}, Python {info.get('python')}, CPU capability {info.get('cpu_capability')}"
        if info.get("torch")
        else "no build info"
    )
    if info.get("build_error"):
        built = f"FAILED ({built})"
    facts = {
        "accel native kernels": "loaded" if status.loaded else "NOT loaded",
        "native build": built,
        "CPU capability (running)": torch.backends.cpu.get_cpu_capability(),
        # grad_kernels.cpp is compiled once per instruction set; the running capability picks one.
        "vectorized CPU kernels built for": ", ".join(info.get("cpu_kernels", [])) or "none",
        "CUDA kernels": "yes" if status.cuda_kernels else f"no{' (CPU-only build)' if not info.get('cuda') else ''}",
    }
    if not status.loaded:
        facts["why not loaded"] = status.reason
        facts["how to fix"] = status.fix
    facts["shared-memory transport"] = transport_fact(status.loaded)
    return facts


def transport_fact(native_loaded: bool) -> str:
    """What same-host collectives will use, as far as this process can tell (the group decides at run time)."""
    from accel.wire.shm_transport import requested_transport

    try:
        choice = requested_transport()
    except ValueError as error:
        return f"misconfigured: {error}"
    if choice == "torch" or not native_loaded:
        return f"off ({'ACCEL_TRANSPORT=torch' if choice == 'torch' else 'needs the native kernels'})"
    return f"ACCEL_TRANSPORT={choice}, {available_memory()}"


def available_memory() -> str:
    """MemAvailable: the segments are anonymous memory files (memfd), not files in /dev/shm."""
    try:
        with open("/proc/meminfo") as meminfo:
            kib = next(int(line.split()[1]) for line in meminfo if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return "available memory unknown"
    return f"{kib / 2**20:.1f} GiB of memory available for its segments"


def config_facts(config_file: str | None) -> tuple[str, dict | str]:
    from accel.cli.config_file import ConfigError, find_config_file, load_config

    path = config_file or find_config_file()
    if path is None:
        return "Not found", "Not found"
    try:
        return str(path), load_config(path).to_dict()
    except ConfigError as exc:
        return str(path), f"unusable: {exc}"


def print_report(facts: dict, config_path: str, config: dict | str) -> None:
    print("\nCopy-and-paste the text below in your GitHub issue\n")
    # Multi-line values (a compiler error) stay visibly inside their item.
    print("\n".join(f"- {name}: {value}".replace("\n", "\n\t") for name, value in facts.items()))
    print(f"- `accel` config ({config_path}):")
    if isinstance(config, dict):
        print("\n".join(f"\t- {key}: {value}" for key, value in config.items()))
    else:
        print(f"\t{config}")


def alias_fact(config: dict | str) -> str:
    """Whether `import accelerate` resolves to accel: in this process, or in ranks the config file launches."""
    from accel import accelerate_alias

    if accelerate_alias.installed() or accelerate_alias.asked():
        return f"on: `import accelerate` resolves to accel ({accelerate_alias.describe()})"
    if isinstance(config, dict) and config.get("as_accelerate"):
        return (
            f"on in ranks that `accel launch` starts (config file: as_accelerate: true; {accelerate_alias.describe()})"
        )
    return "off (`accel launch --as_accelerate`, ACCEL_AS_ACCELERATE=1 or accel.as_accelerate() turn it on)"


def run_env(args: argparse.Namespace) -> int:
    config_path, config = config_facts(args.config_file)
    facts = {**platform_facts(), **native_facts(), "accel as accelerate": alias_fact(config)}
    print_report(facts, config_path, config)
    sys.stdout.flush()
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("env", help="print the environment, for bug reports", allow_abbrev=False)
    parser.add_argument(
        "--config_file", "--config-file", default=None, help="config file to show (default: the default one)"
    )
    parser.set_defaults(run=run_env)
