"""What a run writes: curves.png's panels (labels, the warm-start point, legends clear of the data)."""

from __future__ import annotations

import json

import matplotlib
import numpy as np

matplotlib.use("Agg")
from matplotlib.figure import Figure

from comppo_jax.train.outputs import PANELS, plot_run


def test_curves_label_every_axis_start_accuracy_at_the_warm_start_and_keep_legends_off_the_data(tmp_path, monkeypatch):
    rows = [{"step": step, "reward/mean": 0.1 * step, "kl_loss": 0.01, "clip_fraction": 0.02, "entropy": 0.5, "grad_norm": 1.0,
             **({"dev_accuracy": 0.5 + 0.01 * step} if step % 2 == 0 else {})} for step in range(1, 9)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    saved = []
    savefig = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda figure, *args, **kwargs: (saved.append(figure), savefig(figure, *args, **kwargs)))
    plot_run(str(tmp_path / "metrics.jsonl"), str(tmp_path / "curves.png"), title="t", warm_start_accuracy=0.4)
    (figure,) = saved
    figure.canvas.draw()
    axes = figure.axes[: len(PANELS)]
    assert all(axis.get_ylabel() and axis.get_xlabel() for axis in axes)
    accuracy = next(axis for axis in axes if axis.get_title().startswith("dev accuracy"))
    (line,) = accuracy.lines
    np.testing.assert_array_equal(line.get_xdata(), [0, 2, 4, 6, 8])
    assert line.get_ydata()[0] == 0.4
    for axis in axes:
        legend = axis.get_legend()
        if legend is not None:  # entirely below the plotting area
            assert legend.get_window_extent().y1 <= axis.get_window_extent().y0
