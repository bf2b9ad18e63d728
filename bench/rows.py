"""The benchmark table: each row is a measurement, a baseline from the same run, and a target ratio.

Absolute times on a shared machine say little; a ratio to a baseline that suffers the same
noise says whether gpuguard's own work stays small. A row misses when its ratio is above its
target, or when one of its checks (failures, double grants) is not met.
"""
from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Row:
    name: str
    ours: float       # seconds, or KiB for memory rows
    baseline: float
    target: float     # the ratio ours / baseline must stay at or below
    unit: str = "ms"  # "ms" (values in seconds, shown in ms) or "KiB"
    against: str = ""  # what the baseline is, for the reader
    failed_checks: tuple[str, ...] = field(default_factory=tuple)

    @property
    def ratio(self) -> float:
        return self.ours / self.baseline

    @property
    def missed(self) -> bool:
        return self.ratio > self.target or bool(self.failed_checks)


ROWS: list[Row] = []


def row(name: str, ours: float, baseline: float, target: float, against: str, unit: str = "ms",
        failed_checks: Sequence[str] = ()) -> Row:
    ROWS.append(Row(name, ours, baseline, target, unit, against, tuple(failed_checks)))
    print(f"bench: {format_row(ROWS[-1])}", flush=True)  # progress: the table comes at the end
    return ROWS[-1]


def per_call(fn: Callable[[], object], calls: int, repeats: int = 5) -> float:
    """Median over `repeats` of the mean seconds per call."""
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - start) / calls)
    return statistics.median(samples)


def p99(values: Sequence[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]


def _value(value: float, unit: str) -> str:
    if unit == "KiB":
        return f"{value:.0f} KiB"
    return f"{value * 1e6:.2f} µs" if value < 1e-4 else f"{value * 1000:.3f} ms"


def format_row(r: Row) -> str:
    verdict = ("MISSED " + "; ".join(r.failed_checks)).strip() if r.missed else "ok"
    return (f"{r.name} | {_value(r.ours, r.unit)} | {_value(r.baseline, r.unit)} ({r.against}) | "
            f"{r.ratio:.3g} | <= {r.target:g} | {verdict}")


def table(rows: Sequence[Row]) -> str:
    """The rows as a Markdown table, as docs/performance.md shows it."""
    lines = ["| benchmark | gpuguard | baseline (same run) | ratio | target | |",
             "|---|---:|---|---:|---:|---|"]
    lines += [f"| {format_row(r)} |" for r in rows]
    return "\n".join(lines)
