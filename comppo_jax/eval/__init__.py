"""Evaluation: greedy accuracy, frozen-benchmark pass@1 / majority@k, and the paper's statistics."""

from comppo_jax.eval.frozen import evaluate_problems, majority_answer
from comppo_jax.rollout.text import count_correct, decode_responses, encode_prompts, generated_answers, greedy_accuracy

__all__ = [
    "count_correct",
    "decode_responses",
    "encode_prompts",
    "evaluate_problems",
    "generated_answers",
    "greedy_accuracy",
    "majority_answer",
]
