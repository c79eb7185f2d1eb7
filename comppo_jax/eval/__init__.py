"""Evaluation: greedy accuracy, frozen-benchmark greedy pass@1, avg@n, unbiased pass@k and majority@n, and the paper's
statistics."""

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
