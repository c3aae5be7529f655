"""Turns bench_unscale.py's pytest-benchmark JSON into a table of where each target stands, and a plot.

    python tools/bench_unscale_report.py OUT_DIR results.json

Writes OUT_DIR/unscale.md and OUT_DIR/unscale.png, and prints the table. Every number comes from the per-round
samples each benchmark stores in its extra_info (bench_unscale.py runs its variants interleaved, round by round):
medians of times, and medians of the per-round ratios with their interquartile range as the spread.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

SETS = ["small", "large"]
DTYPES = ["fp32", "fp16", "bf16"]
SET_LABELS = {"small": "1,000 × 1–10 Ki", "large": "200 × 40,000"}
# Issue 13's goals for the public path, against HF Accelerate with loss scaling (`hf`).
TARGETS = {("small", "fp32"): 1.5, ("small", "fp16"): 3.0, ("small", "bf16"): 3.0,
           ("large", "fp32"): 1.5, ("large", "fp16"): 2.0, ("large", "bf16"): 2.0}  # fmt: skip
VARIANTS = ["accel", "hf", "hf_cpu", "accel_fallback", "op_accel", "op_torch", "limit"]


def load(path: str) -> tuple[dict[tuple[str, str], dict], dict]:
    """({(set, dtype): {"samples": {variant: [seconds per round]}, "bytes": n, "notice": str | None}}, machine)."""
    data = json.loads(Path(path).read_text())
    cases = {}
    for bench in data["benchmarks"]:
        info = bench["extra_info"]
        cases[(info["set"], info["dtype"])] = {"samples": info["samples"], "bytes": info["bytes"],
                                               "notice": info.get("notice")}  # fmt: skip
    return cases, data.get("machine_info", {})


def median(case: dict, variant: str) -> float | None:
    times = case["samples"].get(variant)
    return statistics.median(times) if times else None


def ratio(case: dict, slower: str, faster: str) -> tuple[float, float, float] | None:
    """Median and quartiles of slower/faster over the rounds (both measured in the same round)."""
    a, b = case["samples"].get(slower), case["samples"].get(faster)
    if not a or not b:
        return None
    pairs = sorted(x / y for x, y in zip(a, b))
    q1, _, q3 = statistics.quantiles(pairs, n=4) if len(pairs) > 1 else (pairs[0],) * 3
    return statistics.median(pairs), q1, q3


def _ms(seconds: float | None) -> str:
    return "—" if seconds is None else f"{seconds * 1e3:,.2f}"


def _x(value: tuple[float, float, float] | None) -> str:
    return "—" if value is None else f"{value[0]:.2f}× ({value[1]:.2f}–{value[2]:.2f})"


def _share(case: dict) -> str:
    """The op-level unscale+clip's share of the streaming limit: it needs two read+write passes."""
    limit, op = median(case, "limit"), median(case, "op_accel")
    return "—" if limit is None or op is None else f"{2 * limit / op:.0%}"


def table(cases: dict) -> list[str]:
    lines = [
        "| gradients | dtype | accel ms | HF, loss scaling ms | speed-up | HF as shipped ms | speed-up | "
        "accel fallback | op level: accel ms | torch ms | speed-up | limit ms | op of limit |",
        "|" + "---|" * 13,
    ]
    for (set_name, dtype), case in sorted(cases.items(), key=lambda kv: (SETS.index(kv[0][0]), DTYPES.index(kv[0][1]))):
        m = {v: median(case, v) for v in VARIANTS}
        lines.append(
            f"| {SET_LABELS[set_name]} | {dtype} | {_ms(m['accel'])} | {_ms(m['hf'])} | {_x(ratio(case, 'hf', 'accel'))} | "
            f"{_ms(m['hf_cpu'])} | {_x(ratio(case, 'hf_cpu', 'accel'))} | {_x(ratio(case, 'accel_fallback', 'accel'))} | "
            f"{_ms(m['op_accel'])} | {_ms(m['op_torch'])} | "
            f"{_x(ratio(case, 'op_torch', 'op_accel'))} | {_ms(m['limit'])} | {_share(case)} |"
        )
    return lines


def targets(cases: dict) -> list[str]:
    rows = ["| target (public path vs HF with loss scaling) | measured | |", "|---|---|---|"]
    for (set_name, dtype), goal in TARGETS.items():
        case = cases.get((set_name, dtype))
        value = None if case is None else ratio(case, "hf", "accel")
        verdict = "not measured" if value is None else ("met" if value[0] >= goal else "not met")
        rows.append(f"| ≥ {goal:g}× faster, {SET_LABELS[set_name]} {dtype} | {_x(value)} | {verdict} |")
    return rows


def plot(cases: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(SETS), figsize=(6.5 * len(SETS), 4.5), squeeze=False)
    width = 0.8 / len(VARIANTS)
    for axis, set_name in zip(axes[0], SETS):
        for i, variant in enumerate(VARIANTS):
            values = [(median(cases[(set_name, d)], variant) or 0) * 1e3 if (set_name, d) in cases else 0
                      for d in DTYPES]  # fmt: skip
            offset = (i - (len(VARIANTS) - 1) / 2) * width
            axis.bar([x + offset for x in range(len(DTYPES))], values, width, label=variant)
        axis.set(xticks=range(len(DTYPES)), xticklabels=DTYPES, ylabel="median ms per step",
                 title=f"clip_grad_norm_ with fp16 loss scaling, {SET_LABELS[set_name]} elements")  # fmt: skip
        axis.grid(True, axis="y", alpha=0.3)
        axis.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main(out_dir: str, path: str) -> None:
    cases, machine = load(path)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cpu = machine.get("cpu", {})
    notices = sorted({case["notice"] for case in cases.values() if case["notice"]})
    text = [
        "# fp16 loss scaling: unscale + gradient clip through the public API, measured",
        "",
        f"Generated by `make bench-unscale` on {cpu.get('brand_raw', 'unknown CPU')} ({cpu.get('count', '?')} cores,",
        "torch's default thread count). Each step: zero_grad, forward, `accelerator.backward(loss)`, then the timed",
        "`accelerator.clip_grad_norm_(model.parameters(), 0.1)` (unscale + clip), then `optimizer.step()`.",
        "Variants run interleaved (one of each per round, order rotated); times are medians over the rounds,",
        "speed-ups the median of the per-round ratios with their interquartile range (the spread) in parentheses.",
        "",
        "- `accel`: `accel.Accelerator(mixed_precision=\"fp16\", cpu=True)`: the fused unscale measures the norm, the",
        "  fused clip scales.",
        "- `HF, loss scaling`: HF Accelerate 1.15's `Accelerator(mixed_precision=\"fp16\", cpu=True)` given the",
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
    (out / "unscale.md").write_text("\n".join(text))
    plot(cases, out / "unscale.png")
    print("\n".join([*table(cases), "", *targets(cases)]))


if __name__ == "__main__":
    main(*sys.argv[1:])
