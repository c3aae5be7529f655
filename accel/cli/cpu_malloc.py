"""The glibc malloc settings `accel launch` gives processes that train on CPUs.

A training step on CPU processes allocates and frees the same large buffers every step: FSDP2's all-gather outputs
and reduce-scatter inputs, gradients, activations. glibc serves a block above its mmap threshold with a fresh
mapping, unmapped when freed, and hands the top of its heap back to the system once more than its trim threshold is
free there. It raises both thresholds only as far as the largest mapped block freed so far (128 KiB at start; the
trim threshold twice that), so a step that frees more than that at the top of the heap gives it back and faults it
in again the next step: about 3,000 page faults a step on each rank of benchmarks/fsdp2_job.py's GPT-2 under FSDP2,
a fifth of its step time. With blocks up to 32 MiB served from the heap (the ceiling glibc's own adjustment stops
at) and up to 256 MiB kept free at the top of the heap, the same memory is reused: about 70 faults a step.

This is torch's own advice for CPU training made automatic: `torch.backends.xeon.run_cpu` preloads tcmalloc or
jemalloc when it finds one, allocators that keep freed memory the same way. The cost is memory a process keeps after
it freed it: at most 256 MiB more at the top of each heap. The launch sets `GLIBC_TUNABLES` for its ranks only when
they train on CPUs (`--cpu`, or no CUDA device), and leaves it alone when:
- `ACCEL_CPU_MALLOC_TUNING` is false (`0`, `false`, `no`, `off`; another word that is not a boolean is an error);
- the user already chose either threshold (in `GLIBC_TUNABLES`, or the older `MALLOC_MMAP_THRESHOLD_` /
  `MALLOC_TRIM_THRESHOLD_` variables).
Tunables the user set for other things are kept; the two settings are appended. Allocators other than glibc's
(a preloaded jemalloc, musl) ignore them.
"""

from __future__ import annotations

from collections.abc import Mapping

from accel.cli.errors import CommandError
from accel.env_vars import parse_bool

SWITCH = "ACCEL_CPU_MALLOC_TUNING"
MMAP_THRESHOLD = "glibc.malloc.mmap_threshold"
TRIM_THRESHOLD = "glibc.malloc.trim_threshold"
SETTINGS = ((MMAP_THRESHOLD, 32 << 20), (TRIM_THRESHOLD, 256 << 20))
# glibc's older spellings of the same two settings: a user who set either has chosen.
_OLD_VARIABLES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")


def malloc_env(trains_on_cpu: bool, environ: Mapping[str, str]) -> dict[str, str]:
    """`{"GLIBC_TUNABLES": ...}` for ranks that train on CPUs, unless switched off or the user chose; else `{}`."""
    if not trains_on_cpu or not _switched_on(environ.get(SWITCH, "")):
        return {}
    existing = environ.get("GLIBC_TUNABLES", "")
    if _user_chose(existing, environ):
        return {}
    ours = ":".join(f"{name}={value}" for name, value in SETTINGS)
    return {"GLIBC_TUNABLES": f"{existing}:{ours}" if existing else ours}


def _user_chose(tunables: str, environ: Mapping[str, str]) -> bool:
    names = {entry.split("=", 1)[0].strip() for entry in tunables.split(":") if entry}
    return bool(names & {MMAP_THRESHOLD, TRIM_THRESHOLD}) or any(name in environ for name in _OLD_VARIABLES)


def _switched_on(switch: str) -> bool:
    if not switch.strip():
        return True
    try:
        return parse_bool(switch, SWITCH)
    except ValueError as error:
        raise CommandError(str(error)) from None
