"""What `make gpu-check` (tools/gpu_check.sh) brought back from a GPU machine -> OUT_DIR/gpu.md; prints its goals.

    python benchmarks/report/gpu.py OUT_DIR RESULTS_DIR [RERUN_DIR ...]

RESULTS_DIR is the run's results.tar.gz unpacked (it holds summary.txt and results/): machine.json (GPU, driver,
CUDA, torch), gpu-tests.xml, and the pytest-benchmark JSON files of the steps that ran. The folders of reruns on
the same machine (GPU_CHECK_STEPS naming the steps to run again) may follow: what a later one holds replaces the
earlier one's, step by step. A step that failed or did not run leaves its section saying so. Times are medians
over interleaved rounds; ratios the median of the per-round ratios with their interquartile range in brackets
(higher: accel faster).
"""

from __future__ import annotations

import json
import statistics
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import gather as gather_report
import process_group as process_group_report
import scaffold
from scaffold import MISSING, per_round_ratio, quartile_ratio, row, time_in

SETS = {"small": "1,000 × 1–10 Ki", "large": "200 × 40,000"}
UNSCALE_VARIANTS = ["accel", "hf", "accel_fallback", "op_accel", "op_torch", "limit"]
SAVE = [  # (sample, label)
    ("accel", "accel `save_model` (default: complete on return, fsync in the background)"),
    ("accel_async", "accel, `async_save=True` (pinned snapshot on return)"),
    ("accel_durable", "accel, `durable=True` (GPU memory streamed through pinned buffers, fsync'd)"),
    ("hf", "HF Accelerate 1.15 `save_model`"),
    ("d2h", "limit: device-to-host copy into pinned memory"),
    ("raw_write", "limit: one write of the bytes to a new file"),
    ("raw_write_fsync", "limit: the same write, then fsync"),
]
LOAD = [
    ("accel", 'accel `load_checkpoint_and_dispatch(device_map={"": 0})`'),
    ("hf", "HF Accelerate 1.15, the same call"),
    ("accel_in_place", "accel `load_checkpoint_in_model` into a GPU model (native reader into GPU memory)"),
    ("hf_in_place", "HF Accelerate 1.15 `load_checkpoint_in_model` into a GPU model"),
    ("read_limit", "limit: the file read once into host memory"),
    ("h2d", "limit: host-to-device copy from pinned memory"),
]
GATHER_PAYLOADS = ["64B", "4KiB", "256KiB", "4MiB", "32MiB"]


def read_results(folder: Path) -> dict:
    """Everything the run left: {"machine", "steps", "tests", and one entry per benchmark JSON present}."""
    results = folder / "results" if (folder / "results").is_dir() else folder
    found: dict = {"machine": {}, "steps": [], "tests": None}
    if (results / "machine.json").exists():
        found["machine"] = json.loads((results / "machine.json").read_text())
    summary = folder / "summary.txt"
    if summary.exists():
        found["steps"] = parse_steps(summary.read_text())
    if (results / "gpu-tests.xml").exists():
        found["tests"] = parse_junit(results / "gpu-tests.xml")
    for name in (
        "bench-unscale-cuda",
        "bench-checkpoint-cuda",
        "bench-big-model-cuda",
        "bench-gather-cuda",
        "bench-allreduce-4",
        "bench-allreduce-8",
        "bench-gather-4",
    ):
        path = results / f"{name}.json"
        # an empty file: the step crashed before pytest-benchmark wrote it
        found[name] = scaffold.load([str(path)])[0] if path.exists() and path.stat().st_size else []
    return found


def parse_steps(text: str) -> list[tuple[str, str, str, str]]:
    """(step, status, seconds, note) of summary.txt's table."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("step ")), None)
    steps = []
    for line in lines[start + 1 :] if start is not None else []:
        if not line.strip() or line.startswith("-----"):
            break
        name, rest = line[:19].strip(), line[19:]
        status, seconds, note = rest[:29].strip(), rest[29:38].strip(), rest[38:].strip()
        steps.append((name, status, seconds, note))
    return steps


def parse_junit(path: Path) -> dict:
    """Counts of the GPU tests, the failed ones and the reasons tests were skipped (with how many each)."""
    root = ElementTree.parse(path).getroot()
    cases = root.iter("testcase")
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    failed, skipped = [], {}
    for case in cases:
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        if case.find("failure") is not None or case.find("error") is not None:
            counts["failed"] += 1
            failed.append(name)
        elif case.find("skipped") is not None:
            counts["skipped"] += 1
            reason = case.find("skipped").get("message", "").strip()
            skipped[reason] = skipped.get(reason, 0) + 1
        else:
            counts["passed"] += 1
    return {"counts": counts, "failed": failed, "skipped": skipped}


# --- sections ------------------------------------------------------------------------------------------------------


def machine_table(machine: dict) -> list[str]:
    if not machine:
        return ["The run left no machine.json (its env step did not run)."]
    packages = machine.get("packages", {})
    rows = [
        row(
            "GPU",
            f"{machine.get('gpu')} × {machine.get('gpu_count')} (compute capability "
            f"{machine.get('capability')}, {machine.get('gpu_memory_gib')} GiB)",
        ),
        row("NVIDIA driver", machine.get("driver") or MISSING),
        row("CUDA", f"{machine.get('torch_cuda')} (torch's); nvcc: {machine.get('nvcc') or MISSING}"),
        row("torch", f"{machine.get('torch')}, cuDNN {machine.get('cudnn')}, triton {packages.get('triton')}"),
        row("Python", machine.get("python")),
        row(
            "HF Accelerate / transformers / safetensors",
            f"{packages.get('accelerate')} / {packages.get('transformers')} / {packages.get('safetensors')}",
        ),
        row("CPU", f"{machine.get('cpu')}, {machine.get('cpu_count')} CPUs, {machine.get('ram_gib')} GiB RAM"),
        row("benchmark files", f"`{machine.get('bench_dir')}`: {machine.get('bench_dir_filesystem')}"),
    ]
    return scaffold.table(["", ""], rows)


def run_section(found: dict) -> list[str]:
    lines = scaffold.table(["step", "status", "seconds", "what it did"], [row(*step) for step in found["steps"]])
    tests = found["tests"]
    if tests is None:
        return [*lines, "", "No test results (the tests step did not run)."]
    counts = tests["counts"]
    lines += [
        "",
        f'GPU tests (`-m "gpu or native_cuda"`): {counts["passed"]} passed, {counts["failed"]} failed, '
        f"{counts['skipped']} skipped.",
    ]
    lines += [f"- failed: `{name}`" for name in tests["failed"]]
    lines += [f"- skipped ({n}): {reason}" for reason, n in sorted(tests["skipped"].items())]
    return lines


def _ratio(info: dict, slower: str, faster: str) -> dict | None:
    """slower/faster per round; quartiles within the values measured (a GPU run has few rounds)."""
    samples = info.get("samples", {})
    return per_round_ratio(samples.get(slower), samples.get(faster), method="inclusive")


def _median(info: dict, name: str) -> float | None:
    times = info.get("samples", {}).get(name)
    return statistics.median(times) if times else None


def unscale_cases(found: dict) -> dict:
    return {(info["set"], info["dtype"]): info for _, info in found["bench-unscale-cuda"]}


def unscale_table(cases: dict) -> list[str]:
    rows = []
    order = lambda kv: (list(SETS).index(kv[0][0]), ["fp32", "fp16", "bf16"].index(kv[0][1]))  # noqa: E731
    for (set_name, dtype), info in sorted(cases.items(), key=order):
        m = {v: _median(info, v) for v in UNSCALE_VARIANTS}
        rows.append(
            row(
                SETS[set_name],
                dtype,
                time_in(m["accel"], 1e3, 3),
                time_in(m["hf"], 1e3, 3),
                quartile_ratio(_ratio(info, "hf", "accel"), 2),
                quartile_ratio(_ratio(info, "accel_fallback", "accel"), 2),
                time_in(m["op_accel"], 1e3, 3),
                time_in(m["op_torch"], 1e3, 3),
                quartile_ratio(_ratio(info, "op_torch", "op_accel"), 2),
                quartile_ratio(_ratio(info, "op_torch", "accel"), 2),
                time_in(m["limit"], 1e3, 3),
            )
        )
    header = [
        "gradients",
        "dtype",
        "accel ms",
        "HF ms",
        "**HF / accel**",
        "accel fallback / accel",
        "op: accel ms",
        "op: torch foreach ms",
        "**torch foreach / accel op**",
        "torch foreach / accel",
        "limit ms",
    ]
    return scaffold.table(header, rows)


def _ms_rate(info: dict, name: str) -> str:
    seconds = _median(info, name)
    if seconds is None:
        return MISSING
    return f"{seconds * 1e3:,.0f} ms ({info.get('bytes', 0) / seconds / 2**30:.2f} GiB/s)"


def _range(info: dict, name: str) -> str:
    samples = sorted(info.get("samples", {}).get(name, []))
    return MISSING if len(samples) < 2 else f"{samples[0] * 1e3:,.0f}–{samples[-1] * 1e3:,.0f} ms"


def save_table(info: dict) -> list[str]:
    rows = []
    for name, label in SAVE:
        after = _median(info, f"{name}_durable_after")
        versus_hf = quartile_ratio(_ratio(info, "hf", name), 2) if name != "hf" else MISSING
        rows.append(
            row(
                label,
                _ms_rate(info, name),
                _range(info, name),
                MISSING if after is None else f"{after * 1e3:,.0f} ms",
                versus_hf,
            )
        )
    return scaffold.table(["what the caller waits for", "median", "range", "until durable", "HF / this"], rows)


def load_table(info: dict) -> list[str]:
    rows = [
        row(
            label,
            _ms_rate(info, name),
            _range(info, name),
            MISSING if name in ("hf", "hf_in_place") else quartile_ratio(_ratio(info, "hf", name), 2),
        )
        for name, label in LOAD
    ]
    return scaffold.table(["load into GPU memory", "median", "range", "HF dispatch / this"], rows)


def gather_gpu_table(found: dict) -> list[str]:
    cases = {info["payload"]: info for _, info in found["bench-gather-cuda"]}
    rows = []
    for payload in GATHER_PAYLOADS:
        if payload not in cases:
            continue
        info = cases[payload]
        t = info["median_s"]
        rows.append(
            row(
                payload,
                time_in(t.get("limit"), 1e6),
                time_in(t.get("accel"), 1e6),
                time_in(t.get("hf"), 1e6),
                quartile_ratio(info.get("hf/accel")),
            )
        )
    return scaffold.table(["payload", "copy on the GPU µs", "accel µs", "HF µs", "**HF / accel**"], rows)


def cpu_reductions(found: dict) -> dict:
    reductions, _ = process_group_report.split(found["bench-allreduce-4"] + found["bench-allreduce-8"])
    return reductions


# --- goals ---------------------------------------------------------------------------------------------------------


def goals(found: dict) -> list[tuple[str, str, bool | None]]:
    """(goal, measured, met: True/False, or None when not measured)."""
    checks: list[tuple[str, str, bool | None]] = []

    def ratio_goal(goal: str, value: dict | None, at_least: float) -> None:
        checks.append((goal, quartile_ratio(value, 2), None if value is None else value["median"] >= at_least))

    cases = unscale_cases(found)
    for dtype in ("fp32", "fp16"):
        info = cases.get(("large", dtype))
        ratio_goal(
            f"unscale+clip ≥ 1.5× torch's foreach path, 200 large {dtype} grads (op level)",
            None if info is None else _ratio(info, "op_torch", "op_accel"),
            1.5,
        )
        ratio_goal(
            f"unscale+clip ≥ 1.5× torch's foreach path, 200 large {dtype} grads (public clip_grad_norm_)",
            None if info is None else _ratio(info, "op_torch", "accel"),
            1.5,
        )
    for (set_name, dtype), info in sorted(cases.items()):
        ratio_goal(f"clip_grad_norm_ not slower than HF ({set_name}, {dtype})", _ratio(info, "hf", "accel"), 1.0)
    save = next((info for group, info in found["bench-checkpoint-cuda"] if group.startswith("save_model")), None)
    load = next((info for group, info in found["bench-big-model-cuda"]), None)
    ratio_goal(
        "save_model from GPU memory ≥ 2× HF (default mode)", None if save is None else _ratio(save, "hf", "accel"), 2.0
    )
    ratio_goal(
        "load_checkpoint_and_dispatch to GPU memory ≥ 2× HF", None if load is None else _ratio(load, "hf", "accel"), 2.0
    )
    for _, info in found["bench-gather-cuda"]:
        ratio_goal(
            f"pad_across_processes + gather on 1 GPU not slower than HF ({info['payload']})", info.get("hf/accel"), 1.0
        )
    reductions = cpu_reductions(found)
    four = reductions.get((4, "64B"))
    latency = None if four is None else four["median_s"]["accel"]
    checks.append(
        (
            "all_reduce ≤ 35 µs at 64 B on 4 ranks",
            time_in(latency, 1e6) + " µs" if latency else MISSING,
            None if latency is None else latency <= 35e-6,
        )
    )
    for world in (4, 8):
        info = reductions.get((world, "32MiB"))
        ratio_goal(f"all_reduce ≥ 5× gloo at 32 MiB on {world} ranks", info and info["gloo/accel"], 5.0)
    return checks


def goals_table(checks: list[tuple[str, str, bool | None]]) -> list[str]:
    verdict = {True: "met", False: "**NOT met**", None: "not measured"}
    rows = [row(goal, value, verdict[met]) for goal, value, met in checks]
    return scaffold.table(["goal (issue 25)", "measured", ""], rows)


# --- the page ------------------------------------------------------------------------------------------------------


def _missing(found: dict, name: str, step: str) -> list[str]:
    return [] if found[name] else [f"Not measured: the {step} step left no results (see the run table)."]


def page(found: dict) -> list[str]:
    machine = found["machine"]
    save = next((info for group, info in found["bench-checkpoint-cuda"] if group.startswith("save_model")), {})
    load = next((info for _, info in found["bench-big-model-cuda"]), {})
    reductions = cpu_reductions(found)
    gathers = gather_report.by_case(found["bench-gather-4"])
    gib = f"{save.get('bytes', load.get('bytes', 0)) / 2**30:g} GiB"
    return [
        "# accel on one GPU: measured results (issue 25)",
        "",
        "Generated by `python benchmarks/report/gpu.py docs/benchmarks RESULTS_DIR` from one `make gpu-check` run",
        "(tools/gpu_check.sh, everything in one run on the machine below): the build with CUDA kernels, the GPU-marked",
        "tests, then the benchmarks. accel and HF Accelerate 1.15 run the same user code in the same process,",
        "interleaved round by round (order rotated); times are medians, ratios the median of the per-round ratios",
        "with their interquartile range in brackets (higher: accel faster). GPU times are taken between two",
        "`torch.cuda.synchronize()`: what the caller waits for, the GPU's work included.",
        "",
        *machine_table(machine),
        "",
        "## Goals",
        "",
        *goals_table(goals(found)),
        "",
        "## The run",
        "",
        *run_section(found),
        "",
        "## clip_grad_norm_ after backward under fp16 loss scaling",
        "",
        "`accelerator.clip_grad_norm_(model.parameters(), 0.1)` right after `accelerator.backward(loss)` with",
        '`mixed_precision="fp16"` on the GPU (unscale + clip; the norm is above max_norm, so the clip scales), the',
        "model's parameters in the dtype shown. `HF`: HF Accelerate 1.15 as it sets itself up on a GPU (torch's",
        "GradScaler for CUDA; for fp16 parameters one that lets torch's kernel unscale them, which torch refuses).",
        "Op level, on the same gradients: accel's `unscale_grads_` + `clip_grads_` against torch's",
        "`_amp_foreach_non_finite_check_and_unscale_` + `clip_grad_norm_(foreach=True)`; `limit`: one streaming",
        "read+write of the gradients (the fused path needs two). bf16 is not compared: torch's CUDA unscale has no",
        "bf16, so HF cannot run it (accel can: tests/test_precision.py).",
        "",
        *unscale_table(unscale_cases(found)),
        *_missing(found, "bench-unscale-cuda", "bench-unscale"),
        "",
        f"## save_model from GPU memory ({gib}, fp32, one file)",
        "",
        f"Files in `{machine.get('bench_dir', '?')}` ({machine.get('bench_dir_filesystem', '?')}); between variants",
        "(untimed) accel's background work is joined and `os.sync()` writes the dirty page cache out.",
        "",
        *save_table(save),
        *_missing(found, "bench-checkpoint-cuda", "bench-checkpoint"),
        "",
        f"## Loading into GPU memory ({gib})",
        "",
        "The checkpoint file in the page cache; each loaded model is checked bit for bit once (untimed).",
        "",
        *load_table(load),
        *_missing(found, "bench-big-model-cuda", "bench-big-model"),
        "",
        "## pad_across_processes + gather on one GPU (sanity point)",
        "",
        "One process has nothing to exchange: both libraries should hand the tensor back; this is their cost per call",
        "(HF reads the shape back from the GPU).",
        "",
        *gather_gpu_table(found),
        *_missing(found, "bench-gather-cuda", "bench-gather-gpu"),
        "",
        f"## On the machine's {machine.get('cpu_count', '?')} CPU cores: all_reduce on 4 and 8 ranks",
        "",
        "As docs/benchmarks/process_group.md, on more cores: `accel` is `torch.distributed.all_reduce` on the group",
        "PartialState starts (accel's shared-memory backend), `gloo` the same call on a gloo group.",
        "",
        *process_group_report.reduction_table(reductions),
        *(
            _missing(found, "bench-allreduce-4", "bench-allreduce-4")
            + _missing(found, "bench-allreduce-8", "bench-allreduce-8")
        ),
        "",
        "## Padded all-gather on 4 ranks (CPU)",
        "",
        "As docs/benchmarks/gather.md.",
        "",
        *gather_report.gather_table(gathers),
        "",
        *gather_report.pass_table(gathers),
        *_missing(found, "bench-gather-4", "bench-gather-4"),
        "",
    ]


def merged(runs: list[dict]) -> dict:
    """The runs' results, a later run's replacing an earlier one's (steps by name, each benchmark file whole)."""
    found = dict(runs[0])
    for later in runs[1:]:
        steps = {step[0]: step for step in found["steps"]}
        steps.update({step[0]: step for step in later["steps"]})
        found["steps"] = list(steps.values())
        found.update({key: value for key, value in later.items() if value and key != "steps"})
    return found


def main(out_dir: str, *results_dirs: str) -> None:
    found = merged([read_results(Path(folder)) for folder in results_dirs])
    scaffold.write(out_dir, "gpu", page(found))
    print("\n".join(goals_table(goals(found))))


if __name__ == "__main__":
    main(*sys.argv[1:])
