"""Orbax checkpoints of a training run: async saves, the last N plus the best by dev accuracy.

A checkpoint is two items: `state` (arrays: actor and critic params, both optimizer states,
the base rng key) and `meta` (JSON: next step, prompt-iterator position, controller state,
warm-start accuracy). The frozen reference policy is saved once, beside the steps, when it is
not the loaded checkpoint (the tiny default's warm-started policy); otherwise it is reloaded
from `config.model.path` on resume. Restores go into the shardings of a target state built the
usual way, so a restored run is sharded like a fresh one.
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import orbax.checkpoint as ocp
from orbax.checkpoint.checkpoint_managers import preservation_policy

REFERENCE_DIR = "reference"


def _abstract(tree: Any) -> Any:
    return jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)


class RunCheckpoints:
    """Checkpoints under `directory`/checkpoints (and the reference under `directory`/reference)."""

    def __init__(self, directory: str, keep_last: int = 1, keep_best: int = 1, read_only: bool = False):
        self.directory = os.path.abspath(directory)
        if read_only and not os.path.isdir(os.path.join(self.directory, "checkpoints")):
            raise FileNotFoundError(f"{self.directory}/checkpoints does not exist; expected a training run's output_dir")
        dev_accuracy = lambda metrics: metrics["dev_accuracy"]
        policy = preservation_policy.AnyPreservationPolicy([
            preservation_policy.LatestN(n=keep_last),
            preservation_policy.BestN(get_metric_fn=dev_accuracy, n=keep_best, keep_checkpoints_without_metrics=False),
        ])
        options = ocp.CheckpointManagerOptions(preservation_policy=policy, best_fn=dev_accuracy, best_mode="max",
                                               keep_checkpoints_without_metrics=False, enable_async_checkpointing=True,
                                               create=not read_only, read_only=read_only)
        self.manager = ocp.CheckpointManager(os.path.join(self.directory, "checkpoints"), options=options,
                                             item_names=("state", "meta"))

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def best_step(self) -> int | None:
        return self.manager.best_step()

    def save(self, step: int, state: Any, meta: dict, dev_accuracy: float | None = None) -> None:
        """Starts an async save of `state` and `meta` as checkpoint `step` (the next step to run)."""
        metrics = None if dev_accuracy is None else {"dev_accuracy": float(dev_accuracy)}
        meta = json.loads(json.dumps(meta))  # a snapshot: the caller keeps mutating its dict while the save runs
        self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)),
                          metrics=metrics)

    def restore(self, target_state: Any, step: int | None = None) -> tuple[Any, dict]:
        """(state, meta) of `step` (default: the latest), with the target's structure and shardings."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"config.resume=True but there is no checkpoint under {self.directory}/checkpoints")
        restored = self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(_abstract(target_state)),
                                                                      meta=ocp.args.JsonRestore()))
        return restored["state"], restored["meta"]

    def resolve_step(self, step: str | int) -> int:
        """"latest", "best" or a saved step number -> a saved step (a clear error otherwise)."""
        steps = self.manager.all_steps()
        resolved = {"latest": self.latest_step, "best": self.best_step}.get(str(step), lambda: int(step))()
        if resolved not in steps:
            raise FileNotFoundError(f"no checkpoint {step!r} under {self.directory}/checkpoints; saved steps: {sorted(steps)}")
        return resolved

    def restore_params(self, targets: dict, step: int) -> dict:
        """Only the state entries named in `targets` (e.g. {"actor": ..., "critic": ...}) of checkpoint
        `step`, into the targets' shapes, dtypes and shardings (optimizer states are not read)."""
        abstract = {name: _abstract(target) for name, target in targets.items()}
        args = ocp.args.PyTreeRestore(item=abstract, restore_args=ocp.checkpoint_utils.construct_restore_args(abstract),
                                      partial_restore=True)
        return self.manager.restore(step, args=ocp.args.Composite(state=args))["state"]

    def save_reference(self, params: Any) -> None:
        with ocp.StandardCheckpointer() as checkpointer:
            checkpointer.save(os.path.join(self.directory, REFERENCE_DIR), params, force=True)

    def restore_reference(self, target: Any) -> Any:
        path = os.path.join(self.directory, REFERENCE_DIR)
        if not os.path.isdir(path):
            raise FileNotFoundError(f"{path} is missing: the run's warm-started reference policy cannot be restored")
        with ocp.StandardCheckpointer() as checkpointer:
            return checkpointer.restore(path, _abstract(target))

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.close()
