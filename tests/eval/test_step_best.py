"""step=best on a run none of whose checkpoints was saved at a dev evaluation names the real cause and --step=latest."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import launch_quick, small_train_config

from comppo_jax.eval.export import export_run
from comppo_jax.runs.checkpoint import RunCheckpoints
from comppo_jax.train.schema import save_run_config

# (overrides, the cause named): each run saves checkpoint 3, its critic warm-up step and 2 actor updates.
NEVER_EVALUATED = {
    "shorter than its first evaluation": (
        dict(train__eval_every=10),
        "its steps ended at 3, before its first dev evaluation at step 11 (train.eval_every=10)",
    ),
    "no evaluations": (dict(train__eval_every=0), "train.eval_every=0: it never evaluates"),
}


def unevaluated_run(directory, overrides) -> str:
    """A run directory holding config.json and checkpoint 3, saved without a dev accuracy."""
    save_run_config(small_train_config(directory, **overrides), str(directory))
    checkpoints = RunCheckpoints(str(directory))
    checkpoints.save(3, {"actor": {"w": np.ones(2, np.float32)}}, {})
    checkpoints.close()
    return str(directory)


def expected(run: str, why: str) -> str:
    return (
        f"step=best: the run in {run} has checkpoints but none was saved at a dev evaluation ({why}); pass "
        "--step=latest (step 3) or a saved step number"
    )


@pytest.mark.parametrize("case", NEVER_EVALUATED)
def test_an_export_of_step_best_names_the_cause_and_step_latest(tmp_path, case):
    overrides, why = NEVER_EVALUATED[case]
    run = unevaluated_run(tmp_path / "run", overrides)
    with pytest.raises(FileNotFoundError) as error:
        export_run(run, "best", str(tmp_path / "out"))
    assert str(error.value) == expected(run, why)
    assert not (tmp_path / "out").exists()


def test_launch_eval_of_step_best_names_the_cause_and_step_latest(tmp_path):
    overrides, why = NEVER_EVALUATED["shorter than its first evaluation"]
    run = unevaluated_run(tmp_path / "run", overrides)
    result = launch_quick("launch/eval.py", f"--checkpoint={run}", "--step=best")
    assert result.returncode == 1 and result.stderr.splitlines()[0] == f"error: FileNotFoundError: {expected(run, why)}"
