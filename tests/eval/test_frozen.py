"""Frozen evaluation: the majority vote's tie rule, unbiased pass@k and avg@n by hand, and launch/eval.py on a
checkpoint from a 2-step run."""

from __future__ import annotations

import csv
import json
from fractions import Fraction

import numpy as np
import pytest
from conftest import launch_script, small_train_config
from ml_collections import config_dict

from comppo_jax.eval import majority_answer
from comppo_jax.eval.frozen import eval_sampling, pass_at_k, pass_k_values, set_metrics
from comppo_jax.train.loop import train


def test_majority_vote_ties_go_to_the_earliest_sample_and_missing_answers_do_not_vote():
    assert majority_answer(["3", "4", "4", "3"]) == "3"  # 2-2 tie: "3" came first
    assert majority_answer(["4", "3", "3", "4"]) == "4"
    assert majority_answer([None, None, "7", " 8", "8 "]) == "8"  # stripped strings vote
    assert majority_answer([None, "5", None]) == "5"
    assert majority_answer([None, None]) is None


def test_unbiased_pass_at_k_by_hand():
    assert pass_at_k(5, 2, 2) == 1 - Fraction(3, 10)  # 1 - C(3, 2) / C(5, 2)
    assert pass_at_k(8, 3, 4) == 1 - Fraction(5, 70)  # 1 - C(5, 4) / C(8, 4)
    assert [pass_at_k(6, 0, k) for k in (1, 3, 6)] == [0, 0, 0]  # c = 0: never
    assert [pass_at_k(6, 6, k) for k in (1, 3, 6)] == [1, 1, 1]  # c = n: always
    assert [pass_at_k(6, c, 6) for c in (1, 2, 5)] == [1, 1, 1]  # k = n: any correct sample
    assert all(pass_at_k(7, c, 1) == Fraction(c, 7) for c in range(8))  # pass@1 is the sample accuracy
    assert pass_at_k(4, 1, 3) == Fraction(3, 4)  # 3 of 4 drawn miss the one correct with probability 1/4
    for bad in ((4, 5, 1), (4, 1, 5), (4, 1, 0)):
        with pytest.raises(ValueError, match="pass@k needs"):
            pass_at_k(*bad)


def test_set_metrics_by_hand():
    greedy = [True, False, False]
    samples = [[True, False, False, False], [True, True, True, True], [False] * 4]
    majority = [False, True, False]
    got = set_metrics(greedy, samples, majority, 4, (1, 2, 4))
    assert got["problems"] == 3
    assert got["greedy_pass@1"] == pytest.approx(1 / 3) and got["majority@4"] == pytest.approx(1 / 3)
    assert got["avg@4"] == pytest.approx((1 / 4 + 1 + 0) / 3) == got["pass@1"]
    assert got["avg@4"] == got["pass@1"]  # exact fractions: equal bit for bit
    assert got["pass@2"] == pytest.approx((1 / 2 + 1 + 0) / 3)  # 1 - C(3, 2) / C(4, 2) = 1/2 for the first problem
    assert got["pass@4"] == pytest.approx(2 / 3)
    # The standard error of the mean over problems: sample std (ddof 1) / sqrt(3).
    assert got["pass@2_se"] == pytest.approx(np.std([0.5, 1.0, 0.0], ddof=1) / np.sqrt(3))
    assert got["greedy_pass@1_se"] == pytest.approx(np.std([1, 0, 0], ddof=1) / np.sqrt(3))
    one = set_metrics([True], [[True, False]], [True], 2, (1,))
    assert one["avg@2"] == 0.5 and one["avg@2_se"] == 0.0  # one problem: no spread to estimate


def test_eval_sampling_fields_are_checked_and_named():
    fields = lambda **kw: config_dict.ConfigDict({"samples": 8, "temperature": 1.0, "top_p": 0.7, "pass_k": "", **kw})
    assert eval_sampling(fields()) == (1, 8) and pass_k_values("4, 1,8", 8) == (1, 4, 8)
    for bad, match in (
        (dict(samples=0), "config.eval.samples=0"),
        (dict(temperature=-1.0), "config.eval.temperature=-1.0"),
        (dict(top_p=0.0), "config.eval.top_p=0.0"),
        (dict(pass_k="16"), "each k must be in \\[1, eval.samples=8\\]"),
        (dict(pass_k="one"), "expected integers"),
    ):
        with pytest.raises(ValueError, match=match):
            eval_sampling(fields(**bad))


@pytest.mark.slow
def test_eval_restores_a_training_checkpoint_and_writes_a_resumable_table(tmp_path):
    run = tmp_path / "run"
    train(small_train_config(run))
    gsm8k = tmp_path / "gsm8k.jsonl"
    gsm8k.write_text(
        "".join(
            json.dumps({"question": f"{i} +2 =?\n", "answer": f"{i} + 2 = {i + 2}\n#### {i + 2}"}) + "\n"
            for i in range(3)
        )
    )
    # No --config: the run's own (its dev set of 4, 12 new tokens, one verifier), the sampling fields on top.
    command = [
        "launch/eval.py",
        f"--checkpoint={run}",
        "--step=best",
        f"--config.eval.benchmarks=gsm8k={gsm8k}",
        "--config.eval.samples=8",
        "--config.eval.temperature=1.0",
    ]
    result = launch_script(*command)
    assert result.returncode == 0, result.stderr[-4000:]
    (output,) = (run / "eval").iterdir()  # step_<best>
    # Said before the long restore and compile, and where the results went.
    assert result.stdout.startswith(f"restoring step {output.name.removeprefix('step_')} of {run} ...\n")
    assert result.stdout.rstrip().endswith(f"results written to {output}/results.csv and results.json")
    # The first batch compiles each decoder: said once each, not at every set.
    compiles = [line for line in result.stdout.splitlines() if line.startswith("compiling ")]
    assert compiles == ["compiling the greedy decoder...", "compiling the sampler (8 samples a problem)..."]
    with open(output / "results.csv") as f:
        rows = list(csv.DictReader(f))
    metrics = ("greedy_pass@1", "avg@8", "pass@1", "pass@8", "majority@8")
    assert list(rows[0]) == ["set", "problems"] + [c for m in metrics for c in (m, f"{m}_se")]
    assert [r["set"] for r in rows] == ["id_dev", "gsm8k", "macro (frozen)"]
    assert rows[0]["problems"] == "4" and rows[1]["problems"] == "3"
    stored = json.loads((output / "results.json").read_text())
    assert stored["settings"]["temperature"] == 1.0 and stored["settings"]["pass_k"] == [1, 8]
    for row in stored["rows"]:
        assert row["pass@1"] == row["avg@8"] and row["avg@8"] <= row["pass@8"]  # unbiased pass@1 is avg@n
    assert "| gsm8k | 3 |" in result.stdout

    # A finished set is read back, not recomputed, when its settings are the ones asked for.
    finished = json.loads((output / "gsm8k.json").read_text())
    finished["metrics"]["greedy_pass@1"] = 0.5
    (output / "gsm8k.json").write_text(json.dumps(finished))
    again = launch_script(*command)
    assert again.returncode == 0, again.stderr[-4000:]
    assert "| gsm8k | 3 | 0.500 (" in again.stdout

    # At temperature 0 the one sample is the greedy response: avg@1 is greedy pass@1 (other settings: every set
    # recomputed).
    greedy = launch_script(*command[:-2], "--config.eval.samples=1", "--config.eval.temperature=0.0")
    assert greedy.returncode == 0, greedy.stderr[-4000:]
    for row in json.loads((output / "results.json").read_text())["rows"]:
        assert row["avg@1"] == row["greedy_pass@1"] == row["pass@1"], row

    missing = launch_script(*command[:2], "--step=7", *command[3:])
    assert missing.returncode != 0 and "no checkpoint '7'" in missing.stderr


@pytest.mark.slow  # two conversation programs compiled, half a minute
def test_a_tool_runs_evaluation_talks_to_its_environment(tmp_path):
    """evaluate_problems with `tools` (launch/eval.py passes a tool run's rollout.environment): greedy and sampled
    answers are conversations, each call answered by the environment."""
    import jax

    from comppo_jax.data.rewards import VerifierPool
    from comppo_jax.data.synthetic import chained_arithmetic
    from comppo_jax.data.tokenizers import CharTokenizer
    from comppo_jax.environments import Environment, Reply
    from comppo_jax.eval.frozen import evaluate_problems
    from comppo_jax.models import ModelConfig, init_params
    from comppo_jax.rollout.turns import ToolUse

    class Digits(Environment):
        call_tokens = tuple("0123456789")

        def __init__(self):
            self.asked = 0

        def reset(self, problems):
            pass

        def step(self, turns):
            self.asked += len(turns)
            return [Reply("=7") for _ in turns]

    config = ModelConfig(
        architecture="qwen3", vocab_size=128, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=8, eos_token_ids=(2,), pad_token_id=0,
    )  # fmt: skip
    params = init_params(config, jax.random.PRNGKey(0), init_std=0.02)  # near-uniform: digits come often
    environment = Digits()
    with VerifierPool(num_workers=1) as pool:
        metrics = evaluate_problems(
            params, config, CharTokenizer(), chained_arithmetic(3, seed=0), pool, max_new_tokens=24, samples=2,
            temperature=1.0, top_p=1.0, tools=ToolUse(environment, max_turns=3, max_reply_tokens=4),
        )  # fmt: skip
    assert environment.asked > 3 and 0 <= metrics["avg@2"] <= 1
