"""The run's progress on the terminal: the step loops' bar (the warm start's, the training steps') and the
first-call compile notices."""

from __future__ import annotations

import tqdm
from tqdm.std import EMA


class StepBar(tqdm.tqdm):
    """tqdm over a loop whose first iteration compiles its programs (seconds on a CPU, minutes at
    scale): the rate and ETA count from the end of that iteration, where plain tqdm takes its time
    as every step's (the tiny warm start read `1/1000 [00:08<2:20:15]`). Until a later iteration
    is timed the ETA is `?`. The elapsed time is the whole, compiles included."""

    def __iter__(self):
        try:
            for index, item in enumerate(self.iterable):
                yield item
                if index > 0 or self.disable:
                    self.update(1)
                    continue
                # The first iteration, counted without a rate: `initial` is where tqdm's average
                # (its rate before the first smoothed one) starts, and the smoothing starts afresh.
                self._ema_dn, self._ema_dt = EMA(self.smoothing), EMA(self.smoothing)
                self.initial = self.n = self.last_print_n = 1
                self.last_print_t = self._time()
                self.refresh()
        finally:
            self.initial = 0  # the closing line's rate: tqdm's whole average, compile included
            self.close()


def first_call_notices(enabled: bool):
    """compiling(what): says "compiling <what>..." the first time each program is called (the first
    step compiles them all, for up to minutes at scale; later calls reuse them)."""
    said = set()

    def compiling(what: str) -> None:
        if enabled and what not in said:
            said.add(what)
            tqdm.tqdm.write(f"compiling {what}...")

    return compiling
