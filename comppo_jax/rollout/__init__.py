"""Rollouts: sampling (`sampler.generate` on the paged-cache `engine`; `dense` is its reference) and
the behaviour-policy scoring pass (`scoring`), and text in / answers out (`text`)."""

from comppo_jax.rollout.sampler import Generation, engine_options, generate, sample_token, top_p_filter
from comppo_jax.rollout.scoring import (
    Rollout,
    gather_response,
    policy_gate,
    policy_token_stats,
    response_positions,
    response_token_stats,
    score_rollout,
)
from comppo_jax.rollout.text import count_correct, decode_responses, encode_prompts, generated_answers, greedy_accuracy

__all__ = [
    "Generation",
    "Rollout",
    "count_correct",
    "decode_responses",
    "encode_prompts",
    "engine_options",
    "gather_response",
    "generate",
    "generated_answers",
    "greedy_accuracy",
    "response_positions",
    "sample_token",
    "score_rollout",
    "policy_gate",
    "policy_token_stats",
    "response_token_stats",
    "top_p_filter",
]
