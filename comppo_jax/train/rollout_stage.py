"""The rollout stage: prompts -> sample -> reward -> dynamic sampling -> behaviour scoring.

Its output is one `Experience` per step: the rewarded generation, scored by the policy that
generated it (the behaviour policy: its log-probs, its own gate kappa, the critic's features) and
by the frozen reference, with the version of that policy (how many updates it had). The stage
owns what only it reads: the prompt stream, the tokenizer, the reward schedule and verifier pool,
the reference and the decode layout the sampler runs in. The dev evaluation decodes greedily in
the same layout (`RolloutStage.evaluate`).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np

from comppo_jax.data.datasets import encodable_problems, load_dapo_math
from comppo_jax.data.synthetic import chained_arithmetic
from comppo_jax.models import lora
from comppo_jax.rollout import encode_prompts, engine_options, generate, greedy_accuracy, score_rollout
from comppo_jax.train.decode_layout import DecodeLayout
from comppo_jax.train.methods import RunParts, schedule_step, scoring_options
from comppo_jax.train.sampling import Sampled, dynamic_sampling, reward_generation
from comppo_jax.train.update import cast_params


def load_problems(data, seed: int):
    """(train, dev) problems for the config's `data` section."""
    if data.kind == "synthetic":
        problems = chained_arithmetic(
            data.train_size + data.dev_size,
            seed=seed,
            min_steps=data.min_steps,
            max_steps=data.max_steps,
            operations=data.operations,
        )
        return problems[: data.train_size], problems[data.train_size :]
    if data.kind == "dapo_math":
        return load_dapo_math(data.path, dev_size=data.dev_size, seed=seed)
    raise ValueError(f"config.data.kind={data.kind!r}; expected 'synthetic' or 'dapo_math'")


def load_encodable_problems(cfg, tokenizer):
    """(train, dev) problems without the rows the tokenizer cannot encode (skipped and counted)."""
    train_problems, dev_problems = load_problems(cfg.data, cfg.seed)
    where = cfg.data.path or f"the {cfg.data.kind} data"
    longest_prompt = cfg.model.arch.max_position_embeddings - cfg.rollout.max_new_tokens
    return (
        encodable_problems(tokenizer, train_problems, f"{where} (train)", max_prompt_tokens=longest_prompt),
        encodable_problems(tokenizer, dev_problems, f"{where} (dev)", max_prompt_tokens=longest_prompt),
    )


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


class RolloutStage:
    """Samples, rewards and scores one batch per step (module docstring).

    `prompts` is the stream's checkpointable position; `stop` (StopSignals) ends a first step
    while it compiles; `compiling(what)` says so the first time."""

    def __init__(
        self,
        cfg,
        mesh,
        model_config,
        tokenizer,
        problems: tuple[list, list],
        parts: RunParts,
        decode: DecodeLayout,
        reference,
        schedule,
        pool,
        *,
        prompt_position,
        stop,
        compiling: Callable[[str], None],
        show_progress: bool,
    ):
        self.cfg, self.mesh, self.model_config, self.tokenizer = cfg, mesh, model_config, tokenizer
        self.train_problems, self.dev_problems = problems
        self.parts, self.decode, self.reference, self.schedule, self.pool = parts, decode, reference, schedule, pool
        self.prompts = PromptIterator(
            len(self.train_problems), cfg.rollout.prompts_per_step, cfg.seed, position=prompt_position
        )
        self.stop, self.compiling, self.show_progress = stop, compiling, show_progress

    def _generate(self, sampler, prompt_indices: list[int], key):
        """Dispatches one generation round (returns at once; the arrays fill in on the decode mesh)."""
        cfg = self.cfg
        chosen = [self.train_problems[i] for i in prompt_indices]
        self.compiling("the sampler")
        key = self.decode.replicated(key)  # outside the decode mesh's context: it may come from the training devices
        with jax.set_mesh(self.decode.mesh):
            prompt_tokens, prompt_mask = encode_prompts(self.tokenizer, chosen)
            return generate(
                sampler,
                self.model_config,
                prompt_tokens,
                prompt_mask,
                key,
                max_new_tokens=cfg.rollout.max_new_tokens,
                temperature=cfg.rollout.temperature,
                top_p=cfg.rollout.top_p,
                num_samples=cfg.rollout.samples_per_prompt,
                eos_token_ids=(self.tokenizer.eos_token_id,),
                pad_token_id=self.tokenizer.pad_token_id,
                **engine_options(cfg.rollout),
            )

    def start(self, step: int, policy, version: int, step_rng, prompts: list[int] | None = None) -> Started:
        """Dispatches batch `step`'s first generation round with `policy` (after `version` updates),
        on the next prompts of the stream (or `prompts`, a resumed batch's own)."""
        resharding = time.time()
        sampler = jax.block_until_ready(self.decode.reshard(policy))  # the compute copy in the decode layout
        reshard_seconds = time.time() - resharding
        prompts = self.prompts.next() if prompts is None else prompts
        window = [time.time(), None]
        generation = self._generate(sampler, prompts, step_rng)
        if not self.decode.separate:
            # Shared devices: it runs before the programs dispatched after it. XLA:CPU may run independent
            # programs in any order, and two processes ordering their collectives differently would deadlock.
            jax.block_until_ready(generation)
        watch(generation, window)
        return Started(step, version, policy, sampler, prompts, generation, reshard_seconds, window)

    def finish(self, started: Started, step_rng, *, first: bool) -> Experience:
        """Rewards the batch (with dynamic sampling's refill rounds) and scores it with its
        generating policy and the reference. `first`: the run's first step, whose programs
        compile; a stop request ends it."""
        cfg, decode, step = self.cfg, self.decode, started.step
        coefficients = self.schedule.at(schedule_step(cfg, self.parts.recipe, step))
        group = cfg.rollout.samples_per_prompt

        # Sample and reward before scoring, so that dynamic sampling scores only the groups it keeps.
        def sample(round_index: int) -> Sampled:  # round 0: the started batch; later: dynamic sampling's refills
            if round_index == 0:
                prompts, generation = started.prompts, started.generation
            else:
                prompts = self.prompts.next()
                key = jax.random.fold_in(step_rng, 1 + round_index)  # 1: the gate control's
                generation = self._generate(started.sampler, prompts, key)
            chosen = [self.train_problems[i] for i in prompts]
            return reward_generation(
                self.tokenizer, self.pool, decode.to_training(generation, self.mesh), chosen, group, coefficients
            )

        sampled = sample(0)
        if cfg.rollout.dynamic_sampling:
            sampled = dynamic_sampling(
                sampled,
                sample,
                group,
                cfg.rollout.max_refills,
                cfg.rollout.dynamic_sampling_filter,
                len(self.train_problems),
            )
        if first:
            self.stop.check(f"step {step}'s first sampling (compiling; the step is not saved)")
        # Scoring reads `policy` (a LoRA policy's adapters unmerged, as the update reads them, on its
        # own base); the decode copy is freed unless it is the same arrays.
        unmerged = decode.resharded or lora.has_adapters(started.policy)
        policy = cast_params(started.policy, self.model_config.dtype) if unmerged else started.sampler
        started.sampler = started.policy = None
        # Behaviour and reference scoring (detached): the generating policy's log-probs, gate and features.
        self.compiling("the scoring pass and credit")
        rollout = score_rollout(
            policy, self.reference(), self.model_config, sampled.generation, **scoring_options(cfg, self.parts)
        )
        if first:
            self.stop.check(f"step {step}'s first scoring (compiling; the step is not saved)")
        window = (started.window[0], started.window[1] or time.time())
        return Experience(step, started.version, sampled, rollout, started.reshard_seconds, window)

    def evaluate(self, params, stoppable: bool) -> float:
        """Dev accuracy (greedy, in the decode layout); `stoppable`: a stop request ends it within
        one batch (RunStopped). An evaluation inside a step is not: its accuracy drives the
        controller, so the step is saved only with it (and a resumed run equals the straight one)."""
        sampler = self.decode.reshard(params)
        with jax.set_mesh(self.decode.mesh):
            return greedy_accuracy(
                sampler,
                self.model_config,
                self.tokenizer,
                self.dev_problems,
                self.pool,
                max_new_tokens=self.cfg.rollout.max_new_tokens,
                progress="dev eval" * self.show_progress,
                after_batch=(lambda: self.stop.check("the dev evaluation")) if stoppable else None,
            )
