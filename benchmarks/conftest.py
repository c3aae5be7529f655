"""Prints, after the benchmark table, each result's median as a ratio to its group's physical limit.

Every group holds one benchmark named `limit` (e.g. a plain copy of the same bytes) measured in the same
run; ratios, not absolute times, are what we compare across these shared, noisy machines.

Under `accel launch` every rank runs the same benchmarks (they are collective); ranked_pytest.py makes only
rank 0 report.
"""


def pytest_terminal_summary(terminalreporter, config):
    session = getattr(config, "_benchmarksession", None)
    if session is None or not session.benchmarks:
        return
    groups = {}
    for bench in session.benchmarks:
        if not bench.stats.data:  # the benchmark failed before its first round
            continue
        groups.setdefault(bench.group, []).append(bench)
    terminalreporter.section("median time / median time of the group's limit (lower is better, 1.0 = limit)")
    for group, benches in sorted(groups.items(), key=lambda kv: str(kv[0])):
        limit = next((b for b in benches if b.name.split("[")[0].endswith("limit")), None)
        if limit is None:
            continue
        cells = ", ".join(
            f"{b.name.split('[')[0].removeprefix('test_')}: {b.stats.median / limit.stats.median:.2f}x" for b in benches
        )
        terminalreporter.write_line(f"{group}: {cells}")
