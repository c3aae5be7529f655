"""Turns bench_unscale.py's pytest-benchmark JSON into a table of where each target stands, and a plot.

    python tools/bench_unscale_report.py OUT_DIR results.json

Writes OUT_DIR/unscale.md and OUT_DIR/unscale.png.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

SETS = ["small", "large"]
DTYPES = ["fp32", "fp16", "bf16"]
VARIANTS = ["limit", "accel_unscale", "hf_unscale", "accel_unscale_clip", "hf_unscale_clip"]
SET_LABELS = {"small": "5,000 × 1–10 Ki", "large": "200 × 500 Ki"}


def load(path: str) -> tuple[dict, dict, dict]:
    """({(set, dtype, variant): median s}, {(set, dtype): bytes}, machine info)."""
    data = json.loads(Path(path).read_text())
    medians, sizes = {}, {}
    for bench in data["benchmarks"]:
        variant = bench["name"].split("[")[0].removeprefix("test_")
        set_name, dtype = bench["group"].removeprefix("unscale ").split("-")
        medians[(set_name, dtype, variant)] = bench["stats"]["median"]
        sizes[(set_name, dtype)] = bench["extra_info"]["bytes"]
    return medians, sizes, data.get("machine_info", {})


def _ms(seconds: float | None) -> str:
    return "—" if seconds is None else f"{seconds * 1e3:,.1f}"


def _ratio(numerator: float | None, denominator: float | None, digits: int = 1) -> str:
    return "—" if numerator is None or denominator is None else f"{numerator / denominator:.{digits}f}×"


def _gbps(nbytes: int, passes: int, seconds: float | None) -> str:
    """Read+write bandwidth: `passes` passes that each read and write every byte."""
    return "—" if seconds is None else f"{2 * passes * nbytes / seconds / 1e9:.1f}"


def _share(limit: float | None, seconds: float | None, passes: int) -> str:
    """The fraction of the streaming limit reached, for a job that needs `passes` read+write passes."""
    return "—" if limit is None or seconds is None else f"{passes * limit / seconds:.0%}"


def table(medians: dict, sizes: dict) -> list[str]:
    lines = [
        "| set | dtype | limit ms | unscale+clip: accel ms | HF ms | speed-up | accel GB/s | of limit | "
        "unscale alone: accel ms | HF ms | speed-up | of limit |",
        "|" + "---|" * 12,
    ]
    for set_name in SETS:
        for dtype in DTYPES:
            t = {v: medians.get((set_name, dtype, v)) for v in VARIANTS}
            nbytes = sizes.get((set_name, dtype), 0)
            lines.append(
                f"| {SET_LABELS[set_name]} | {dtype} | {_ms(t['limit'])} | {_ms(t['accel_unscale_clip'])} | "
                f"{_ms(t['hf_unscale_clip'])} | {_ratio(t['hf_unscale_clip'], t['accel_unscale_clip'])} | "
                f"{_gbps(nbytes, 2, t['accel_unscale_clip'])} | {_share(t['limit'], t['accel_unscale_clip'], 2)} | "
                f"{_ms(t['accel_unscale'])} | {_ms(t['hf_unscale'])} | {_ratio(t['hf_unscale'], t['accel_unscale'])} | "
                f"{_share(t['limit'], t['accel_unscale'], 1)} |"
            )
    return lines


def targets(medians: dict) -> list[str]:
    def speedup(set_name: str, dtype: str) -> float | None:
        hf, accel = (medians.get((set_name, dtype, v)) for v in ("hf_unscale_clip", "accel_unscale_clip"))
        return None if hf is None or accel is None else hf / accel

    def share(dtype: str) -> float | None:
        limit, accel = (medians.get(("large", dtype, v)) for v in ("limit", "accel_unscale"))
        return None if limit is None or accel is None else limit / accel

    def verdict(value: float | None, goal: float) -> str:
        return "not measured" if value is None else ("met" if value >= goal else "not met")

    rows = ["| target | measured | |", "|---|---|---|"]
    for dtype in ("fp16", "bf16"):
        value = speedup("small", dtype)
        rows.append(f"| unscale+clip ≥ 3× faster than torch, 5,000 small {dtype} | "
                    f"{'—' if value is None else f'{value:.1f}×'} | {verdict(value, 3.0)} |")  # fmt: skip
    value = speedup("large", "fp32")
    rows.append(f"| unscale+clip ≥ 1.4× faster than torch, large fp32 | {'—' if value is None else f'{value:.1f}×'} | "
                f"{verdict(value, 1.4)} |")  # fmt: skip
    for dtype in DTYPES:
        value = share(dtype)
        rows.append(f"| unscale pass ≥ 80% of the streaming limit, large {dtype} | "
                    f"{'—' if value is None else f'{value:.0%}'} | {verdict(value, 0.8)} |")  # fmt: skip
    return rows


def plot(medians: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(SETS), figsize=(6 * len(SETS), 4.5), squeeze=False)
    width = 0.16
    for axis, set_name in zip(axes[0], SETS):
        for i, variant in enumerate(VARIANTS):
            values = [medians.get((set_name, dtype, variant), 0) * 1e3 for dtype in DTYPES]
            axis.bar([x + (i - 2) * width for x in range(len(DTYPES))], values, width, label=variant)
        axis.set(xticks=range(len(DTYPES)), xticklabels=DTYPES, ylabel="median ms",
                 title=f"unscale (+ clip), {SET_LABELS[set_name]} elements")  # fmt: skip
        axis.grid(True, axis="y", alpha=0.3)
        axis.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main(out_dir: str, path: str) -> None:
    medians, sizes, machine = load(path)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cpu = machine.get("cpu", {})
    text = [
        "# fp16 unscale + gradient clip: measured results",
        "",
        f"Generated by `make bench-unscale` on {cpu.get('brand_raw', 'unknown CPU')} ({cpu.get('count', '?')} cores,",
        "torch's default thread count). Medians per call; gradients restored before every round (not timed).",
        "`HF` is what HF Accelerate runs under fp16: torch's `GradScaler` unscale, then",
        "`torch.nn.utils.clip_grad_norm_` (unscale read+write, norm read, scale read+write). `accel` is",
        "`FusedGradScaler` + `accel.precision.grads.clip_grad_norm_`: one pass unscales and measures the norm,",
        "one pass clips. `limit`: one streaming read+write of the same bytes; \"of limit\" is the share of it",
        "reached (unscale+clip needs two such passes, the unscale alone one).",
        "",
        *table(medians, sizes),
        "",
        "## Targets (issue 5)",
        "",
        *targets(medians),
        "",
        "![unscale + clip](unscale.png)",
        "",
    ]
    (out / "unscale.md").write_text("\n".join(text))
    plot(medians, out / "unscale.png")


if __name__ == "__main__":
    main(*sys.argv[1:])
