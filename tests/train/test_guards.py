"""The non-finite guard (skip, count, stop after K in a row; never save NaN) and the stop signals."""

from __future__ import annotations

import functools
import json
import os
import signal

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from conftest import small_train_config
from update_inputs import CONFIG, HYPER, update_inputs

from comppo_jax.rollout import experience
from comppo_jax.runs.checkpoint import NonFiniteStateError, RunCheckpoints
from comppo_jax.train import loop
from comppo_jax.train.guards import NonFiniteError, StopSignals
from comppo_jax.train.update import actor_step, critic_step


def assert_trees_equal(a, b):
    for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(a)[0], jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=jax.tree_util.keystr(path))


def test_a_non_finite_loss_leaves_params_and_optimizer_state_unchanged():
    actor, actor_opt, actor_tx, critic_module, critic, critic_opt, critic_tx, batch = update_inputs()
    poisoned = batch._replace(
        advantages=batch.advantages.at[0, 0].set(jnp.nan), returns=batch.returns.at[1, 0].set(jnp.inf)
    )
    step = jax.jit(functools.partial(actor_step, config=CONFIG, tx=actor_tx))
    params, opt_state, metrics = step(actor, actor_opt, poisoned, HYPER["actor"])
    assert not metrics["actor_finite"]
    assert_trees_equal(params, actor)
    assert_trees_equal(opt_state, actor_opt)
    critic_fn = jax.jit(functools.partial(critic_step, critic_module=critic_module, kind="tac", tx=critic_tx))
    params, opt_state, metrics = critic_fn(critic, critic_opt, poisoned, HYPER["critic"])
    assert not metrics["critic_finite"]
    assert_trees_equal(params, critic)
    assert_trees_equal(opt_state, critic_opt)
    # A finite batch still trains.
    params, _, metrics = step(actor, actor_opt, batch, HYPER["actor"])
    assert metrics["actor_finite"] and not np.array_equal(params["embed"], actor["embed"])


def test_a_non_finite_state_is_never_saved(tmp_path):
    checkpoints = RunCheckpoints(str(tmp_path), keep_last=2)
    with pytest.raises(
        NonFiniteStateError, match=r"checkpoint 3 not saved: the state holds NaN or inf in \['actor'\]\['w'\]"
    ):
        checkpoints.save(3, {"actor": {"w": jnp.array([1.0, jnp.nan])}, "count": jnp.int32(1)}, {})
    checkpoints.close()
    assert checkpoints.manager.all_steps() == [] and not any(
        name.startswith("3") for name in os.listdir(tmp_path / "checkpoints")
    )


def test_stop_signals_set_a_flag_instead_of_killing():
    previous = signal.getsignal(signal.SIGTERM)
    with StopSignals() as stop:
        assert not stop.requested()
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)  # a second one while stopping is ignored
        assert stop.requested() and stop.received == signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is previous


def restored_state(run_dir, step):
    with ocp.StandardCheckpointer() as checkpointer:
        return checkpointer.restore(run_dir / "checkpoints" / str(step) / "state")


@pytest.mark.slow
def test_nan_rewards_are_skipped_counted_and_stop_the_run_after_k_in_a_row(tmp_path, monkeypatch):
    """Steps 1..5 (a critic warm-up step, then 4 actor updates): NaN rewards at step 2, then at 4 and 5."""
    calls = []
    score = experience.score_responses

    def poisoned(texts, *args, **kwargs):
        rewards, verdicts, metrics = score(texts, *args, **kwargs)
        calls.append(len(calls))
        if len(calls) - 1 in (1, 3, 4):
            rewards = rewards.copy()
            rewards[0] = np.nan
        return rewards, verdicts, metrics

    monkeypatch.setattr(experience, "score_responses", poisoned)
    config = small_train_config(tmp_path, steps=4, checkpoint__keep_last=10, train__max_skipped_updates=2)
    with pytest.raises(
        NonFiniteError,
        match=r"step 5: 2 consecutive updates skipped for non-finite values, last in rewards \(rows \[0\]\), ",
    ):
        loop.train(config)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [row["skipped_updates"] for row in rows] == [0, 1, 1, 2, 3]
    poisoned_step = "rewards (rows [0]), advantages, returns"  # named where it arose, then where it spread
    assert [row.get("nonfinite") for row in rows] == [None, poisoned_step, None, poisoned_step, poisoned_step]
    # Checkpoint k holds the state after step k: step 2 changed nothing, step 3 trained.
    assert_trees_equal(restored_state(tmp_path, 2), restored_state(tmp_path, 1))
    assert not np.array_equal(
        restored_state(tmp_path, 3)["actor"]["embed"], restored_state(tmp_path, 2)["actor"]["embed"]
    )
    assert_trees_equal(restored_state(tmp_path, 4), restored_state(tmp_path, 3))
    assert sorted(int(s) for s in os.listdir(tmp_path / "checkpoints") if s.isdigit()) == [1, 2, 3, 4]
