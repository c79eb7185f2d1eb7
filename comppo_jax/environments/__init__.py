"""Environments a conversation talks to: the policy writes a tool call, the environment replies.

A conversation (`comppo_jax.rollout.turns.converse`) is the prompt, then policy turns each ending
at a tool-call token (`Environment.call_tokens`), each answered by the environment's reply,
appended as tokens the policy reads but never samples (nor is trained on), then a last policy
turn ending at EOS or at the token limit. One `Environment` object serves a batch of
conversations: `reset` gives it each row's problem, `step` the rows waiting for a reply.

Tool calls that can fail run in killable workers (comppo_jax.workers), so a call that is
malformed, raises or hangs becomes an error message to the policy, counted by its `Outcome`;
nothing stops the run. Environments: `calculator` (the synthetic arithmetic task's tool),
`sandbox` (Python programs the policy writes, run under resource limits).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from comppo_jax.environments.protocol import ERROR, MALFORMED, OK, OUTCOMES, TIMEOUT, Environment, Reply, Turn

__all__ = ["ERROR", "MALFORMED", "OK", "OUTCOMES", "TIMEOUT", "Environment", "Reply", "Turn"]
__all__ += ["ENVIRONMENTS", "make_environment", "opened"]

ENVIRONMENTS = ("", "calculator", "sandbox")  # rollout.environment ("": none, one turn)


def make_environment(name: str, workers: int = 2) -> Environment:
    """The environment `name` (ENVIRONMENTS, not ""), its tools in `workers` processes."""
    if name == "calculator":
        from comppo_jax.environments.calculator import Calculator

        return Calculator(num_workers=workers)
    if name == "sandbox":
        from comppo_jax.environments.sandbox import Sandbox

        return Sandbox(num_workers=workers)
    raise ValueError(f"rollout.environment must be one of {ENVIRONMENTS[1:]}, got {name!r}")


@contextlib.contextmanager
def opened(name: str, workers: int = 2) -> Iterator[Environment | None]:
    """`make_environment(name, workers)` for the length of a `with` block (None for "": one turn)."""
    if not name:
        yield None
        return
    with make_environment(name, workers) as environment:
        yield environment
