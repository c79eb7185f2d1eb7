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

import abc
import contextlib
import dataclasses
from collections.abc import Iterator, Sequence

from comppo_jax.data.datasets import Problem

# How a tool call ended; each is counted in a rollout's metrics (env/<outcome>).
OK, MALFORMED, ERROR, TIMEOUT = "ok", "malformed", "error", "timeout"
OUTCOMES = (OK, MALFORMED, ERROR, TIMEOUT)
ENVIRONMENTS = ("", "calculator", "sandbox")  # rollout.environment ("": none, one turn)


@dataclasses.dataclass(frozen=True)
class Turn:
    """A row's policy turn that ended in a tool call."""

    row: int  # the conversation's row in the batch
    text: str  # the turn's tokens decoded (the call token included)
    token_ids: tuple[int, ...]  # the turn's sampled tokens, exactly


@dataclasses.dataclass(frozen=True)
class Reply:
    """The environment's answer to a turn: `text` (encoded once by the rollout's tokenizer) or
    `token_ids`, appended to the conversation; `reward` (at the turn's call token); `done` ends the
    conversation after the call, nothing appended."""

    text: str = ""
    token_ids: tuple[int, ...] | None = None
    reward: float = 0.0
    done: bool = False
    outcome: str = OK

    def __post_init__(self) -> None:
        if self.outcome not in OUTCOMES:
            raise ValueError(f"Reply.outcome must be one of {OUTCOMES}, got {self.outcome!r}")


class Environment(abc.ABC):
    """What a batch of conversations talks to. Use as a context manager (its workers) or `close()`."""

    call_tokens: tuple[str, ...]  # the tokens that end a policy turn with a call (one token id each)

    @abc.abstractmethod
    def reset(self, problems: Sequence[Problem]) -> None:
        """Starts one conversation per problem (row r talks about problems[r])."""

    @abc.abstractmethod
    def step(self, turns: Sequence[Turn]) -> list[Reply]:
        """One reply per turn, in order."""

    def close(self) -> None:  # noqa: B027  (optional: most environments start nothing)
        """Stops what the environment started."""

    def __enter__(self) -> Environment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


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
