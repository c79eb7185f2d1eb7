"""The step loops' progress bar: its ETA leaves out the first (compiling) iteration."""

from __future__ import annotations

import io

import tqdm

from comppo_jax.train.progress import StepBar


def shown_by(bar_class, seconds=lambda step: 100.0 if step == 0 else 1.0, steps: int = 6) -> list[str]:
    """The bar at the start of each step, step k taking `seconds(k)` (by default the first compiles for
    100 s and the others take 1 s)."""
    clock = [0.0]
    bar = bar_class(range(steps), file=io.StringIO(), mininterval=0, miniters=1)
    bar._time = lambda: clock[0]  # tqdm reads its clock here
    bar.start_t = bar.last_print_t = 0.0
    shown = []
    for step in bar:
        shown.append(str(bar))
        clock[0] += seconds(step)
    return shown


def test_the_eta_counts_from_the_end_of_the_compiling_first_step():
    shown = shown_by(StepBar)
    assert "1/6 [01:40<?" in shown[1], shown[1]  # no rate yet
    assert "3/6 [01:42<00:03" in shown[3], shown[3]  # 3 more steps of 1 s
    assert "<00:03" not in shown_by(tqdm.tqdm)[3]  # plain tqdm takes the compile as step time


def test_steps_read_back_in_bursts_give_the_average_eta():
    """19 steps queued in 0.1 s each, then one that waits 18 s for the device (1 s a step on average)."""
    burst = lambda step: 10.0 if step == 0 else (18.0 if step % 20 == 0 else 0.1)
    shown = shown_by(StepBar, burst, steps=100)
    assert "41/100 [00:49<00:58" in shown[41], shown[41]  # 40 steps in 39.8 s since the compile
    assert "41/100 [00:49<00:58" not in shown_by(tqdm.tqdm, burst, steps=100)[41]  # tqdm's smoothed rate


def test_a_disabled_bar_iterates_every_item():
    assert list(StepBar(range(3), disable=True)) == [0, 1, 2]
