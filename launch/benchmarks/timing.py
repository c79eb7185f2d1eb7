"""Wall-clock timing and table printing shared by the benchmark suites."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable


def _per_call_seconds(fn: Callable[[], object], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def interleaved_medians(
    candidates: dict[str, Callable[[], object]], repeats: int, min_round_seconds: float = 0.2
) -> dict[str, float]:
    """Median per-call seconds of each candidate, timed side by side.

    Each `fn()` must block until its result is ready. After one warm-up call each (compiles),
    the candidates are timed in `repeats` interleaved rounds, so load from other processes
    hits them alike; in a round each candidate runs back to back for >= `min_round_seconds`.
    A candidate fast enough to run several calls a round gets one untimed call first, so
    it is not timed on caches the previous candidate left cold.
    """
    calls = {}
    for name, fn in candidates.items():
        fn()
        calls[name] = max(1, math.ceil(min_round_seconds / _per_call_seconds(fn, 1)))
    samples = {name: [] for name in candidates}
    for _ in range(repeats):
        for name, fn in candidates.items():
            if calls[name] > 1:
                fn()
            samples[name].append(_per_call_seconds(fn, calls[name]))
    return {name: statistics.median(times) for name, times in samples.items()}


def print_table(rows: list[dict], columns: list[str]) -> None:
    """Right-aligned text table of `rows` (dicts of already formatted values)."""
    widths = [max(len(c), *(len(str(r.get(c, ""))) for r in rows)) for c in columns]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
    for row in rows:
        print("  ".join(str(row.get(c, "")).rjust(w) for c, w in zip(columns, widths)))
