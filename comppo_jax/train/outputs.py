"""What a run writes: metrics per step to JSONL and TensorBoard, and a PNG at the end.

`metrics.jsonl` has one JSON object per step (numbers, the phase name and one sampled
response); TensorBoard event files under `tensorboard/` get every numeric metric. On resume,
rows at or after the restored step are dropped first, so the file reads as one straight run.
"""

from __future__ import annotations

import json
import math
import os

import numpy as np

METRICS_FILE = "metrics.jsonl"


def read_metrics(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


class MetricsWriter:
    """Appends step metrics to `output_dir`/metrics.jsonl and TensorBoard; keeps rows before `start_step`.
    Disabled (`enabled=False`) it writes nothing: a multi-process run's other processes."""

    def __init__(self, output_dir: str, start_step: int = 0, tensorboard: bool = True, enabled: bool = True):
        self.file = self.tensorboard = None
        if not enabled:
            return
        self.path = os.path.join(output_dir, METRICS_FILE)
        kept = [row for row in read_metrics(self.path) if row["step"] < start_step] if start_step and os.path.exists(self.path) else []
        self.file = open(self.path, "w")
        for row in kept:
            self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        if tensorboard:
            from tensorboardX import SummaryWriter  # imported lazily: only runs that log need it

            self.tensorboard = SummaryWriter(os.path.join(output_dir, "tensorboard"), purge_step=start_step or None)

    def write(self, metrics: dict) -> None:
        if self.file is None:
            return
        self.file.write(json.dumps(metrics) + "\n")
        self.file.flush()
        if self.tensorboard is not None:
            for name, value in metrics.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool) and name != "step":
                    self.tensorboard.add_scalar(name, value, metrics["step"])
            self.tensorboard.flush()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        if self.tensorboard is not None:
            self.tensorboard.close()


PANELS = (
    ("reward", ("reward/mean",)),
    ("dev accuracy (greedy)", ("dev_accuracy",)),
    ("KL to reference / PPO clip fraction", ("kl_loss", "clip_fraction")),
    ("entropy", ("entropy",)),
    ("gate kappa by position", ("gate/first_third", "gate/middle_third", "gate/last_third")),
    ("gate kappa: correct vs incorrect", ("gate/correct", "gate/incorrect")),
    ("critic", ("critic/explained_variance", "critic/td_spearman", "critic/value_mae")),
    ("grad norm", ("grad_norm", "critic_grad_norm")),
)


def plot_run(metrics_path: str, png_path: str, title: str = "") -> None:
    """Learning curves and gate statistics of a run's metrics.jsonl as one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics_path)
    columns = 4
    figure, axes = plt.subplots(math.ceil(len(PANELS) / columns), columns, figsize=(4 * columns, 3 * math.ceil(len(PANELS) / columns)))
    for axis, (panel, names) in zip(np.ravel(axes), PANELS):
        for name in names:
            points = [(row["step"], row[name]) for row in rows if isinstance(row.get(name), (int, float))]
            if points:
                steps, values = zip(*points)
                axis.plot(steps, values, marker="o" if len(points) < 20 else None, markersize=3, label=name)
        if panel.startswith("gate kappa by"):
            band = [(row["step"], row["gate/mean"], row["gate/iqr"]) for row in rows if "gate/iqr" in row]
            if band:
                steps, mean, iqr = (np.asarray(x) for x in zip(*band))
                axis.fill_between(steps, mean - iqr / 2, mean + iqr / 2, alpha=0.2, label="mean +- IQR/2")
        axis.set_title(panel, fontsize=9)
        axis.set_xlabel("step", fontsize=8)
        if axis.lines:
            axis.legend(fontsize=7)
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(png_path, dpi=100)
    plt.close(figure)
