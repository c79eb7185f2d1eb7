"""The scoring demo (launch/score.py) prints per-token concentration on the tiny config."""

from __future__ import annotations

import math

from conftest import launch_script


def test_score_demo_prints_per_token_concentration():
    result = launch_script(
        "launch/score.py",
        "--config=configs/tiny.py",
        "--batch_size=2",
        "--response_length=12",
        "--config.model.arch.num_layers=2",
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("model: qwen3, 2 layers")
    table = lines[
        lines.index(next(line for line in lines if line.split() == ["t", "token", "n_t", "H_t", "c_t", "kappa_t"]))
        + 1 :
    ]
    first, second, third = (row.split() for row in table[:3])
    assert (first[2], first[3]) == ("0", "0.0000")  # y_1 has an empty response window
    assert (second[2], second[3]) == ("1", "1.0000")  # one key: H = 1
    assert first[4] == second[4] == "0.5000"  # c = 1/2 where n < 2 (eq. cnorm)
    assert first[5] == second[5] == "0.5000"  # kappa = g(1/2), the envelope's midpoint
    assert third[2] == "2" and 0.5 <= float(third[3]) <= 1.0
    assert abs(float(third[4]) - math.log(2 * float(third[3])) / math.log(2)) < 2e-4
