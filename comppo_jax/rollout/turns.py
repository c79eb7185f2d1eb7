"""`converse`: multi-turn rollouts with tools on the paged engine, token in and token out.

Each row is a conversation: the prompt, then policy turns, each ending at a tool-call token
(`Environment.call_tokens`) and answered by the environment's reply, then a last turn ending at
EOS, at `max_turns`' call (which ends the row unanswered) or at `max_new_tokens` (policy and
environment tokens together). The engine (comppo_jax.rollout.engine) decodes until every row has
ended or waits for its environment; the host asks the environment (`Environment.step`) for the
waiting rows' replies and writes them as those rows' next tokens (`engine.resume`); decoding goes
on from there. A row keeps its pages between turns: nothing is prefilled twice, and the reply's
tokens are fed like sampled ones, one per decode step.

Token in, token out: a row's response holds exactly the tokens it sampled and the reply tokens the
environment gave (encoded once, here), never a re-encoding of decoded text. `env_mask` marks the
environment's tokens: their log-probs are 0, and the learner neither trains them nor gives them
advantages.

In a multi-process run every process calls `converse` with the same arguments; process 0 steps
the environment and broadcasts its replies, so every process appends the same tokens.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from comppo_jax import sharding
from comppo_jax.data.datasets import Problem
from comppo_jax.data.tokenizers import Tokenizer
from comppo_jax.environments import OUTCOMES, Environment, Turn
from comppo_jax.models.config import ModelConfig
from comppo_jax.models.paged_cache import resolve_paged_attention
from comppo_jax.rollout import engine
from comppo_jax.rollout.sampler import DEFAULT_PAGE_SIZE, Generation, check_and_default, engine_generation


class ToolUse(NamedTuple):
    """A conversation's environment and limits (rollout.environment, max_turns, max_reply_tokens)."""

    environment: Environment
    max_turns: int
    max_reply_tokens: int


@dataclasses.dataclass(frozen=True)
class Conversations:
    """A batch of conversations; R = B * num_samples rows, T = max_new_tokens."""

    generation: Generation  # response_mask covers the policy's and the environment's tokens
    env_mask: Bool[Array, "R T"]  # the environment's tokens
    turn_rewards: Float[Array, "R T"]  # each reply's reward, at the call token it answers
    calls: np.ndarray  # [R] tool calls per row
    outcomes: dict[str, int]  # replies by outcome (comppo_jax.environments.OUTCOMES)


def call_token_ids(tokenizer: Tokenizer, environment: Environment) -> tuple[int, ...]:
    """The ids of the environment's call tokens; each must be one token of `tokenizer`."""
    ids = []
    for token in environment.call_tokens:
        encoded = tokenizer.encode(token)
        if len(encoded) != 1:
            raise ValueError(
                f"{type(environment).__name__}'s call token {token!r} is {len(encoded)} tokens of this tokenizer "
                f"({encoded}); a call must end at one token id"
            )
        ids.append(encoded[0])
    return tuple(ids)


# The engine's three steps, each compiled once per shape: the host loop runs between them.
_start = jax.jit(engine.start_engine, static_argnames=("config", "layout", "pad", "backend", "kv_dtype", "multi_turn"))
# The engine state (its page pool above all) is donated to the next step, not copied.
_decode = jax.jit(
    engine.decode,
    static_argnames=("config", "layout", "temperature", "top_p", "backend", "max_turns"),
    donate_argnames=("state",),
)
_resume = jax.jit(engine.resume, static_argnames=("layout",), donate_argnames=("state",))


def _replies(
    environment: Environment,
    tokenizer: Tokenizer,
    turns: list[Turn],
    slots: list[tuple[int, int]],
    shape: tuple[int, int],
    max_reply_tokens: int,
) -> tuple[np.ndarray, ...]:
    """The environment's replies to `turns` (waiting in `slots`) as the engine's arrays [D, S(, Q)]:
    (tokens, lengths, end, rewards, outcome codes)."""
    tokens = np.zeros(shape + (max_reply_tokens,), np.int32)
    lengths, end = np.zeros(shape, np.int32), np.zeros(shape, bool)
    rewards, outcomes = np.zeros(shape, np.float32), np.full(shape, -1, np.int32)
    replies = environment.step(turns) if turns else []
    if len(replies) != len(turns):
        raise ValueError(f"{type(environment).__name__}.step returned {len(replies)} replies for {len(turns)} turns")
    for (shard, slot), reply in zip(slots, replies):
        ids = list(reply.token_ids) if reply.token_ids is not None else tokenizer.encode(reply.text)
        ids = ids[:max_reply_tokens]
        tokens[shard, slot, : len(ids)] = ids
        lengths[shard, slot], end[shard, slot] = len(ids), reply.done
        rewards[shard, slot], outcomes[shard, slot] = reply.reward, OUTCOMES.index(reply.outcome)
    return tokens, lengths, end, rewards, outcomes


def _no_replies(shape: tuple[int, int], max_reply_tokens: int) -> tuple[np.ndarray, ...]:
    """`_replies`' arrays on a process that does not step the environment (overwritten by process 0's)."""
    zeros = np.zeros(shape, np.int32)
    return zeros[..., None].repeat(max_reply_tokens, -1), zeros, zeros.astype(bool), zeros.astype(np.float32), zeros - 1


def converse(
    params: dict,
    config: ModelConfig,
    prompt_tokens: Int[Array, "B P"],
    prompt_mask: Bool[Array, "B P"],
    rng: PRNGKeyArray,
    environment: Environment,
    problems: Sequence[Problem],
    tokenizer: Tokenizer,
    *,
    max_new_tokens: int,
    max_turns: int,
    max_reply_tokens: int = 32,
    temperature: float = 1.0,
    top_p: float = 1.0,
    num_samples: int = 1,
    eos_token_ids: tuple[int, ...] | None = None,
    pad_token_id: int | None = None,
    page_size: int = DEFAULT_PAGE_SIZE,
    decode_slots: int | None = None,
    paged_attention: str = "auto",
    kv_dtype: str = "auto",
) -> Conversations:
    """Samples `num_samples` conversations per prompt with `environment` (reset here with each
    row's problem, `problems` [B]). `max_turns` counts policy turns (so at most max_turns - 1
    replies); a reply is cut to `max_reply_tokens`. The sampling keywords are `generate`'s, and as
    there a row's tokens depend only on rng, its row and the replies it got."""
    eos, pad = check_and_default(config, prompt_tokens, prompt_mask, eos_token_ids, pad_token_id)
    if max_new_tokens < 1 or max_turns < 1 or max_reply_tokens < 1:
        raise ValueError(
            f"max_new_tokens, max_turns and max_reply_tokens must be >= 1, got {max_new_tokens}, {max_turns}, "
            f"{max_reply_tokens}"
        )
    if len(problems) != prompt_tokens.shape[0]:
        raise ValueError(f"converse got {len(problems)} problems for {prompt_tokens.shape[0]} prompts")
    calls = jnp.asarray(call_token_ids(tokenizer, environment), jnp.int32)
    backend = resolve_paged_attention(paged_attention, config.head_dim)
    layout = engine.make_layout(
        prompt_tokens.shape[0],
        prompt_tokens.shape[1],
        num_samples=num_samples,
        max_new_tokens=max_new_tokens,
        page_size=page_size,
        decode_slots=decode_slots,
        shards=sharding.context_batch_shards(),
    )
    rows = layout.rows
    host = jax.process_index() == 0
    if host:
        environment.reset([problems[row // num_samples] for row in range(rows)])
    prefilled, state = _start(
        params, config, prompt_tokens, prompt_mask, layout, pad=pad, backend=backend, kv_dtype=kv_dtype, multi_turn=True
    )
    turn_start = np.zeros(layout.shards * layout.shard_rows, np.int64)  # where each row's current turn began
    turn_rewards = np.zeros((rows, max_new_tokens), np.float32)
    outcomes: collections.Counter[str] = collections.Counter()
    while True:
        state = _decode(
            params,
            config,
            prefilled,
            state,
            layout,
            rng,
            temperature=temperature,
            top_p=top_p,
            eos=eos,
            backend=backend,
            calls=calls,
            max_turns=max_turns,
        )
        assert state.turn is not None
        row, step, paused = (sharding.to_host(a) for a in (state.row, state.step, state.turn.paused))
        if not paused.any():
            break
        written = sharding.to_host(state.response)
        waiting = [(int(d), int(s)) for d, s in zip(*np.nonzero(paused))]
        global_rows = [d * layout.shard_rows + int(row[d, s]) for d, s in waiting]
        turns = [
            Turn(r, tokenizer.decode(ids), tuple(int(i) for i in ids))
            for r, (d, s) in zip(global_rows, waiting)
            for ids in [written[d, row[d, s], turn_start[r] : step[d, s]]]
            if r < rows  # rows past R pad the last shard: ended, not asked
        ]
        asked = [(d, s) for r, (d, s) in zip(global_rows, waiting) if r < rows]
        arrays, failure = _no_replies(paused.shape, max_reply_tokens), None
        if host:
            try:
                arrays = _replies(environment, tokenizer, turns, asked, paused.shape, max_reply_tokens)
            except Exception as error:  # raised below on every process, after they all know
                failure = error
        if jax.process_count() > 1:
            shared = multihost_utils.broadcast_one_to_all(arrays + (np.asarray(failure is not None),))
            arrays, failed = tuple(np.asarray(a) for a in shared[:-1]), bool(shared[-1])
            if failed and failure is None:
                raise RuntimeError("process 0's environment failed to reply (its log says why)")
        if failure is not None:
            raise failure
        tokens, lengths, end, rewards, codes = arrays
        for r, (d, s) in zip(global_rows, waiting):
            if r >= rows:
                end[d, s] = True
                continue
            turn_rewards[r, step[d, s] - 1] += rewards[d, s]
            outcomes[OUTCOMES[codes[d, s]]] += 1
            turn_start[r] = step[d, s] + lengths[d, s]
        state = _resume(state, layout, jnp.asarray(tokens), jnp.asarray(lengths), jnp.asarray(end))
    prompts, prompt_lengths, response, log_probs, response_length = engine.engine_outputs(prefilled, state, layout)
    generation = engine_generation(prompts, prompt_lengths, response, log_probs, response_length, num_samples, pad)
    response_mask = generation.response_mask
    env_mask = state.turn.env_mask.reshape(-1, max_new_tokens)[:rows] & response_mask
    called = jnp.isin(response, calls) & response_mask & ~env_mask
    return Conversations(
        generation,
        env_mask,
        jnp.asarray(turn_rewards),
        sharding.to_host(called.sum(axis=1)),
        {outcome: outcomes[outcome] for outcome in OUTCOMES},
    )
