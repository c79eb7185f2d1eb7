"""Text in, answers out: prompts encoded for the sampler, responses decoded, greedy pass@1 verified.

Below both training (its dev evaluations and rollouts) and evaluation (frozen benchmarks, notebooks)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import tqdm
from jaxtyping import Array, PRNGKeyArray

from comppo_jax.data.datasets import Problem
from comppo_jax.data.rewards import Verdict, VerifierPool, extract_answer
from comppo_jax.data.tokenizers import Tokenizer, pad_batch
from comppo_jax.models import ModelConfig
from comppo_jax.rollout.sampler import Generation, generate
from comppo_jax.rollout.turns import ToolUse, converse
from comppo_jax.sharding import to_host


def encode_prompts(tokenizer: Tokenizer, problems: Sequence[Problem]) -> tuple[Array, ...]:
    """(tokens [B, P], mask [B, P]) left-padded prompt ids of `problems`."""
    return tuple(
        jnp.asarray(x) for x in pad_batch([tokenizer.encode_prompt(p.prompt) for p in problems], tokenizer.pad_token_id)
    )


def decode_responses(tokenizer: Tokenizer, generation: Generation, mask: np.ndarray | None = None) -> list[str]:
    """The text of each generated response (its valid tokens, or those of `mask` [R, T]; EOS dropped), one per row."""
    tokens = to_host(generation.response_tokens)
    mask = to_host(generation.response_mask) if mask is None else mask
    return [tokenizer.decode(row[m & (row != tokenizer.eos_token_id)]) for row, m in zip(tokens, mask)]


def answers_correct(problems: Sequence[Problem], answers: Sequence[str | None], pool: VerifierPool) -> list[bool]:
    """Whether each extracted answer (None: no answer, incorrect) verifies against its problem's gold."""
    answered = [i for i, a in enumerate(answers) if a is not None]
    verdicts = pool.check([(problems[i].answer, answers[i]) for i in answered])  # type: ignore[misc]  # not None
    correct = [False] * len(answers)
    for i, verdict in zip(answered, verdicts):
        correct[i] = verdict is Verdict.CORRECT
    return correct


def count_correct(problems: Sequence[Problem], answers: Sequence[str | None], pool: VerifierPool) -> int:
    """How many extracted `answers` (None: no answer, incorrect) verify against the problems' gold."""
    return sum(answers_correct(problems, answers, pool))


def generated_answers(
    params: dict,
    config: ModelConfig,
    tokenizer: Tokenizer,
    problems: Sequence[Problem],
    *,
    max_new_tokens: int,
    rng: PRNGKeyArray | None = None,
    temperature: float = 0.0,
    top_p: float = 1.0,
    num_samples: int = 1,
    tools: ToolUse | None = None,
) -> list[str | None]:
    """The extracted answer (None: none) of each generated response, `num_samples` per problem in
    problem order; temperature 0 is greedy. With `tools`, each response is a conversation with its
    environment, answered in the policy's own tokens."""
    tokens, mask = encode_prompts(tokenizer, problems)
    if tools is not None:
        conversations = converse(
            params,
            config,
            tokens,
            mask,
            jax.random.PRNGKey(0) if rng is None else rng,
            tools.environment,
            problems,
            tokenizer,
            max_new_tokens=max_new_tokens,
            max_turns=tools.max_turns,
            max_reply_tokens=tools.max_reply_tokens,
            temperature=temperature,
            top_p=top_p,
            num_samples=num_samples,
            eos_token_ids=(tokenizer.eos_token_id,),
            pad_token_id=tokenizer.pad_token_id,
        )
        policy = to_host(conversations.generation.response_mask) & ~to_host(conversations.env_mask)
        return [extract_answer(text) for text in decode_responses(tokenizer, conversations.generation, policy)]
    generation = generate(
        params,
        config,
        tokens,
        mask,
        jax.random.PRNGKey(0) if rng is None else rng,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        num_samples=num_samples,
        eos_token_ids=(tokenizer.eos_token_id,),
        pad_token_id=tokenizer.pad_token_id,
    )
    return [extract_answer(text) for text in decode_responses(tokenizer, generation)]


def greedy_accuracy(
    params: dict,
    config: ModelConfig,
    tokenizer: Tokenizer,
    problems: Sequence[Problem],
    pool: VerifierPool,
    *,
    max_new_tokens: int,
    batch_size: int = 64,
    progress: str = "",
    after_batch: Callable[[], object] | None = None,
    tools: ToolUse | None = None,
) -> float:
    """Fraction of `problems` whose greedy response's answer verifies against the gold; `progress`:
    the description of a transient bar over the batches ("" for none); `after_batch()` runs after
    each batch (the train loop's stop check, which may raise); `tools`: responses are conversations."""
    correct = 0
    for start in tqdm.trange(0, len(problems), batch_size, desc=progress, leave=False, disable=not progress):
        chunk = problems[start : start + batch_size]
        correct += count_correct(
            chunk, generated_answers(params, config, tokenizer, chunk, max_new_tokens=max_new_tokens, tools=tools), pool
        )
        if after_batch is not None:
            after_batch()
    return correct / max(len(problems), 1)
