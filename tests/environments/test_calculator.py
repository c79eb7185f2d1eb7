"""The calculator tool: replies, and malformed, raising and hanging calls answered and counted."""

from __future__ import annotations

import time

import pytest

from comppo_jax.environments import ERROR, MALFORMED, OK, TIMEOUT, Turn
from comppo_jax.environments.calculator import Calculator, evaluate, parse_expression


def turn(text: str, row: int = 0) -> Turn:
    return Turn(row, text, tuple(ord(c) for c in text))


@pytest.mark.parametrize("expression,value", [("36*7", 252), ("999+9", 8), ("(2-9)*3", 979), ("-4", 996)])
def test_the_calculator_computes_the_tasks_arithmetic(expression, value):
    assert evaluate([expression, 1000]) == value


@pytest.mark.parametrize("expression", ["", "2**99999", "__import__('os')", "1/0", "a+1", "1" * 65, "3+", "1.5*2"])
def test_anything_but_integer_arithmetic_is_refused(expression):
    with pytest.raises(ValueError):
        parse_expression(expression)


def test_malformed_raising_and_hanging_calls_become_messages_and_are_counted():
    with Calculator(tool="tests.environments.faulty_tools:hangs_or_raises", num_workers=2, timeout_s=1.0) as calculator:
        calculator.reset([])
        texts = ["x=[3*4]", "no call]", "[3**4]", "[1+1]", "[2+2]", "[5*5]"]
        start = time.monotonic()
        replies = calculator.step([turn(t, row) for row, t in enumerate(texts)])
        assert time.monotonic() - start < 10
        assert [(r.text, r.outcome) for r in replies] == [
            ("=12", OK),
            ("=malformed", MALFORMED),
            ("=malformed", MALFORMED),
            ("=timeout", TIMEOUT),
            ("=error", ERROR),
            ("=25", OK),
        ]
        # the hung worker was replaced: the next calls are answered
        assert [r.text for r in calculator.step([turn("[7*7]"), turn("[8+8]")])] == ["=49", "=16"]
