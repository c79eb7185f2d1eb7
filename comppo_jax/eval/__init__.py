"""Evaluation: greedy accuracy on held-out problems."""

from comppo_jax.eval.accuracy import encode_prompts, greedy_accuracy

__all__ = ["encode_prompts", "greedy_accuracy"]
