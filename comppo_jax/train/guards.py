"""What keeps an unattended run from losing work: preemption signals and the non-finite guard.

- `StopSignals`: SIGTERM (a preempted TPU VM, a scheduler) and SIGINT set a flag instead of
  killing the process, from the start of `train()`. The train loop reads `requested()` at each
  step boundary, where every process agrees on it, saves and exits. Where finishing would take
  long and save nothing new (the warm start, the dev evaluations before the first step and after
  the last, the first step of a process, which compiles), `check(stage)` raises `RunStopped` at
  the next safe point instead. Repeated
  signals while it stops are ignored, so a second one cannot interrupt the save.
- `nonfinite_credit`: which of a step's credit inputs (rewards, values, advantages, returns) hold
  NaN or inf; the loop skips that step's update. Loss and gradient norms are guarded inside the
  jitted update steps (`update._clip_and_apply`).
- `SkippedUpdates`: counts skipped updates; after `limit` consecutive ones the run stops with
  `NonFiniteError` naming the step and quantity.
"""

from __future__ import annotations

import signal
import sys

import jax
import jax.numpy as jnp
import numpy as np

from comppo_jax.sharding import any_process


class NonFiniteError(FloatingPointError):
    """Too many consecutive updates were skipped for non-finite values."""


class RunStopped(Exception):
    """A stop request honoured before the end of a step; `stage` says where."""

    def __init__(self, stage: str):
        super().__init__(f"stopped during {stage}")
        self.stage = stage


class StopSignals:
    """Within `with StopSignals() as stop:`, SIGTERM / SIGINT request a stop at the next step boundary."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.received: int | None = None
        self.previous = {}

    def _handle(self, signum, frame):
        del frame
        if self.received is None:
            print(
                f"{signal.Signals(signum).name} received: stopping after this step with a checkpoint, or within "
                "seconds during the warm start, the first dev evaluation or the first step's compiles (further "
                "signals are ignored; kill -9 stops at once, and the newest checkpoint stays whole)",
                file=sys.stderr,
                flush=True,
            )
        self.received = signum

    def __enter__(self) -> StopSignals:
        for signum in self.SIGNALS:
            self.previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)

    def requested(self) -> bool:
        """Whether any process received a signal (a collective: every process must call it at the same step)."""
        return any_process(self.received is not None)

    def check(self, stage: str) -> None:
        """Raises RunStopped(`stage`) when a stop was requested (a collective, as `requested`)."""
        if self.requested():
            raise RunStopped(stage)


def all_finite(**arrays) -> dict:
    """{name: whether the array holds no NaN or inf} (device booleans), traced inside the program that
    computes the arrays, so the check is no program of its own; `nonfinite_credit` reads them back."""
    return {name: jnp.all(jnp.isfinite(x)) for name, x in arrays.items()}


def nonfinite_credit(rewards: np.ndarray, **finite) -> list[str]:
    """Names of the quantities holding NaN or inf: "rewards (rows [..])" and each of `finite`'s names
    whose flag (`all_finite`'s) is false, in their order."""
    names = []
    bad_rows = np.flatnonzero(~np.isfinite(rewards))
    if bad_rows.size:
        names.append(f"rewards (rows {bad_rows[:5].tolist()}{' ...' if bad_rows.size > 5 else ''})")
    flags = jax.device_get(finite)
    return names + [name for name in finite if not flags[name]]


class SkippedUpdates:
    """The run's skipped updates: `total`, and `consecutive` ones, which stop the run at `limit`."""

    def __init__(self, limit: int, total: int = 0, consecutive: int = 0):
        self.limit, self.total, self.consecutive = limit, total, consecutive

    def record(self, nonfinite: list[str]) -> None:
        """Counts a step's update as skipped for `nonfinite` quantities (none: it was applied)."""
        self.total += bool(nonfinite)
        self.consecutive = self.consecutive + 1 if nonfinite else 0

    def stop_if_exhausted(self, step: int, nonfinite: list[str]) -> None:
        if self.consecutive >= self.limit:
            raise NonFiniteError(
                f"step {step}: {self.consecutive} consecutive updates skipped for non-finite values, last in "
                f"{', '.join(nonfinite)}; params and optimizer state are those before the first skip, and the last "
                "checkpoint is intact. Lower the learning rates, check the rewards, or raise train.max_skipped_updates"
            )

    def state(self) -> dict:
        return {"total": self.total, "consecutive": self.consecutive}
