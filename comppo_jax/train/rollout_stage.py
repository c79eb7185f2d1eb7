"""The rollout stage: prompts -> sample -> reward -> dynamic sampling -> behaviour scoring.

Its output is one `Experience` per step: the rewarded generation, scored by the policy that
generated it (the behaviour policy: its log-probs, its own gate kappa, the critic's features) and
by the frozen reference (comppo_jax.rollout.experience, the pipeline held-out diagnostics run
too), with the version of that policy (how many updates it had). The stage owns what only it
reads: the prompt stream, the tokenizer, the reward schedule and verifier pool, the reference and
the decode layout the sampler runs in. The dev evaluation decodes greedily in the same layout
(`RolloutStage.evaluate`).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np

from comppo_jax.models import lora
from comppo_jax.rollout import greedy_accuracy
from comppo_jax.rollout.experience import ExperienceEnv, Sampled, dispatch, experience
from comppo_jax.rollout.turns import Conversations, ToolUse
from comppo_jax.train.decode_layout import DecodeLayout
from comppo_jax.train.specs import RolloutStageSpec
from comppo_jax.train.update import cast_params


class PromptIterator:
    """Deterministic epochs of shuffled prompts; `position` (epoch, index) is checkpointable."""

    def __init__(self, count: int, batch_size: int, seed: int, position=(0, 0)):
        self.count, self.batch_size, self.seed = count, batch_size, seed
        self.epoch, self.index = position

    @property
    def position(self) -> list[int]:
        return [self.epoch, self.index]

    def next(self) -> list[int]:
        order = np.random.default_rng([self.seed, self.epoch]).permutation(self.count)
        if self.index + self.batch_size > self.count:
            self.epoch, self.index = self.epoch + 1, 0
            order = np.random.default_rng([self.seed, self.epoch]).permutation(self.count)
        chosen = order[self.index : self.index + self.batch_size]
        self.index += self.batch_size
        return [int(i) for i in chosen]


class Experience(NamedTuple):
    """One step's batch as the rollout stage leaves it."""

    step: int
    version: int  # updates the generating (behaviour) policy had: its checkpoint step
    sampled: Sampled  # the generation, its problems, texts, rewards and verdicts
    # comppo_jax.rollout.Rollout: behaviour and reference log-probs, own kappa, the critic's features (freed by the
    # learner after the critic's epochs)
    rollout: Any
    reshard_seconds: float  # moving the weights into the decode layout
    generation_window: tuple[float, float]  # (dispatched, ready) wall times of its first generation round
    packing: Any = None  # comppo_jax.models.packing.Packing: the rows the scoring pass ran on (None: unpacked)


@dataclasses.dataclass
class Started:
    """A batch whose first generation round is dispatched and not yet read back."""

    step: int
    version: int
    policy: Any  # the generating policy (compute dtype, training layout): scoring reads it
    sampler: Any  # the same weights in the decode layout
    prompts: list[int]  # round 0's prompt indices
    generation: Any  # round 0 on the decode mesh (device arrays, possibly still being computed)
    reshard_seconds: float
    window: list  # [dispatched, ready]: `ready` is set by a watcher thread that only waits


def watch(arrays, window: list) -> None:
    """Sets window[1] to the time `arrays` are computed, from a thread that only waits on them
    (dispatching from a second thread could interleave collectives and deadlock)."""

    def wait():
        jax.block_until_ready(arrays)
        window[1] = time.time()

    threading.Thread(target=wait, daemon=True).start()


class RolloutContext(NamedTuple):
    """What the rollout stage runs with besides its spec."""

    mesh: Any  # the training mesh: scored batches live there
    model_config: Any
    tokenizer: Any
    problems: tuple[list, list]  # (train, dev)
    decode: DecodeLayout
    reference: Callable  # () -> the frozen reference policy (None without a KL term)
    pool: Any  # the VerifierPool
    environment: Any = None  # the comppo_jax.environments.Environment of multi-turn rollouts (rollout.environment)


class RolloutStage:
    """Samples, rewards and scores one batch per step (module docstring).

    `prompts` is the stream's checkpointable position; `stop` (StopSignals) ends a first step
    while it compiles; `compiling(what)` says so the first time."""

    def __init__(
        self,
        spec: RolloutStageSpec,
        context: RolloutContext,
        *,
        prompt_position,
        stop,
        compiling: Callable[[str], None],
        show_progress: bool,
    ):
        self.spec, self.context = spec, context
        self.train_problems, self.dev_problems = context.problems
        self.prompts = PromptIterator(
            len(self.train_problems), spec.prompts_per_step, spec.seed, position=prompt_position
        )
        self.stop, self.compiling, self.show_progress = stop, compiling, show_progress

    def _env(self, step: int, *, first: bool = False) -> ExperienceEnv:
        """Batch `step`'s experience environment: its reward coefficients, the refill rounds' prompts,
        and the notices and stop checks of the run's first step."""
        context = self.context
        checks = {
            "sampler": lambda: self.compiling("the sampler"),
            "sampling": lambda: (
                first and self.stop.check(f"step {step}'s first sampling (compiling; the step is not saved)")
            ),
            "scoring": lambda: self.compiling("the scoring pass and credit"),
            "scored": lambda: (
                first and self.stop.check(f"step {step}'s first scoring (compiling; the step is not saved)")
            ),
        }
        return ExperienceEnv(
            context.model_config,
            context.tokenizer,
            context.pool,
            self.spec.reward_schedule.at(self.spec.steps.schedule_step(step)),
            layout=context.decode,
            mesh=context.mesh,
            refill=lambda: [self.train_problems[i] for i in self.prompts.next()],
            train_prompts=len(self.train_problems),
            notify=lambda event: checks[event](),
            environment=context.environment,
        )

    def tools(self) -> ToolUse | None:
        """The conversations' environment and limits (None: one turn)."""
        rollout = self.spec.experience.rollout
        if not rollout.environment:
            return None
        return ToolUse(self.context.environment, rollout.max_turns, rollout.max_reply_tokens)

    def start(self, step: int, policy, version: int, step_rng, prompts: list[int] | None = None) -> Started:
        """Dispatches batch `step`'s first generation round with `policy` (after `version` updates),
        on the next prompts of the stream (or `prompts`, a resumed batch's own)."""
        resharding = time.time()
        sampler = jax.block_until_ready(self.context.decode.reshard(policy))  # the sampler's copy in the decode layout
        reshard_seconds = time.time() - resharding
        prompts = self.prompts.next() if prompts is None else prompts
        window = [time.time(), None]
        chosen = [self.train_problems[i] for i in prompts]
        generation = dispatch(sampler, chosen, step_rng, self.spec.experience.rollout, self._env(step))
        arrays = generation.generation if isinstance(generation, Conversations) else generation
        if not self.context.decode.separate:
            # Shared devices: it runs before the programs dispatched after it. XLA:CPU may run independent
            # programs in any order, and two processes ordering their collectives differently would deadlock.
            jax.block_until_ready(arrays)
        watch(arrays, window)
        return Started(step, version, policy, sampler, prompts, generation, reshard_seconds, window)

    def finish(self, started: Started, step_rng, *, first: bool) -> Experience:
        """Rewards the batch (with dynamic sampling's refill rounds) and scores it with its
        generating policy and the reference. `first`: the run's first step, whose programs
        compile; a stop request ends it."""
        model_config, decode = self.context.model_config, self.context.decode

        def scoring_policy():
            """`started.policy` as scoring reads it (a LoRA policy's adapters unmerged, as the update reads them,
            on its own base), after the sampling: the decode copy is freed unless it is the same arrays."""
            policy, sampler = started.policy, started.sampler
            started.sampler = started.policy = None
            unmerged = decode.resharded or lora.has_adapters(policy) or decode.compute_reshard is not None
            return cast_params(policy, model_config.dtype) if unmerged else sampler

        chosen = [self.train_problems[i] for i in started.prompts]
        scored = experience(
            scoring_policy,
            self.context.reference,
            chosen,
            step_rng,
            self.spec.experience,
            self._env(started.step, first=first),
            sampler=started.sampler,
            dispatched=started.generation,
        )
        window = (started.window[0], started.window[1] or time.time())
        return Experience(
            started.step,
            started.version,
            scored.sampled,
            scored.rollout,
            started.reshard_seconds,
            window,
            scored.packing,
        )

    def evaluate(self, params, stoppable: bool) -> float:
        """Dev accuracy (greedy, in the decode layout); `stoppable`: a stop request ends it within
        one batch (RunStopped). An evaluation inside a step is not: its accuracy drives the
        controller, so the step is saved only with it (and a resumed run equals the straight one)."""
        decode = self.context.decode
        sampler = decode.evaluation_weights(params)
        with jax.set_mesh(decode.mesh):
            return greedy_accuracy(
                sampler,
                self.context.model_config,
                self.context.tokenizer,
                self.dev_problems,
                self.context.pool,
                max_new_tokens=self.spec.experience.rollout.max_new_tokens,
                progress="dev eval" * self.show_progress,
                after_batch=(lambda: self.stop.check("the dev evaluation")) if stoppable else None,
                tools=self.tools(),
            )
