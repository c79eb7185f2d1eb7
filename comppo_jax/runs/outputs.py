"""What a run writes each step: metrics to JSONL, TensorBoard and W&B, and a PNG at the end (its
config.json: comppo_jax.train.schema).

`metrics.jsonl` has one JSON object per step (numbers, the phase name and one sampled
response); the other loggers of `config.loggers` get every numeric metric: TensorBoard event
files under `tensorboard/`, a Weights & Biases run (`WandbLogger`, with the kept responses of
comppo_jax.runs.samples as a table). Steps count
from 1: row `step` N describes the run's N-th step, the state after it is checkpoint N, and step 0
is the warm-started policy before any RL step. On resume from checkpoint N, rows after step N
(and a new run's: rows of an attempt that stopped before its first checkpoint) are set aside into
`metrics.jsonl.set_aside_at_step_N` first, so the file reads as one straight run.
"""

from __future__ import annotations

import io
import json
import math
import os
import sys
import tempfile
import time
import uuid

import numpy as np
from absl import logging

from comppo_jax import storage

METRICS_FILE = "metrics.jsonl"


# Runs before comppo_jax.train.diagnostics left out the explained variance of a batch whose returns were equal up
# to rounding logged it (about -1e13 there): no measurement, so readers drop it.
EXPLAINED_VARIANCES = ("critic/explained_variance", "credit/outcome_explained_variance")
NO_MEASUREMENT_BELOW = -1e3


# The fields measured against each response's outcome (comppo_jax.train.diagnostics.outcome_diagnostics).
AGAINST_THE_OUTCOME = ("credit/outcome_explained_variance", "credit/outcome_spearman", "credit/early_sign_agreement")


def one_outcome(reward_counts: dict) -> bool:
    """Whether a step's reward counts (reward/<verdict> and reward/malformed, as the rollout logs them) say every
    response had the same verdict and the same form. Its outcomes then differ by the reward's shaping alone (a
    length penalty under 0.01), so what a critic knows of them is no reading of what it knows of the outcome: an
    explained variance over that shaping's variance logged -181498 on a batch the policy got all right."""
    verdicts = [
        v for k, v in reward_counts.items() if k.startswith("reward/") and k not in ("reward/mean", "reward/malformed")
    ]
    if not verdicts:
        return False
    responses = sum(verdicts)
    return max(verdicts) == responses and reward_counts.get("reward/malformed", 0) in (0, responses)


def measured(row: dict) -> dict:
    """`row` without an explained variance below NO_MEASUREMENT_BELOW, and without the fields measured against the
    outcome on a step with `one_outcome` (runs logged them before comppo_jax.train.diagnostics left them out)."""
    dropped = AGAINST_THE_OUTCOME if one_outcome(row) else ()
    return {
        k: v for k, v in row.items() if k not in dropped and not (k in EXPLAINED_VARIANCES and v < NO_MEASUREMENT_BELOW)
    }


def read_metrics(path: str) -> list[dict]:
    """metrics.jsonl's rows (`measured`)."""
    return [measured(json.loads(line)) for line in storage.read_lines(path)]


def resumed_rows(path: str, resumed_step: int) -> list[dict]:
    """The rows of steps 1..`resumed_step` in the metrics file `path`, for a run resuming from that
    checkpoint. Lines that do not parse (a write torn by a crash) and rows past the checkpoint (steps
    the resumed run does again) are set aside, verbatim, into `path` + `.set_aside_at_step_<N>`; a
    warning names that file, and another names the steps whose rows are missing (a deleted file)."""
    lines = storage.read_lines(path)
    kept, aside = [], []
    for line in lines:
        try:
            row = json.loads(line)
            step = int(row["step"])
        except (ValueError, TypeError, KeyError):
            aside.append(line)
            continue
        if step <= resumed_step:
            kept.append(row)
        else:
            aside.append(line)
    if aside:
        aside_path = f"{path}.set_aside_at_step_{resumed_step}"
        storage.append_lines(aside_path, aside)
        logging.warning(
            "%s: %d line(s) that do not parse or lie past the resumed step %d set aside into %s",
            path,
            len(aside),
            resumed_step,
            aside_path,
        )
    missing = sorted(set(range(1, resumed_step + 1)) - {row["step"] for row in kept})
    if missing:
        logging.warning(
            "%s: no rows for step(s) %s of the %d the run resumes after (%s); the run goes on and logs from step %d",
            path,
            _ranges(missing),
            resumed_step,
            "the file is missing" if not lines else "lost",
            resumed_step + 1,
        )
    return kept


def _ranges(steps: list[int]) -> str:
    """[1, 2, 3, 7] as "1-3, 7"."""
    spans, start, last = [], steps[0], steps[0]
    for step in steps[1:] + [None]:
        if step is None or step != last + 1:
            spans.append(f"{start}-{last}" if last > start else f"{start}")
            start = step
        last = step
    return ", ".join(spans)


LOGGERS = ("jsonl", "tensorboard", "wandb")
WANDB_ID_FILE = "wandb_run_id"


def parse_loggers(spec: str) -> tuple[str, ...]:
    """config.loggers ("jsonl,tensorboard,wandb") as names; ValueError naming what is wrong."""
    names = tuple(dict.fromkeys(name.strip() for name in spec.split(",") if name.strip()))
    unknown = [name for name in names if name not in LOGGERS]
    if unknown:
        raise ValueError(f"unknown {', '.join(map(repr, unknown))}: expected a comma-separated subset of {LOGGERS}")
    if "jsonl" not in names:
        raise ValueError(
            "jsonl is always on (resume, plots and launch/report.py read metrics.jsonl): add it, e.g. jsonl,wandb"
        )
    return names


class WandbLogger:
    """A Weights & Biases run for a run directory: its scalars against `step` (so a resume that
    repeats steps logs them again rather than being dropped) and the kept responses as a table.
    The run id is kept in `<output_dir>/wandb_run_id`, so a resume continues the same W&B run (a
    new run starts its own); `WANDB_MODE=offline` writes it under `<output_dir>/wandb/` with no
    network."""

    def __init__(self, output_dir: str, config: dict, resuming: bool):
        import wandb  # the wandb extra

        id_path = storage.path(output_dir) / WANDB_ID_FILE
        if resuming and id_path.exists():
            run_id = id_path.read_text().strip()
        else:
            run_id = uuid.uuid4().hex[:8]  # W&B's own id form: 8 lowercase letters and digits
            storage.write_text(id_path, run_id + "\n")
        self.wandb = wandb
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "comppo_jax"),
            id=run_id,
            resume="allow",
            # wandb writes its own files with the OS: beside a bucket run, in a local folder
            dir=tempfile.mkdtemp(prefix="comppo_wandb_") if storage.is_remote(output_dir) else output_dir,
            name=storage.path(output_dir).name,
            config=config,
        )
        self.run.define_metric("*", step_metric="step")

    def log(self, metrics: dict) -> None:
        self.run.log({name: value for name, value in metrics.items() if _scalar(value)})

    def log_samples(self, record: dict) -> None:
        """comppo_jax.runs.samples' record as a table: one row per kept response, its per-token
        arrays as JSON text."""
        columns = ["step", "row", "prompt", "response", "reward", "verdict", "length", "mean_kappa", "tokens"]
        rows = []
        for response in record["responses"]:
            kappa = [v for v in response["tokens"].get("kappa", []) if v is not None]
            rows.append(
                [
                    record["step"],
                    response["row"],
                    response["prompt"],
                    response["response"],
                    response["reward"],
                    response["verdict"],
                    response["length"],
                    float(np.mean(kappa)) if kappa else None,
                    json.dumps({"t": response["t"], "pieces": response["pieces"], **response["tokens"]}),
                ]
            )
        self.run.log({"step": record["step"], "samples": self.wandb.Table(columns=columns, data=rows)})

    def close(self) -> None:
        self.run.finish()


def _scalar(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _summary_writer_class():
    """tensorboardX's SummaryWriter, imported on first use and without torch: tensorboardX imports torch, when
    installed, only to accept its tensors (we log floats), and that import is 3 s of every launch's start."""
    if "tensorboardX" in sys.modules or "torch" in sys.modules:
        from tensorboardX import SummaryWriter

        return SummaryWriter
    sys.modules["torch"] = None  # type: ignore[assignment]  # `import torch` raises ImportError meanwhile
    try:
        from tensorboardX import SummaryWriter
    finally:
        del sys.modules["torch"]
    return SummaryWriter


class MetricsWriter:
    """Writes step metrics to `output_dir`/metrics.jsonl and the other `loggers` (parse_loggers'
    names), and kept responses to the loggers that take them (wandb's table); keeps the rows of
    steps 1..`resumed_step` (the checkpoint the run resumed from; 0: a new run; `resumed_rows`).
    Disabled (`enabled=False`) it writes nothing: a multi-process run's other processes.
    `config`: the run's config as a dict, for wandb.

    On a disk every row is written as it comes. On a bucket (no appends) rows reach metrics.jsonl
    at each `flush()`, which the recorder calls before every checkpoint save starts, so a checkpointed
    step's row is never lost, and at least every `FLUSH_S` seconds, so the bucket shows progress; a
    preemption loses at most the rows since the last flush, which the resumed run writes again.
    TensorBoard's event file is written in a local folder and uploaded at each flush as an event
    file of its own under `tensorboard/` (TensorBoard reads every event file of a directory)."""

    FLUSH_S = 60.0

    def __init__(
        self,
        output_dir: str,
        resumed_step: int = 0,
        loggers: tuple[str, ...] = ("jsonl", "tensorboard"),
        enabled: bool = True,
        config: dict | None = None,
    ):
        self.log = self.tensorboard = self.wandb = None
        if not enabled:
            return
        self.path = storage.path(output_dir) / METRICS_FILE
        kept = resumed_rows(self.path, resumed_step)  # a new run sets an earlier attempt's rows aside, all of them
        storage.write_text(self.path, "".join(json.dumps(row) + "\n" for row in kept))
        self.log = storage.AppendLog(self.path)
        self.flushed_at = time.monotonic()
        self.tensorboard_dir = storage.path(output_dir) / "tensorboard"
        self.tensorboard_local = (
            tempfile.mkdtemp(prefix="comppo_tensorboard_") if storage.is_remote(output_dir) else None
        )
        self.purge_step = resumed_step + 1 if resumed_step else None
        self.segments = 0
        self.loggers = loggers
        if "wandb" in loggers:
            self.wandb = WandbLogger(output_dir, config or {}, resuming=resumed_step > 0)

    def _tensorboard(self):
        """The open TensorBoard writer, opened on first use (after each bucket upload, a new event file)."""
        if self.tensorboard is None and "tensorboard" in self.loggers:
            self.tensorboard = _summary_writer_class()(
                self.tensorboard_local or str(self.tensorboard_dir),
                purge_step=self.purge_step if self.segments == 0 else None,
                filename_suffix=f".{self.segments}",
            )
        return self.tensorboard

    def write(self, metrics: dict) -> None:
        if self.log is None:
            return
        self.log.append(json.dumps(metrics))
        tensorboard = self._tensorboard()
        if tensorboard is not None:
            for name, value in metrics.items():
                if _scalar(value) and name != "step":
                    tensorboard.add_scalar(name, value, metrics["step"])
            tensorboard.flush()
        if self.wandb is not None:
            self.wandb.log(metrics)
        if time.monotonic() - self.flushed_at > self.FLUSH_S:
            self.flush()

    def flush(self) -> None:
        """Makes every row written so far durable in the run directory (module docstring)."""
        if self.log is None:
            return
        self.log.flush()
        if self.tensorboard_local is not None and self.tensorboard is not None:
            self.tensorboard.close()
            self.tensorboard = None
            for name in storage.names(self.tensorboard_local):
                local = storage.path(self.tensorboard_local) / name
                storage.write_bytes(self.tensorboard_dir / name, local.read_bytes())
                local.unlink()
            self.segments += 1
        self.flushed_at = time.monotonic()

    def write_samples(self, record: dict) -> None:
        if self.wandb is not None:
            self.wandb.log_samples(record)

    def close(self) -> None:
        if self.log is None:
            return
        self.flush()
        self.log.close()
        self.log = None
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb is not None:
            self.wandb.close()


PANELS = (  # (title, y-axis label, metrics)
    ("reward", "mean reward", ("reward/mean",)),
    ("dev accuracy (greedy)", "fraction correct", ("dev_accuracy",)),
    ("KL to reference / PPO clip fraction", "k3 KL / fraction", ("kl_loss", "clip_fraction")),
    ("entropy", "nats per token", ("entropy",)),
    ("gate kappa by position", "mean kappa", ("gate/first_third", "gate/middle_third", "gate/last_third")),
    ("gate kappa: correct vs incorrect", "mean kappa", ("gate/correct", "gate/incorrect")),
    ("critic", "EV / Spearman / MAE", ("critic/explained_variance", "critic/td_spearman", "critic/value_mae")),
    (
        "does the critic know the outcome?",
        "EV / Spearman / sign agreement",
        ("credit/outcome_explained_variance", "credit/outcome_spearman", "credit/early_sign_agreement"),
    ),
    ("grad norm", "global L2 norm", ("grad_norm", "critic_grad_norm")),
)


def plot_run(metrics_path: str, png_path: str, title: str = "", warm_start_accuracy: float | None = None) -> None:
    """Learning curves and gate statistics of a run's metrics.jsonl as one PNG; the dev-accuracy
    panel starts at step 0 with `warm_start_accuracy` (the policy before any RL step)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics_path)
    if warm_start_accuracy is not None:
        rows = [{"step": 0, "dev_accuracy": warm_start_accuracy}, *rows]
    columns = 4
    figure, axes = plt.subplots(
        math.ceil(len(PANELS) / columns),
        columns,
        figsize=(4 * columns, 3.6 * math.ceil(len(PANELS) / columns)),
        layout="constrained",
    )
    for axis, (panel, unit, names) in zip(np.ravel(axes), PANELS):
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
        axis.set_xlabel("step (0: warm start)" if panel.startswith("dev accuracy") else "step", fontsize=8)
        axis.set_ylabel(unit, fontsize=8)
        if axis.lines:  # below the axes, clear of the curves
            axis.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2, frameon=False)
    for axis in np.ravel(axes)[len(PANELS) :]:  # the last row's spare cells
        axis.axis("off")
    figure.suptitle(title)
    image = io.BytesIO()
    figure.savefig(image, format="png", dpi=100)
    plt.close(figure)
    storage.write_bytes(png_path, image.getvalue())
