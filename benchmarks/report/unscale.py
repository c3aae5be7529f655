"""bench_unscale.py's pytest-benchmark JSON -> OUT_DIR/unscale.md and unscale.png; prints the tables too.

    python benchmarks/report/unscale.py OUT_DIR results.json

Every number comes from the per-round samples each benchmark stores in its extra_info (bench_unscale.py runs its
variants interleaved, round by round): medians of times, and medians of the per-round ratios with their
interquartile range as the spread.
"""

from __future__ import annotations

import statistics
import sys

import scaffold
from scaffold import MISSING, per_round_ratio, row

SETS = ["small", "large"]
DTYPES = ["fp32", "fp16", "bf16"]
SET_LABELS = {"small": "1,000 × 1–10 Ki", "large": "200 × 40,000"}
# Issue 13's goals for the public path, against HF Accelerate with loss scaling (`hf`).
TARGETS = {
    ("small", "fp32"): 1.5,
    ("small", "fp16"): 3.0,
    ("small", "bf16"): 3.0,
    ("large", "fp32"): 1.5,
    ("large", "fp16"): 2.0,
    ("large", "bf16"): 2.0,
}
VARIANTS = ["accel", "hf", "hf_cpu", "accel_fallback", "op_accel", "op_torch", "limit"]


def by_case(benchmarks: list[tuple[str, dict]]) -> dict:
    """{(set, dtype): {"samples": {variant: [seconds per round]}, "bytes": n, "notice": str | None}}."""
    return {
        (info["set"], info["dtype"]): {"samples": info["samples"], "bytes": info["bytes"], "notice": info.get("notice")}
        for _, info in benchmarks
    }


def median(case: dict, variant: str) -> float | None:
    times = case["samples"].get(variant)
    return statistics.median(times) if times else None


def ratio(case: dict, slower: str, faster: str) -> dict | None:
    """slower/faster per round (both measured in the same round): median and quartiles."""
    return per_round_ratio(case["samples"].get(slower), case["samples"].get(faster))


def _ms(seconds: float | None) -> str:
    return scaffold.time_in(seconds, 1e3, 2)


def _x(value: dict | None) -> str:
    return scaffold.quartile_ratio(value, 2)


def _share(case: dict) -> str:
    """The op-level unscale+clip's share of the streaming limit: it needs two read+write passes."""
    limit, op = median(case, "limit"), median(case, "op_accel")
    return MISSING if limit is None or op is None else f"{2 * limit / op:.0%}"


def table(cases: dict) -> list[str]:
    rows = []
    for (set_name, dtype), case in sorted(cases.items(), key=lambda kv: (SETS.index(kv[0][0]), DTYPES.index(kv[0][1]))):
        m = {v: median(case, v) for v in VARIANTS}
        rows.append(
            row(
                SET_LABELS[set_name],
                dtype,
                _ms(m["accel"]),
                _ms(m["hf"]),
                _x(ratio(case, "hf", "accel")),
                _ms(m["hf_cpu"]),
                _x(ratio(case, "hf_cpu", "accel")),
                _x(ratio(case, "accel_fallback", "accel")),
                _ms(m["op_accel"]),
                _ms(m["op_torch"]),
                _x(ratio(case, "op_torch", "op_accel")),
                _ms(m["limit"]),
                _share(case),
            )
        )
    header = [
        "gradients",
        "dtype",
        "accel ms",
        "HF, loss scaling ms",
        "speed-up",
        "HF as shipped ms",
        "speed-up",
        "accel fallback",
        "op level: accel ms",
        "torch ms",
        "speed-up",
        "limit ms",
        "op of limit",
    ]
    return scaffold.table(header, rows)


def targets(cases: dict) -> list[str]:
    rows = []
    for (set_name, dtype), goal in TARGETS.items():
        case = cases.get((set_name, dtype))
        value = None if case is None else ratio(case, "hf", "accel")
        verdict = "not measured" if value is None else ("met" if value["median"] >= goal else "not met")
        rows.append(row(f"≥ {goal:g}× faster, {SET_LABELS[set_name]} {dtype}", _x(value), verdict))
    return ["| target (public path vs HF with loss scaling) | measured | |", "|---|---|---|", *rows]


def plot(cases: dict, path) -> None:
    width = 0.8 / len(VARIANTS)
    with scaffold.figure(path, len(SETS), (6.5 * len(SETS), 4.5)) as axes:
        for axis, set_name in zip(axes, SETS):
            for i, variant in enumerate(VARIANTS):
                values = [
                    (median(cases[(set_name, d)], variant) or 0) * 1e3 if (set_name, d) in cases else 0 for d in DTYPES
                ]
                offset = (i - (len(VARIANTS) - 1) / 2) * width
                axis.bar([x + offset for x in range(len(DTYPES))], values, width, label=variant)
            axis.set(
                xticks=range(len(DTYPES)),
                xticklabels=DTYPES,
                ylabel="median ms per step",
                title=f"clip_grad_norm_ with fp16 loss scaling, {SET_LABELS[set_name]} elements",
            )
            axis.grid(True, axis="y", alpha=0.3)
            axis.legend(fontsize="small")


def main(out_dir: str, path: str) -> None:
    benchmarks, machine = scaffold.load([path])
    cases = by_case(benchmarks)
    notices = sorted({case["notice"] for case in cases.values() if case["notice"]})
    text = [
        "# fp16 loss scaling: unscale + gradient clip through the public API, measured",
        "",
        f"Generated by `make bench-unscale` on {scaffold.cpu_name(machine)} ({scaffold.cpu_count(machine)} cores,",
        "torch's default thread count). Each step: zero_grad, forward, `accelerator.backward(loss)`, then the timed",
        "`accelerator.clip_grad_norm_(model.parameters(), 0.1)` (unscale + clip), then `optimizer.step()`.",
        "Variants run interleaved (one of each per round, order rotated); times are medians over the rounds,",
        "speed-ups the median of the per-round ratios with their interquartile range (the spread) in parentheses.",
        "",
        '- `accel`: `accel.Accelerator(mixed_precision="fp16", cpu=True)`: the fused unscale measures the norm, the',
        "  fused clip scales.",
        '- `HF, loss scaling`: HF Accelerate 1.15\'s `Accelerator(mixed_precision="fp16", cpu=True)` given the',
        "  scaler it creates on a GPU (torch's `GradScaler`, here for the CPU): its own `backward`, `clip_grad_norm_`",
        "  (`scaler.unscale_`, then `torch.nn.utils.clip_grad_norm_`) and optimizer step. HF turns fp16 off on the",
        "  CPU; torch's scaler refuses fp16 gradients, so for fp16 parameters it runs torch's kernel on them.",
        "- `HF as shipped`: the same HF call without loss scaling (what HF 1.15 does with fp16 on a CPU, and with",
        "  bf16): `torch.nn.utils.clip_grad_norm_` alone, nothing to unscale.",
        "- `accel fallback`: how much slower accel's own path is with its kernels off (ACCEL_DISABLE_NATIVE=1).",
        "- op level, on the same gradients (views of one buffer, restored before each run): `accel::unscale_grads_`",
        "  + `accel::clip_grads_` against `torch._amp_foreach_non_finite_check_and_unscale_` +",
        "  `clip_grad_norm_`; `limit`: one streaming read+write of the gradients' bytes (the op needs two).",
        *([""] + [f"Note: {n}." for n in notices] if notices else []),
        "",
        *table(cases),
        "",
        "## Targets (issue 13)",
        "",
        *targets(cases),
        "",
        "![unscale + clip](unscale.png)",
        "",
    ]
    scaffold.write(out_dir, "unscale", text, lambda png: plot(cases, png))
    print("\n".join([*table(cases), "", *targets(cases)]))


if __name__ == "__main__":
    main(*sys.argv[1:])
