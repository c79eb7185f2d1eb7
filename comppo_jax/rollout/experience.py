"""The experience pipeline: prompts -> generate -> reward -> (dynamic sampling) -> score.

`experience(policy, reference, prompts, key, spec, env)` is the whole of it for one batch: the
rollout stage of the train loop and the held-out diagnostics both call it, and `dispatch` is the one
place a batch's responses are generated. Its parts:

- `dispatch`: `generate` on the decode layout's mesh (returns at once; the arrays fill in);
- `reward_generation`: decodes and verifies the responses (math-verify in killable workers);
- `dynamic_sampling` (rollout.dynamic_sampling, DAPO, Yu et al. 2025) keeps only informative
  prompt groups: with the accuracy filter (DAPO's, the default) those whose verdicts are neither
  all correct nor all wrong, with the reward filter those whose shaped rewards are not all equal (a
  group of equal rewards has zero group-relative advantage). Dropped groups are replaced from the
  prompt stream, one full batch of prompts per refill round (the sampler keeps its compiled shape),
  for at most `rollout.max_refills` rounds; groups still missing then are filled with dropped ones,
  so the batch keeps its size. With max_refills=-1 it draws until the batch is full, as DAPO does,
  and stops the run with `DynamicSamplingExhausted` once a whole pass over the training prompts
  could not fill it. Rows keep their group order;
- `score_rollout`: the generating policy's log-probs, gate and critic features, and the reference's
  log-probs (detached).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from comppo_jax import sharding
from comppo_jax.credit import informative_groups
from comppo_jax.data.rewards import RewardCoefficients, Verdict, score_responses, terminal_reward_tokens
from comppo_jax.models.packing import Packing, on_devices, worth_packing
from comppo_jax.rollout.sampler import Generation, generate
from comppo_jax.rollout.scoring import Rollout, score_rollout
from comppo_jax.rollout.text import decode_responses, encode_prompts
from comppo_jax.rollout.turns import Conversations, converse

DYNAMIC_SAMPLING_FILTERS = ("accuracy", "reward")


@dataclasses.dataclass(frozen=True)
class GateSpec:
    """How the gate reads the attention (paper eqs. herfindahl, cnorm, kappa_attention): the window of
    keys, the concentration statistic, the attention sinks it leaves out, and the gate's range and
    temperature."""

    window: str = "response"
    statistic: str = "herfindahl"
    sink_tokens: int = 4
    kappa_lo: float = 0.1
    kappa_hi: float = 0.9
    tau: float = 4.0

    def options(self) -> dict:
        """`policy_gate`'s keywords (and the gate's part of `score_rollout`'s)."""
        return dict(
            window=self.window,
            gate_statistic=self.statistic,
            sink_tokens=self.sink_tokens,
            kappa_lo=self.kappa_lo,
            kappa_hi=self.kappa_hi,
            tau=self.tau,
        )


@dataclasses.dataclass(frozen=True)
class RolloutSpec:
    """How a batch is generated and kept: the group of responses per prompt, the sampler's settings
    and its engine's, and dynamic sampling's."""

    samples_per_prompt: int
    max_new_tokens: int
    temperature: float
    top_p: float
    page_size: int
    decode_slots: int | None  # None: one slot per row
    paged_attention: str
    kv_dtype: str = "auto"
    weight_dtype: str = "auto"
    dynamic_sampling: bool = False
    dynamic_sampling_filter: str = "accuracy"
    max_refills: int = 3
    environment: str = ""  # multi-turn rollouts with this environment (comppo_jax.environments); "": one turn
    max_turns: int = 4
    max_reply_tokens: int = 32

    def sampling_options(self) -> dict:
        """`generate`'s keywords besides the prompts, key and token ids."""
        return dict(
            max_new_tokens=self.max_new_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            num_samples=self.samples_per_prompt,
            page_size=self.page_size,
            decode_slots=self.decode_slots,
            paged_attention=self.paged_attention,
            kv_dtype=self.kv_dtype,
        )


@dataclasses.dataclass(frozen=True)
class ScoringSpec:
    """What the scoring pass computes: the behaviour forward (`behaviour_pass`; the old log-probs
    rescored or the sampler's), the hidden layers and routing width the critic reads, the gate, the future
    attention influence's horizon the attention_anchor estimator reads."""

    temperature: float
    old_log_probs: str
    behaviour_pass: bool
    hidden_layers: tuple[int, ...] = ()
    top_k: int | None = None
    gate: GateSpec = GateSpec()
    packing: bool = False  # the policies run on packed rows (comppo_jax.models.packing)
    packing_min_saving: float = 0.0  # ... when that saves at least this fraction of the batch's rows
    influence_horizon: tuple[int, int] | None = None  # the future attention influence's (H_lo, H_hi), or None

    def options(self) -> dict:
        """`score_rollout`'s keywords (all but the kernel backend)."""
        return dict(
            temperature=self.temperature,
            hidden_layers=self.hidden_layers,
            top_k=self.top_k,
            old_log_probs=self.old_log_probs,
            behaviour_pass=self.behaviour_pass,
            influence_horizon=self.influence_horizon,
            **self.gate.options(),
        )


@dataclasses.dataclass(frozen=True)
class ExperienceSpec:
    rollout: RolloutSpec
    scoring: ScoringSpec


class DynamicSamplingExhausted(RuntimeError):
    """max_refills=-1 drew a whole pass over the training prompts in one step without filling the batch."""


class Sampled(NamedTuple):
    """A generation with its rewards (rows: `group` consecutive responses per prompt)."""

    generation: Generation
    problems: list  # the prompt of each group
    texts: list[str]
    rewards: np.ndarray  # [B] terminal rewards
    verdicts: list
    reward_metrics: dict
    host_mask: np.ndarray  # [B, T] response mask on the host
    reward_tokens: np.ndarray  # [B, T] the reward at each row's last token (of the policy's), and each reply's
    host_lengths: np.ndarray  # [B] real tokens (prompt + response) of each row, on the host
    env_mask: np.ndarray | None = None  # [B, T] a conversation's environment tokens (None: one turn)


def reward_generation(
    tokenizer: Any,
    pool: Any,
    generation: Generation | Conversations,
    problems: list,
    group: int,
    coefficients: RewardCoefficients,
) -> Sampled:
    """Decodes and verifies a generation's responses to `problems` (`group` rows each). A conversation's
    answer is read from the policy's tokens alone, its terminal reward goes to the policy's last token and
    each reply's reward to the call it answers; its tool calls and their outcomes are counted."""
    conversations = generation if isinstance(generation, Conversations) else None
    if conversations is not None:
        generation = conversations.generation
    assert isinstance(generation, Generation)
    host_mask = sharding.to_host(generation.response_mask)
    host_lengths = sharding.to_host(generation.attention_mask).sum(axis=1).astype(np.int32)
    texts = decode_responses(tokenizer, generation)
    env_mask = None if conversations is None else sharding.to_host(conversations.env_mask)
    policy_mask = host_mask if env_mask is None else host_mask & ~env_mask
    answers = texts if env_mask is None else decode_responses(tokenizer, generation, policy_mask)
    golds = [p.answer for p in problems for _ in range(group)]
    rewards, verdicts, metrics = score_responses(answers, golds, policy_mask.sum(axis=1), pool, coefficients)
    reward_tokens = terminal_reward_tokens(rewards, policy_mask)
    if conversations is not None:
        reward_tokens = reward_tokens + sharding.to_host(conversations.turn_rewards)
        metrics.update(tool_metrics(conversations, len(texts)))
    return Sampled(
        generation, list(problems), texts, rewards, verdicts, metrics, host_mask, reward_tokens, host_lengths, env_mask
    )


def tool_metrics(conversations: Conversations, rows: int) -> dict[str, float]:
    """env/calls (per response), env/<outcome> (replies by outcome, comppo_jax.environments.OUTCOMES)."""
    metrics = {"env/calls": float(np.sum(conversations.calls)) / rows}
    metrics.update({f"env/{outcome}": float(count) for outcome, count in conversations.outcomes.items()})
    return metrics


@functools.partial(jax.jit, static_argnames=("width", "layout"))
def _gather_rows(generations: list[Generation], rows: list, width: int, layout: Any) -> Generation:
    """`rows` of each generation, concatenated, sequences right-padded to `width`, laid out as `layout`
    (None: as the compiler picks). One program: a gather, pad and concatenation per field would each be
    one of their own, on a pod a cross-process program (XLA:CPU over gloo hangs on those back to back:
    docs/reliability.md)."""

    def field(name: str, values: list) -> jax.Array:
        if name in ("tokens", "attention_mask"):
            values = [jnp.pad(x, ((0, 0), (0, width - x.shape[1]))) for x in values]
        return jnp.concatenate(values)

    picked = [jax.tree.map(lambda x, r=r: x[r], generation) for generation, r in zip(generations, rows)]
    merged = Generation(*(field(name, list(values)) for name, values in zip(Generation._fields, zip(*picked))))
    return merged if layout is None else jax.lax.with_sharding_constraint(merged, layout)


def take_groups(pieces: list[tuple[Sampled, list[int]]], group: int) -> Sampled:
    """The chosen groups of several `Sampled` as one, in order. Sequences are right-padded to the
    widest (rows are prompt + response + right padding, so that only adds padding)."""
    width = max(s.generation.tokens.shape[1] for s, _ in pieces)
    rows = [np.asarray([g * group + i for g in groups for i in range(group)], np.int32) for _, groups in pieces]
    problems, texts, verdicts = [], [], []
    for (sampled, groups), picked in zip(pieces, rows):
        problems += [sampled.problems[g] for g in groups]
        texts += [sampled.texts[r] for r in picked]
        verdicts += [sampled.verdicts[r] for r in picked]
    host = lambda name: np.concatenate([getattr(s, name)[r] for (s, _), r in zip(pieces, rows)])
    env_mask = None if pieces[0][0].env_mask is None else host("env_mask")
    # Replicated over the pieces' mesh, the layout earlier runs scored (the scoring pass's float sums depend on it).
    laid_out = getattr(pieces[0][0].generation.tokens, "sharding", None)
    layout = NamedSharding(laid_out.mesh, PartitionSpec()) if isinstance(laid_out, NamedSharding) else None
    return Sampled(
        _gather_rows([s.generation for s, _ in pieces], rows, width, layout),
        problems,
        texts,
        host("rewards"),
        verdicts,
        {},
        host("host_mask"),
        host("reward_tokens"),
        host("host_lengths"),
        env_mask,
    )


def _combined_metrics(rounds: list[Sampled]) -> dict:
    """Reward counts summed over every sampled response; the mean reward over all of them."""
    total = {
        name: sum(s.reward_metrics[name] for s in rounds)
        for name in rounds[0].reward_metrics
        if name not in ("reward/mean", "env/calls")
    }
    total["reward/mean"] = float(np.mean(np.concatenate([s.rewards for s in rounds])))
    if "env/calls" in rounds[0].reward_metrics:  # a mean per response, as reward/mean
        total["env/calls"] = float(np.mean([s.reward_metrics["env/calls"] for s in rounds]))
    return total


def informative(sampled: Sampled, group: int, filter_by: str) -> np.ndarray:
    """[groups] bool: the groups dynamic sampling keeps. "accuracy": verdicts neither all correct nor
    all wrong (DAPO's filter); "reward": shaped rewards not all equal."""
    if filter_by not in DYNAMIC_SAMPLING_FILTERS:
        raise ValueError(f"rollout.dynamic_sampling_filter={filter_by!r}; expected one of {DYNAMIC_SAMPLING_FILTERS}")
    if filter_by == "accuracy":
        return informative_groups(np.asarray([v is Verdict.CORRECT for v in sampled.verdicts], np.float32), group)
    return informative_groups(sampled.rewards, group)


def dynamic_sampling(
    first: Sampled,
    draw: Callable[[int], Sampled],
    group: int,
    max_refills: int,
    filter_by: str = "accuracy",
    train_prompts: int = 0,
) -> Sampled:
    """DAPO's dynamic sampling (module doc): `first` and more batches `draw(1)`, `draw(2)`, ...,
    keeping informative groups (`informative`) until there are as many as `first` has. At most
    `max_refills` draws, then dropped groups fill the batch; with max_refills=-1 as many draws as a
    pass over the `train_prompts` training prompts takes, then `DynamicSamplingExhausted`.

    The batch's reward_metrics are the reward counts over every sampled response, plus
    dynamic_sampling/dropped_fraction (uninformative groups over all sampled), /refills (rounds
    drawn) and /uninformative_kept (dropped groups that filled the batch after the last round).
    """
    wanted = len(first.problems)
    until_full = max_refills < 0
    refills = (
        -(-train_prompts // wanted) - 1 if until_full else max_refills
    )  # a pass over the prompts: ceil(train / batch) rounds
    rounds: list[Sampled] = []
    kept: list[tuple[int, int]] = []
    dropped: list[tuple[int, int]] = []
    sampled = first
    while True:
        rounds.append(sampled)
        for g, useful in enumerate(informative(sampled, group, filter_by)):
            (kept if useful else dropped).append((len(rounds) - 1, g))
        if len(kept) >= wanted or len(rounds) > refills:
            break
        sampled = draw(len(rounds))
    if until_full and len(kept) < wanted:
        raise DynamicSamplingExhausted(
            f"dynamic sampling drew {len(rounds)} rounds of {wanted} prompts in one step, a whole pass over the "
            f"{train_prompts} training prompts, and found {len(kept)} of the {wanted} informative groups the batch "
            f"needs ({filter_by} filter: the policy answers nearly every group all right or all wrong); pass "
            "--config.rollout.max_refills=<count> to fill the batch with uninformative groups after that many refills"
        )
    uninformative_kept = max(wanted - len(kept), 0)
    chosen = sorted(kept[:wanted] + dropped[:uninformative_kept])
    pieces = [(rounds[r], [g for rr, g in chosen if rr == r]) for r in range(len(rounds))]
    batch = take_groups([(s, groups) for s, groups in pieces if groups], group)
    metrics = _combined_metrics(rounds)
    metrics.update(
        {
            "dynamic_sampling/dropped_fraction": len(dropped) / (len(kept) + len(dropped)),
            "dynamic_sampling/refills": float(len(rounds) - 1),
            "dynamic_sampling/uninformative_kept": float(uninformative_kept),
        }
    )
    return batch._replace(reward_metrics=metrics)


class ExperienceEnv(NamedTuple):
    """What a batch's generation, reward and scoring run with besides the policies and the spec."""

    model_config: Any
    tokenizer: Any
    pool: Any  # the VerifierPool the answers are checked in
    coefficients: RewardCoefficients  # the reward shaping at this step
    layout: Any = None  # where the sampler decodes (comppo_jax.train.decode_layout.DecodeLayout); None: in place
    mesh: Any = None  # the mesh the scored batch lives on (the training mesh) when `layout` decodes elsewhere
    refill: Callable[[], list] | None = None  # the prompts of a dynamic-sampling refill round
    train_prompts: int = 0  # the size of the prompt stream (max_refills=-1 stops after a pass over it)
    # Called with what is about to run the first time ("sampler", "scoring") and what just ended
    # ("sampling", "scoring"): the loop's compile notices and stop checks.
    notify: Callable[[str], None] = lambda event: None
    environment: Any = None  # the comppo_jax.environments.Environment conversations talk to (rollout.environment)


class ScoredBatch(NamedTuple):
    """One batch out of `experience`: its generation with rewards, and the scoring pass's output."""

    sampled: Sampled
    rollout: Rollout
    packing: Packing | None = None  # the rows the scoring pass ran on (ScoringSpec.packing)


def scoring_packing(sampled: Sampled, min_saving: float) -> Packing | None:
    """The whole batch packed, its rows split as the generation's mesh splits a batch; None where that
    saves less than `min_saving` of its rows (`worth_packing`)."""
    tokens = sampled.generation.tokens
    placement = getattr(tokens, "sharding", None)
    mesh = placement.mesh if isinstance(placement, NamedSharding) and isinstance(placement.mesh, Mesh) else None
    multiple = 1 if mesh is None else sharding.batch_size_multiple(mesh)
    packing = worth_packing(sampled.host_lengths, tokens.shape[1], multiple=multiple, min_saving=min_saving)
    return None if packing is None else on_devices(packing, mesh)


def dispatch(
    sampler: Any, prompts: list, key: jax.Array, spec: RolloutSpec, env: ExperienceEnv
) -> Generation | Conversations:
    """Dispatches the generation of `spec.samples_per_prompt` responses to each of `prompts` with the
    `sampler` weights (in env.layout's decode layout) and returns at once: the arrays fill in. With
    `spec.environment`, conversations with `env.environment`, which return once they have ended."""
    env.notify("sampler")
    layout = env.layout
    if layout is not None:
        key = layout.replicated(key)  # outside the decode mesh's context: it may come from the training devices
    with jax.set_mesh(layout.mesh) if layout is not None else contextlib.nullcontext():
        prompt_tokens, prompt_mask = encode_prompts(env.tokenizer, prompts)
        if spec.environment:
            if env.environment is None:
                raise ValueError(f"rollout.environment={spec.environment!r}: ExperienceEnv.environment must be given")
            return converse(
                sampler,
                env.model_config,
                prompt_tokens,
                prompt_mask,
                key,
                env.environment,
                prompts,
                env.tokenizer,
                max_turns=spec.max_turns,
                max_reply_tokens=spec.max_reply_tokens,
                eos_token_ids=(env.tokenizer.eos_token_id,),
                pad_token_id=env.tokenizer.pad_token_id,
                **spec.sampling_options(),
            )
        return generate(
            sampler,
            env.model_config,
            prompt_tokens,
            prompt_mask,
            key,
            eos_token_ids=(env.tokenizer.eos_token_id,),
            pad_token_id=env.tokenizer.pad_token_id,
            **spec.sampling_options(),
        )


def experience(
    policy: Any,
    reference: Any,
    prompts: list,
    key: jax.Array,
    spec: ExperienceSpec,
    env: ExperienceEnv,
    *,
    sampler: Any = None,
    dispatched: Generation | Conversations | None = None,
) -> ScoredBatch:
    """Batch `prompts` generated by `sampler` (default: `policy`), rewarded (with dynamic sampling's
    refill rounds, keys fold_in(key, 1 + round)) and scored by `policy` and `reference` (None: no
    reference pass). `dispatched`: round 0's generation, already dispatched with `key`.

    `policy` and `reference` may be functions that return the params, called once the sampling has
    ended, so that a copy they make does not coexist with the sampler's weights and cache; the
    sampler is let go before scoring (a caller that keeps no reference to it frees it)."""
    group = spec.rollout.samples_per_prompt
    sampler = policy if sampler is None else sampler

    def sample(round_index: int) -> Sampled:  # round 0: `prompts`; later: dynamic sampling's refills
        if round_index == 0:
            chosen = prompts
            generation = dispatched if dispatched is not None else dispatch(sampler, chosen, key, spec.rollout, env)
        else:
            if env.refill is None:
                raise ValueError("rollout.dynamic_sampling draws refill rounds: ExperienceEnv.refill must give prompts")
            chosen = env.refill()
            generation = dispatch(sampler, chosen, jax.random.fold_in(key, 1 + round_index), spec.rollout, env)
        if env.layout is not None and isinstance(generation, Conversations):
            moved = env.layout.to_training(
                (generation.generation, generation.env_mask, generation.turn_rewards), env.mesh
            )
            generation = dataclasses.replace(generation, generation=moved[0], env_mask=moved[1], turn_rewards=moved[2])
        elif env.layout is not None:
            generation = env.layout.to_training(generation, env.mesh)
        return reward_generation(env.tokenizer, env.pool, generation, chosen, group, env.coefficients)

    sampled = sample(0)
    if spec.rollout.dynamic_sampling:
        sampled = dynamic_sampling(
            sampled,
            sample,
            group,
            spec.rollout.max_refills,
            spec.rollout.dynamic_sampling_filter,
            env.train_prompts,
        )
    sampler = None
    env.notify("sampling")
    policy, reference = (source() if callable(source) else source for source in (policy, reference))
    env.notify("scoring")
    packing = scoring_packing(sampled, spec.scoring.packing_min_saving) if spec.scoring.packing else None
    rollout = score_rollout(
        policy, reference, env.model_config, sampled.generation, packing=packing, **spec.scoring.options()
    )
    env.notify("scored")
    return ScoredBatch(sampled, rollout, packing)
