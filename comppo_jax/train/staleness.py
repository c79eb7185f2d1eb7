"""Bounded staleness (rollout.staleness = k): the rollout stage runs up to k batches ahead.

Batch n is generated, rewarded and behaviour-scored by the policy after update
`generating_version(n, k)` = max(0, n - 1 - k), fixed by n and k alone, so results never depend
on timing. At step n the learner takes batch n (started k steps earlier) and the queue starts
batch n + k with the current policy (after update n - 1) before the learner updates: its
generation is dispatched to the devices first and runs while the update's programs follow
(overlapping on separate meshes, mesh.rollout_devices; queued behind it on shared devices). One
thread dispatches every program: two threads dispatching collectives onto devices can
interleave them differently on each device and deadlock.

k = 0 is the synchronous loop: batch n is started and finished at step n with the current actor.
A checkpoint after step s holds the batches in flight (s + 1 .. s + k): their generating
policies (`state["behaviour"]`, k trees in the compute dtype) and, in the meta, their steps,
versions and prompts; a resume starts them again and so equals the straight run bitwise.
"""

from __future__ import annotations

from collections.abc import Callable

import jax

from comppo_jax.train.rollout_stage import Experience, RolloutStage, Started


def generating_version(step: int, staleness: int) -> int:
    """The update whose policy generates batch `step` (1-based) at staleness k: max(0, step - 1 - k)."""
    return max(0, step - 1 - staleness)


class RolloutQueue:
    """The batches started ahead of the learner (module docstring). `snapshot(actor)` is a fresh
    compute-dtype copy of the actor (the update donates the actor's own buffers); `rng` the run's
    key, folded with each batch's step."""

    def __init__(self, stage: RolloutStage, staleness: int, last_step: int, rng, snapshot: Callable):
        self.stage, self.staleness, self.last_step, self.rng, self.snapshot = stage, staleness, last_step, rng, snapshot
        self.pending: dict[int, Started] = {}

    def key(self, step: int):
        return jax.random.fold_in(self.rng, step)

    def take(self, step: int, actor, *, first: bool) -> Experience:
        """Batch `step` (the learner is about to apply update `step`, holding the policy after
        update step - 1), after starting the batches up to step + k."""
        if step not in self.pending:  # staleness 0, or a new run's first step: the current actor generates it
            policy = actor if not self.staleness else self.snapshot(actor)
            self.pending[step] = self.stage.start(step, policy, step - 1, self.key(step))
        experience = self.stage.finish(self.pending.pop(step), self.key(step), first=first)
        policy = None
        for later in range(max(self.pending, default=step) + 1, min(step + self.staleness, self.last_step) + 1):
            policy = self.snapshot(actor) if policy is None else policy
            self.pending[later] = self.stage.start(later, policy, step - 1, self.key(later))
        return experience

    def saved(self, actor) -> tuple[dict, dict]:
        """(state entries, meta entries) a checkpoint holds for the batches in flight: k policies
        (padded with copies when fewer are in flight, so the state's structure is fixed by k)."""
        if not self.staleness:
            return {}, {}
        flight = [self.pending[step] for step in sorted(self.pending)]
        policies = [started.policy for started in flight]
        padding = policies[-1] if policies else self.snapshot(actor)
        policies += [padding] * (self.staleness - len(policies))
        meta = [{"step": s.step, "version": s.version, "prompts": list(s.prompts)} for s in flight]
        return {"behaviour": policies}, {"in_flight": meta}

    def restore(self, in_flight: list[dict], behaviour: list) -> None:
        """Starts the batches a checkpoint held in flight again, with their own policies and prompts."""
        for entry, policy in zip(in_flight, behaviour):
            self.pending[entry["step"]] = self.stage.start(
                entry["step"], policy, entry["version"], self.key(entry["step"]), prompts=entry["prompts"]
            )
