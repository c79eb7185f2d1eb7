"""Generation overlapped with training: one short configs/tiny.py run at rollout.staleness 0 and at 1.

Both runs are the same train() (random weights, a few warm-start steps, `batch` prompts x 2
samples, `length` new tokens, one critic-only step, then `repeats` RL steps) in temporary output
directories. With two or more devices the last half of them roll out (mesh.rollout_devices) and
the rest train; on one device both stages share it and staleness 1 can only overlap what the
device runs concurrently.
Printed: each step's `timing/*` fields from the run's metrics.jsonl, then the mean step time of
the steps after the first actor update (which compiles) and its ratio between the two runs.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile

import jax

from benchmarks.timing import print_table
from comppo_jax.models.loading import PRESET_DIR, load_config_file
from comppo_jax.train.loop import train

STALENESS = (0, 1)
CRITIC_WARMUP = 1  # steps that update only the critic; the first actor update after them compiles


def rollout_devices() -> int:
    """The last half of the devices roll out; none on one device (both stages share it)."""
    return jax.device_count() // 2


def run_config(staleness: int, batch: int, length: int, steps: int, output_dir: str):
    cfg = load_config_file(PRESET_DIR / "tiny.py")
    cfg.update(output_dir=output_dir, steps=steps, progress=False, plot=False)
    cfg.warm_start.steps = 3
    cfg.data.update(train_size=max(40, 4 * batch * (steps + 2)), dev_size=4)
    cfg.rollout.update(prompts_per_step=batch, samples_per_prompt=2, max_new_tokens=length, staleness=staleness)
    cfg.train.update(minibatch_size=batch, critic_warmup_steps=CRITIC_WARMUP, eval_every=0)
    cfg.reward.workers = 1
    cfg.mesh.rollout_devices = rollout_devices()
    return cfg


def step_rows(staleness: int, metrics_path: str) -> list[dict]:
    with open(metrics_path) as f:
        records = [json.loads(line) for line in f]
    return [
        {
            "staleness": staleness,
            "step": r["step"],
            "staleness logged": r["staleness"],
            "step s": r["seconds"],
            "rollout stage s": r["timing/rollout_seconds"],
            "update s": r["timing/update_seconds"],
            "generation s": r["timing/generation_seconds"],
            "generation during updates": r["timing/generation_overlap"],
        }
        for r in records
        if "timing/generation_overlap" in r
    ]


def run(batch: int = 4, length: int = 12, repeats: int = 3) -> None:
    if repeats < 2:
        raise ValueError(f"--repeats={repeats}: the staleness suite times the RL steps after the first, so needs >= 2")
    rows = []
    for staleness in STALENESS:
        with tempfile.TemporaryDirectory() as output_dir:
            train(run_config(staleness, batch, length, repeats, output_dir))
            rows += step_rows(staleness, os.path.join(output_dir, "metrics.jsonl"))
    devices, rolling = jax.device_count(), rollout_devices()
    split = f"{rolling} rolling out, {devices - rolling} training" if rolling else "both stages on it"
    print(
        f"configs/tiny.py, {batch} prompts x 2 samples, {length} new tokens, {repeats} RL steps per run; "
        f"{devices} {jax.devices()[0].device_kind} device(s), {split}; jax {jax.__version__}"
    )
    print_table(
        [
            {
                **row,
                **{k: f"{row[k]:.3f}" for k in ("step s", "rollout stage s", "update s", "generation s")},
                "generation during updates": f"{row['generation during updates']:.0%}",
            }
            for row in rows
        ],
        list(rows[0]),
    )
    means = {
        s: statistics.mean(row["step s"] for row in rows if row["staleness"] == s and row["step"] > CRITIC_WARMUP + 1)
        for s in STALENESS
    }
    print(
        f"mean step s after step {CRITIC_WARMUP + 1} (the first actor update, which compiles): "
        + ", ".join(f"staleness {s} {seconds:.3f}" for s, seconds in means.items())
        + f"; staleness 1 / 0: {means[1] / means[0]:.2f}"
    )
