"""The synthetic task's taught mistakes: answer noise as before, step noise inside the chain."""

from __future__ import annotations

import importlib.util
import pathlib

import numpy as np
import pytest

from comppo_jax.data.synthetic import Noise, chained_arithmetic, noisy_solution
from comppo_jax.train.start import load_problems, warm_start_key

ROOT = pathlib.Path(__file__).resolve().parents[2]


def preset(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "configs" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def chain_is_consistent(prompt: str, solution: str) -> tuple[int, int]:
    """(steps written wrong, steps) of a solution whose every step starts from the line before's result."""
    tokens = prompt.removesuffix(" =?\n").split()
    value, wrong = int(tokens[0]), 0
    lines = solution.split("\n")
    for token, line in zip(tokens[1:], lines[:-1]):
        op, operand = token[0], int(token[1:])
        left, written = line.split("=")
        assert left == f"{value}{op}{operand}", (left, value)
        right = {"+": value + operand, "-": value - operand}[op] % 1000
        wrong += int(written) != right
        assert int(written) in (right, (right + 1) % 1000)
        value = int(written)
    assert lines[-1] == f"Answer: {value}"
    return wrong, len(tokens) - 1


def test_answer_noise_alone_is_the_solution_as_before():
    problems = chained_arithmetic(200, seed=3, min_steps=2, max_steps=3, operations="+-")
    rng, again = np.random.default_rng(0), np.random.default_rng(0)
    for problem in problems:
        text = noisy_solution(problem, rng, Noise(answer_noise=0.7))
        # The earlier rule, transcribed: an odd answer's line reads answer + 1 with probability 0.7.
        if int(problem.answer) % 2 == 0 or again.random() >= 0.7:
            assert text == problem.solution
        else:
            assert text == problem.solution.rsplit("\n", 1)[0] + f"\nAnswer: {int(problem.answer) + 1}"


def test_step_noise_writes_noisy_operands_steps_wrong_at_its_rate_and_the_chain_follows():
    cfg = preset("tiny_credit")
    train, _ = load_problems(cfg.data, seed=0)
    ws = cfg.warm_start
    noise = Noise.of(ws)
    rng = np.random.default_rng(0)
    noisy_steps = wrong_steps = 0
    for problem in train[:600]:
        text = noisy_solution(problem, rng, noise)
        wrong, steps = chain_is_consistent(problem.prompt, text)
        operands = [token[1:] for token in problem.prompt.split()[1:-1]]
        assert len(operands) == steps and cfg.data.min_steps <= steps <= cfg.data.max_steps
        noisy_steps += sum(operand in ws.noisy_operands for operand in operands)
        wrong_steps += wrong
        if not any(operand in ws.noisy_operands for operand in operands):
            assert text == problem.solution
        token_count = len(text) + 1  # the character tokenizer, with the EOS
        assert 60 <= token_count <= cfg.rollout.max_new_tokens
    assert wrong_steps / noisy_steps == pytest.approx(ws.step_noise, abs=0.05)


def test_the_warm_start_key_is_unchanged_without_step_noise():
    tiny = preset("tiny")
    key = warm_start_key(tiny)
    assert "step_noise" not in key["warm_start"] and "noisy_operands" not in key["warm_start"]
    credit = preset("tiny_credit")
    assert warm_start_key(credit)["warm_start"]["step_noise"] == credit.warm_start.step_noise


def test_the_decision_testbed_marks_its_early_mistakes_and_every_line_after_them():
    cfg = preset("tiny_decision")
    train, _ = load_problems(cfg.data, seed=0)
    ws = cfg.warm_start
    noise = Noise.of(ws)
    assert noise.noisy_first_steps == 3 and noise.mark_mistakes
    rng = np.random.default_rng(0)
    decisions = wrong = 0
    for problem in train[:600]:
        text = noisy_solution(problem, rng, noise)
        lines = text.split("\n")
        marked = ["~" in line for line in lines[:-1]]
        first = marked.index(True) if any(marked) else len(marked)
        assert marked == [False] * first + [True] * (len(marked) - first), text  # once marked, marked to the end
        assert first == len(marked) or first < ws.noisy_first_steps
        operands = [token[1:] for token in problem.prompt.split()[1:-1]]
        early = [o in ws.noisy_operands for o in operands[: ws.noisy_first_steps]]
        decisions += sum(early)
        # The chain reads as before with = for ~, and it holds a wrong step exactly when it holds a mark.
        n_wrong, _ = chain_is_consistent(problem.prompt, text.replace("~", "="))
        assert (n_wrong > 0) == (first < len(marked))
        wrong += n_wrong
        if not any(early):
            assert text == problem.solution
        assert len(text) + 1 <= cfg.rollout.max_new_tokens
    assert wrong / decisions == pytest.approx(ws.step_noise, abs=0.05)


def test_new_noise_fields_at_their_defaults_leave_the_warm_start_key_as_it_was():
    credit = preset("tiny_credit")
    assert "noisy_first_steps" not in warm_start_key(credit)["warm_start"]
    assert "mark_mistakes" not in warm_start_key(credit)["warm_start"]
    decision = warm_start_key(preset("tiny_decision"))["warm_start"]
    assert decision["noisy_first_steps"] == 3 and decision["mark_mistakes"] is True
