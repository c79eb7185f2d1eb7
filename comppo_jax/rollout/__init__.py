"""Rollouts: KV-cache sampling (`sampler`) and the behaviour-policy scoring pass (`scoring`)."""

from comppo_jax.rollout.sampler import Generation, generate, sample_token, top_p_filter
from comppo_jax.rollout.scoring import Rollout, gather_response, response_positions, score_rollout, token_log_probs

__all__ = [
    "Generation",
    "Rollout",
    "gather_response",
    "generate",
    "response_positions",
    "sample_token",
    "score_rollout",
    "token_log_probs",
    "top_p_filter",
]
