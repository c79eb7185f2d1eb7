"""A calculator for the synthetic arithmetic task (comppo_jax.data.synthetic).

The policy calls it by writing an expression in brackets, `[36*7]`; the call ends at `]` and the
calculator replies `=252` (results mod `modulus`, as the task's steps are), so a worked step reads
`[36*7]=252`. Expressions are integers, + - * and parentheses, at most 64 characters; anything
else is malformed (`=malformed`, never evaluated). The evaluation runs in killable workers
(comppo_jax.workers): one that raises replies `=error`, one that outlives `timeout_s` `=timeout`,
and a call whose worker dies (killed, out of memory) `=error`, the worker being replaced.
"""

from __future__ import annotations

import ast
import operator
from collections.abc import Sequence
from typing import TYPE_CHECKING

from comppo_jax import workers
from comppo_jax.environments.protocol import ERROR, MALFORMED, OK, TIMEOUT, Environment, Reply, Turn

if TYPE_CHECKING:  # a worker imports this module: not the data sets' (hub, storage) modules
    from comppo_jax.data.datasets import Problem

OPEN, CALL = "[", "]"
MAX_EXPRESSION = 64
_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def parse_expression(text: str) -> ast.expr:
    """The arithmetic expression in `text` (+ - * and parentheses over integers); ValueError otherwise."""
    if not text or len(text) > MAX_EXPRESSION:
        raise ValueError(f"an expression has 1-{MAX_EXPRESSION} characters, got {len(text)}")
    try:
        tree = ast.parse(text, mode="eval").body
    except SyntaxError as error:
        raise ValueError(f"not an expression: {text!r}") from error
    for node in ast.walk(tree):
        allowed = (ast.BinOp, ast.UnaryOp, ast.USub, ast.UAdd, *_OPERATORS)
        if not (isinstance(node, allowed) or (isinstance(node, ast.Constant) and type(node.value) is int)):
            raise ValueError(f"{type(node).__name__} is not arithmetic, in {text!r}")
    return tree


def _value(node: ast.expr) -> int:
    if isinstance(node, ast.Constant):
        assert type(node.value) is int  # parse_expression admits no other constant
        return node.value
    if isinstance(node, ast.UnaryOp):
        return -_value(node.operand) if isinstance(node.op, ast.USub) else _value(node.operand)
    assert isinstance(node, ast.BinOp)
    return _OPERATORS[type(node.op)](_value(node.left), _value(node.right))


def evaluate(call: list) -> int:
    """The calculator's tool (run in a worker): [expression, modulus] -> its value mod modulus."""
    expression, modulus = call
    return _value(parse_expression(expression)) % modulus


def call_expression(text: str) -> str:
    """The expression of a turn ending in a call: what follows its last `[` (ValueError without one)."""
    if not text.endswith(CALL) or OPEN not in text:
        raise ValueError(f"a call reads [expression], got {text[-20:]!r}")
    return text[text.rindex(OPEN) + 1 : -1]


class Calculator(Environment):
    """The calculator tool; `tool` ("module:name") evaluates [expression, modulus] in the workers."""

    call_tokens = (CALL,)

    def __init__(
        self,
        modulus: int = 1000,
        *,
        tool: str = "comppo_jax.environments.calculator:evaluate",
        num_workers: int = 2,
        timeout_s: float = 2.0,
    ):
        self.modulus = modulus
        self._pool = workers.function_pool(tool, num_workers, timeout_s)

    def reset(self, problems: Sequence[Problem]) -> None:
        del problems  # the calculator answers any expression

    def step(self, turns: Sequence[Turn]) -> list[Reply]:
        replies: list[Reply | None] = [None] * len(turns)
        calls = []
        for index, turn in enumerate(turns):
            try:
                expression = call_expression(turn.text)
                parse_expression(expression)
            except ValueError:
                replies[index] = Reply("=malformed", outcome=MALFORMED)
                continue
            calls.append((index, expression))
        results = self._pool.run([[expression, self.modulus] for _, expression in calls])
        for (index, _), result in zip(calls, results):
            if result.status == workers.OK:
                replies[index] = Reply(f"={result.value}", outcome=OK)
            elif result.status == workers.TIMEOUT:
                replies[index] = Reply("=timeout", outcome=TIMEOUT)
            else:
                replies[index] = Reply("=error", outcome=ERROR)
        return [reply for reply in replies if reply is not None]

    def close(self) -> None:
        self._pool.close()
