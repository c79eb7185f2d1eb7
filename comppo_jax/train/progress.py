"""The run's progress on the terminal: the step loops' bar (the warm start's, the training steps') and the
first-call compile notices."""

from __future__ import annotations

import tqdm


class StepBar(tqdm.tqdm):
    """tqdm over a loop whose first iteration compiles its programs (seconds on a CPU, minutes at
    scale). The rate and ETA are the average over the iterations after the first, since it ended:
    plain tqdm takes the compile as step time (the tiny warm start read `1/1000 [00:08<2:20:15]`),
    and its smoothed rate misreads steps whose device work is read back in bursts (every 20 warm-
    start steps) as a slowdown. Until a later iteration ends the ETA is `?`. The elapsed time is the
    whole, compiles included."""

    _timed_from: tuple[int, float] | None = None  # (n, clock) when the first iteration ended

    def __iter__(self):
        try:
            for index, item in enumerate(self.iterable):
                yield item
                self.update(1)
                if index == 0 and not self.disable:
                    self._timed_from = (self.n, self._time())
        finally:
            self.close()

    @property
    def format_dict(self):
        info = super().format_dict
        counted = self.n - self._timed_from[0] if self._timed_from else 0
        took = self._time() - self._timed_from[1] if self._timed_from else 0.0
        # A rate of None with `initial` = n reads as no rate at all: tqdm shows `?`.
        info["rate"] = counted / took if counted and took > 0 else None
        if info["rate"] is None:
            info["initial"] = self.n
        return info


def first_call_notices(enabled: bool):
    """compiling(what): says "compiling <what>..." the first time each program is called (the first
    step compiles them all, for up to minutes at scale; later calls reuse them)."""
    said = set()

    def compiling(what: str) -> None:
        if enabled and what not in said:
            said.add(what)
            tqdm.tqdm.write(f"compiling {what}...")

    return compiling
