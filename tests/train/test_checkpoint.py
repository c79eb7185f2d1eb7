"""Orbax checkpoints: keep-last-N plus best-by-dev, and a resumed run equal to a straight one, bitwise."""

from __future__ import annotations

import json

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from conftest import small_train_config

from comppo_jax.train.checkpoint import RunCheckpoints
from comppo_jax.train.loop import train


def test_keeps_the_last_n_and_the_best_by_dev_accuracy(tmp_path):
    checkpoints = RunCheckpoints(str(tmp_path), keep_last=2, keep_best=1)
    state = {"w": np.arange(4.0)}
    for step, accuracy in zip(range(1, 6), [0.5, 0.9, None, 0.2, 0.3]):
        checkpoints.save(step, {"w": state["w"] + step}, {"next_step": step}, accuracy)
    checkpoints.wait()
    assert checkpoints.manager.all_steps() == [2, 4, 5] and checkpoints.best_step() == 2
    restored, meta = checkpoints.restore(state, step=2)
    np.testing.assert_array_equal(restored["w"], np.arange(4.0) + 2)
    assert meta == {"next_step": 2}
    checkpoints.close()


def test_resume_without_a_checkpoint_and_rerun_without_resume_are_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="no checkpoint under"):
        RunCheckpoints(str(tmp_path), keep_last=1).restore({"w": np.zeros(2)})
    checkpoints = RunCheckpoints(str(tmp_path), keep_last=1)
    checkpoints.save(1, {"w": np.zeros(2)}, {})
    checkpoints.wait()
    checkpoints.close()
    with pytest.raises(FileExistsError, match="--config.resume=True"):
        train(small_train_config(tmp_path))


def restored_state(run_dir, step):
    with ocp.StandardCheckpointer() as checkpointer:
        return checkpointer.restore(run_dir / "checkpoints" / str(step) / "state")


@pytest.mark.slow
def test_two_steps_stop_resume_two_steps_equals_four_steps_bitwise(tmp_path):
    straight, split = tmp_path / "straight", tmp_path / "split"
    train(small_train_config(straight, steps=4))
    train(small_train_config(split, steps=2))
    train(small_train_config(split, steps=4, resume=True))

    # CompPO: 1 critic warm-up step, then 4 actor updates (2 + 2 across the resume).
    a, b = restored_state(straight, 5), restored_state(split, 5)
    paths = jax.tree_util.tree_flatten_with_path(a)[0]
    assert len(paths) == len(jax.tree.leaves(b)) > 0
    for (path, x), y in zip(paths, jax.tree.leaves(b)):
        np.testing.assert_array_equal(x, y, err_msg=jax.tree_util.keystr(path))
    rows = lambda run: [{k: v for k, v in json.loads(line).items() if k != "seconds"} for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert rows(straight) == rows(split) and [r["step"] for r in rows(split)] == [0, 1, 2, 3, 4]
    summary = lambda run: {k: v for k, v in json.loads((run / "summary.json").read_text()).items()}
    assert summary(straight) == summary(split)
