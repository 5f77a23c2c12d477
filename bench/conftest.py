"""Prints each benchmark's extra_info (throughput, ratios) after the pytest-benchmark table."""

from __future__ import annotations


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    session = getattr(config, "_benchmarksession", None)
    benchmarks = getattr(session, "benchmarks", None) or []
    rows = [(b.fullname.split("::")[-1], b.extra_info) for b in benchmarks if b.extra_info]
    if not rows:
        return
    terminalreporter.write_sep("-", "extra info (from the same run)")
    for name, info in rows:
        items = ", ".join(f"{k}: {v:.3g}" if isinstance(v, float) else f"{k}: {v}" for k, v in info.items())
        terminalreporter.write_line(f"{name:45s} {items}")
