"""The recorder: each step's metrics, the checkpoints, and the run's summary and plots.

`Recorder.step_metrics` gathers a step's numbers from the rollout (rewards, lengths, the policy's
own gate) and the learner (losses, norms, the critic's diagnostics, the credit against the outcome);
`Recorder.record` writes them (metrics.jsonl and the other config.loggers: TensorBoard, wandb) and
keeps a few responses with their per-token credit every `outputs.sample_every` steps
(comppo_jax.train.samples; their files: comppo_jax.runs.samples);
`Recorder.checkpoint` saves an async Orbax checkpoint every `checkpoint.every` steps, at every
dev evaluation (so keep_best keeps the best evaluated policy), at the last step and when a stop
was requested. `Recorder.meta` is what a checkpoint holds beside the state: the step, the
stages' own state (the prompt stream's position, the controller, the skipped-update guard) and the
run's gate profile. `Recorder.finish` writes summary.json, gate_profile.json and curves.png.
"""

from __future__ import annotations

import json
import time

import numpy as np
from absl import logging

from comppo_jax import sharding, storage
from comppo_jax.credit import position_bin_totals, save_position_schedule, schedule_from_totals
from comppo_jax.credit.registry import realized_transport
from comppo_jax.credit.schedule import DEFAULT_BINS
from comppo_jax.data.rewards import Verdict
from comppo_jax.runs.checkpoint import RunCheckpoints
from comppo_jax.runs.outputs import METRICS_FILE, MetricsWriter, one_outcome, plot_run, read_metrics
from comppo_jax.runs.samples import save_samples
from comppo_jax.train import controller
from comppo_jax.train.diagnostics import (
    KNOWS_NOTHING_BELOW,
    NOTICE_AFTER_STEPS,
    OUTCOME_FIELDS,
    blind_credit,
    critic_diagnostics,
    gate_statistics,
    outcome_diagnostics,
    outcome_reading,
)
from comppo_jax.train.guards import SkippedUpdates
from comppo_jax.train.samples import keeps_samples, kept_responses
from comppo_jax.train.specs import RecorderSpec

# The rollouts' own gates averaged per bin of t/T over the whole run (a comppo_jax.credit position
# schedule): the position-only control of a later run reads it (config.position_schedule).
GATE_PROFILE_FILE = "gate_profile.json"
BLIND_CREDIT_NOTICE = (
    f"credit: over the {NOTICE_AFTER_STEPS} steps to step %d the critic has predicted none of the outcome "
    f"(credit/outcome_explained_variance under {KNOWS_NOTHING_BELOW} on average) and the first half of each "
    "response got the outcome's sign at chance (credit/early_sign_agreement within 0.1 of 0.5 on average): the "
    "advantages reaching its early tokens carry no outcome. See 'Does the critic know the outcome?' on the run's "
    "page: python launch/report.py --run=%s"
)


def initial_meta() -> dict:
    """A new run's meta. step: the last step done, the number of the checkpoint that holds it;
    gate_profile: per-bin sums of the rollouts' own kappa over t/T (the position-only control's fit)."""
    return {
        "step": 0,
        "prompts": [0, 0],
        "controller": controller.initial_state(),
        "skipped_updates": SkippedUpdates(0).state(),
        "gate_profile": {"sums": [0.0] * DEFAULT_BINS, "counts": [0] * DEFAULT_BINS},
    }


class Recorder:
    """Metrics, checkpoints and the summary of one run (module docstring)."""

    def __init__(self, spec: RecorderSpec, checkpoints: RunCheckpoints, meta: dict, tokenizer, *, main_process: bool):
        self.spec, self.checkpoints, self.meta, self.main_process = spec, checkpoints, meta, main_process
        self.tokenizer = tokenizer  # the kept responses' token pieces
        self.last_step, self.warmup = spec.steps.total, spec.steps.warmup
        self.has_critic = spec.credit.recipe.critic != "none"
        self.update_windows: list[tuple[float, float]] = []  # the last updates' (start, end) wall times
        self.outcome_rows: list[dict] = []  # the last steps' credit against the outcome, for the notice
        self.noticed_blind_credit = False
        self.writer = MetricsWriter(
            spec.output_dir,
            resumed_step=meta["step"],
            loggers=spec.loggers,
            enabled=main_process,
            config=spec.record,
        )

    def evaluates(self, step: int) -> bool:
        """Whether step `step` ends with a dev evaluation (every train.eval_every actor-update steps)."""
        return self.spec.evaluates(step)

    def step_metrics(self, step: int, experience, learned) -> dict:
        """The step's numbers from its experience and its update (adds the rollouts' gates to the run's profile)."""
        sampled, scored, batch = experience.sampled, learned.scored, learned.batch
        host_mask, host = sampled.host_mask, sharding.to_host
        lengths = host_mask.sum(axis=1)
        metrics = dict(learned.metrics)
        metrics.update(sampled.reward_metrics)
        if learned.gate_change is not None:
            metrics["gate_refresh/mean_abs_change"] = learned.gate_change
        metrics["response_clip_ratio"] = float(np.mean(lengths >= self.spec.max_new_tokens))
        metrics["response_length"] = float(lengths.mean())
        correct = np.asarray([v is Verdict.CORRECT for v in sampled.verdicts])
        if scored.rollout.kappa is not None:  # the policy's own gate, every method that ran the behaviour pass
            own_kappa = host(scored.rollout.kappa)
            metrics.update(gate_statistics(own_kappa, host_mask, correct))
            profile = self.meta["gate_profile"]
            for name, totals in zip(("sums", "counts"), position_bin_totals(own_kappa, host_mask)):
                profile[name] = (np.asarray(profile[name]) + totals).tolist()
        estimator = self.spec.credit.estimator
        reads_kappa = self.has_critic or estimator.name == "comp_gae"  # the TD target, Comp-GAE's transport
        kappa = host(scored.kappa) if reads_kappa and scored.kappa is not None else None
        values = host(batch.old_values) if self.has_critic else None
        if values is not None:
            metrics.update(critic_diagnostics(values, host(batch.returns), sampled.reward_tokens, kappa, host_mask))
        transport = realized_transport(estimator, kappa, host_mask)
        advantages, single = host(batch.advantages), one_outcome(sampled.reward_metrics)
        metrics.update(outcome_diagnostics(advantages, values, sampled.reward_tokens, transport, host_mask, single))
        metrics.update(learned.importance)
        metrics["actor_updates"] = max(0, step - self.warmup)
        metrics["staleness"] = step - 1 - experience.version  # updates between the generating policy and the learner's
        return metrics

    def timeline(
        self, metrics: dict, experience, rollout_window: tuple[float, float], update_window: tuple[float, float]
    ) -> None:
        """Adds the step's wall times: the rollout stage's host time, the update's, the generation
        of this step's batch (dispatch to ready) and the fraction of it that ran during updates."""
        self.update_windows = (self.update_windows + [update_window])[-(self.spec.staleness + 2) :]
        started, ready = experience.generation_window
        overlapped = sum(max(0.0, min(ready, end) - max(started, begin)) for begin, end in self.update_windows)
        metrics.update(
            {
                "timing/rollout_seconds": rollout_window[1] - rollout_window[0],
                "timing/update_seconds": update_window[1] - update_window[0],
                "timing/generation_seconds": ready - started,
                "timing/generation_overlap": overlapped / max(ready - started, 1e-9),
            }
        )

    def record(
        self, step: int, metrics: dict, experience, learned, *, skipped: SkippedUpdates, phase: str, started: float
    ) -> None:
        """Writes step `step`'s metrics (after its dev evaluation and the controller), with its first response as a
        sample, and keeps a few responses with their per-token credit when the step is one to keep
        (comppo_jax.train.samples)."""
        metrics["skipped_updates"] = skipped.total
        if learned.nonfinite:
            metrics["nonfinite"] = ", ".join(learned.nonfinite)
        sampled = experience.sampled
        metrics.update(
            step=step,
            phase=phase,
            seconds=time.time() - started,
            reshard_seconds=experience.reshard_seconds,
            sample={
                "prompt": sampled.problems[0].prompt,
                "response": sampled.texts[0],
                "reward": float(sampled.rewards[0]),
            },
        )
        self.writer.write(metrics)
        self.notice_blind_credit(step, metrics)
        if keeps_samples(self.spec.kept, step, self.evaluates(step), last=step == self.last_step):
            kept = kept_responses(self.spec, self.tokenizer, step, sampled, learned.scored)
            if self.main_process:
                save_samples(self.spec.output_dir, kept)
            self.writer.write_samples(kept)

    def notice_blind_credit(self, step: int, metrics: dict) -> None:
        """Says once, in the log, when the critic has known nothing of the outcome and early credit has been at
        chance, on average over the last NOTICE_AFTER_STEPS steps (`blind_credit`; a notice: the controller is the
        paper's, unchanged)."""
        self.outcome_rows = [*self.outcome_rows, {k: metrics[k] for k in OUTCOME_FIELDS if k in metrics}]
        self.outcome_rows = self.outcome_rows[-NOTICE_AFTER_STEPS:]
        if self.main_process and not self.noticed_blind_credit and blind_credit(self.outcome_rows):
            self.noticed_blind_credit = True
            logging.warning(BLIND_CREDIT_NOTICE, step, self.spec.output_dir)

    def checkpoint(self, step: int, state: dict, metrics: dict, stages_meta: dict, *, stopping: bool) -> None:
        """Starts step `step`'s checkpoint when it is due (module docstring); `stages_meta`: the
        prompt stream's position, the controller's and the guard's state."""
        if step % self.spec.checkpoint_every == 0 or step == self.last_step or stopping or "dev_accuracy" in metrics:
            self.meta.update(step=step, **stages_meta)
            self.writer.flush()  # first: a checkpointed step's metrics row is never lost (a bucket has no appends)
            self.checkpoints.save(step, state, self.meta, metrics.get("dev_accuracy"))

    def stopped(self, step: int) -> dict:
        """Finishes a run stopped by a signal after `step`: its checkpoint is confirmed written."""
        self.checkpoints.close()  # waits for the save and raises if it failed
        self.writer.close()
        return {"stopped_at_step": step, "checkpoint": f"{self.checkpoints.steps_directory}/{step}"}

    def finish(self, final_accuracy: float, dev_problems: int, skipped: SkippedUpdates) -> dict:
        """The run's summary, written with its gate profile and curves by the main process."""
        spec, meta, checkpoints = self.spec, self.meta, self.checkpoints
        checkpoints.wait()
        summary = {
            "method": spec.method,
            "warm_start_dev_accuracy": meta["warm_start_dev_accuracy"],
            "final_dev_accuracy": final_accuracy,
            "steps": self.last_step,
            "actor_updates": max(0, self.last_step - self.warmup),
            "dev_problems": dev_problems,
            "best_checkpoint_step": checkpoints.best_step(),
            "best_dev_accuracy": checkpoints.best_accuracy(),
        }
        checkpoints.close()
        self.writer.close()
        if "warm_start_loss" in meta:
            summary["warm_start_loss"] = meta["warm_start_loss"]
        gated = (
            np.sum(meta["gate_profile"]["counts"]) > 0
        )  # no gate without the behaviour pass (rollout.old_log_probs=sampler)
        if gated:
            summary["mean_gate"] = float(np.sum(meta["gate_profile"]["sums"]) / np.sum(meta["gate_profile"]["counts"]))
        summary["skipped_updates"] = skipped.total
        if not self.main_process:
            return summary
        reading = outcome_reading(read_metrics(storage.path(spec.output_dir) / METRICS_FILE))
        if reading is not None:
            summary["credit_reading"] = reading
        if gated:
            profile = schedule_from_totals(
                meta["gate_profile"]["sums"],
                meta["gate_profile"]["counts"],
                {
                    "source": str(storage.path(spec.output_dir)),
                    "method": spec.method,
                    "steps": self.last_step,
                    "seed": spec.seed,
                },
            )
            save_position_schedule(profile, storage.path(spec.output_dir) / GATE_PROFILE_FILE)
        storage.write_text(storage.path(spec.output_dir) / "summary.json", json.dumps(summary, indent=2))
        if spec.plot:
            plot_run(
                storage.path(spec.output_dir) / METRICS_FILE,
                storage.path(spec.output_dir) / "curves.png",
                title=f"{spec.method}: dev accuracy {meta['warm_start_dev_accuracy']:.2f} -> {final_accuracy:.2f}",
                warm_start_accuracy=meta["warm_start_dev_accuracy"],
            )
        return summary
