"""What an environment is to a conversation: the policy's `Turn` that ended in a tool call, the
environment's `Reply`, the `Environment` interface and the outcomes a reply is counted by. The tools
(calculator, sandbox) build on it; `comppo_jax.environments` names them all."""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # a worker imports this module: not the data sets' (hub, storage) modules
    from comppo_jax.data.datasets import Problem


# How a tool call ended; each is counted in a rollout's metrics (env/<outcome>).
OK, MALFORMED, ERROR, TIMEOUT = "ok", "malformed", "error", "timeout"
OUTCOMES = (OK, MALFORMED, ERROR, TIMEOUT)


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
