"""Each method and control selects the intended gate, critic and estimator."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import small_train_config

from comppo_jax.credit import FIXED_GATE, fit_position_schedule
from comppo_jax.models import model_config
from comppo_jax.train.methods import Recipe, behaviour_pass, control_gate, recipe, spread_over_sequence
from comppo_jax.train.specs import resolve

MASK = jnp.asarray([[1, 1, 1, 0], [1, 1, 0, 0]], bool)
KAPPA = jnp.asarray([[0.2, 0.5, 0.8, 0.0], [0.3, 0.6, 0.0, 0.0]])


@pytest.mark.parametrize(
    "method,gate,critic,expected",
    [
        ("comppo", "attention", "tac", Recipe("attention", "tac", "comp_gae")),  # full CompPO
        ("comppo", "fixed", "tac", Recipe("fixed", "tac", "comp_gae")),  # factorial: fixed gate + aligned critic
        ("comppo", "attention", "standard", Recipe("attention", "standard", "comp_gae")),  # Comp-GAE + standard critic
        ("comppo", "fixed", "standard", Recipe("fixed", "standard", "comp_gae")),
        ("comppo", "shuffle", "tac", Recipe("shuffle", "tac", "comp_gae")),
        ("comppo", "position", "tac", Recipe("position", "tac", "comp_gae")),
        ("ppo", "attention", "tac", Recipe("gamma", "standard", "gae")),  # PPO ignores the CompPO switches
        ("grpo", "attention", "tac", Recipe("none", "none", "grpo")),
    ],
)
def test_recipes(method, gate, critic, expected):
    assert recipe(method, gate, critic) == expected


def test_only_grpo_with_the_sampler_log_probs_skips_the_behaviour_pass():
    # CompPO reads the gate (and TAC's features), PPO its standard critic's features, GRPO only the old log-probs.
    assert [
        behaviour_pass(recipe(method), old) for method in ("comppo", "ppo", "grpo") for old in ("rescore", "sampler")
    ] == [True, True, True, True, True, False]
    assert all(
        behaviour_pass(recipe("comppo", gate, critic), "sampler")
        for gate in ("fixed", "position")
        for critic in ("tac", "standard")
    )


def test_bad_switches_are_named():
    with pytest.raises(ValueError, match=r"config.method='a2c'"):
        recipe("a2c")
    with pytest.raises(ValueError, match=r"config.gate='random'"):
        recipe("comppo", "random")
    with pytest.raises(ValueError, match=r"config.critic.kind='none'"):
        recipe("comppo", "attention", "none")
    with pytest.raises(ValueError, match=r"config.credit.estimator='vapo' needs config.method='ppo', not 'grpo'"):
        recipe("grpo", estimator="vapo")
    with pytest.raises(ValueError, match=r"config.credit.estimator='ktae' needs config.method='grpo', not 'ppo'"):
        recipe("ppo", estimator="ktae")


def test_an_estimator_beyond_the_paper_replaces_its_method_s_own_and_keeps_its_gate_and_critic():
    assert recipe("ppo", estimator="vapo") == Recipe(gate="gamma", critic="standard", estimator="vapo")
    assert recipe("grpo", estimator="ktae") == Recipe(gate="none", critic="none", estimator="ktae")
    assert recipe("grpo", estimator="attention_anchor").estimator == "attention_anchor"


def test_control_gates():
    rng = jax.random.PRNGKey(0)
    assert control_gate(recipe("comppo"), KAPPA, MASK, rng) is KAPPA
    np.testing.assert_allclose(
        control_gate(recipe("comppo", "fixed"), KAPPA, MASK, rng), np.where(MASK, FIXED_GATE, 0.0)
    )
    np.testing.assert_allclose(
        control_gate(recipe("comppo", "fixed"), KAPPA, MASK, rng, fixed_value=0.33), np.where(MASK, 0.33, 0.0)
    )
    shuffled = control_gate(recipe("comppo", "shuffle"), KAPPA, MASK, rng)
    assert sorted(np.asarray(shuffled)[np.asarray(MASK)]) == sorted(np.asarray(KAPPA)[np.asarray(MASK)])
    np.testing.assert_array_equal(control_gate(recipe("ppo"), KAPPA, MASK, rng), MASK.astype(np.float32))
    schedule = fit_position_schedule(KAPPA, MASK)
    position = control_gate(recipe("comppo", "position"), KAPPA, MASK, rng, schedule)
    assert position.shape == KAPPA.shape and float(position[0, 3]) == 0.0
    with pytest.raises(ValueError, match="needs config.position_schedule"):
        control_gate(recipe("comppo", "position"), KAPPA, MASK, rng)


def test_per_token_values_are_placed_at_the_state_before_each_token():
    placed = spread_over_sequence(KAPPA, jnp.asarray([2, 3]), 7)
    np.testing.assert_allclose(placed[0, 1:4], KAPPA[0, :3])
    np.testing.assert_allclose(placed[1, 2:6], KAPPA[1])
    assert float(placed[0, 0]) == 0.0


@pytest.mark.parametrize(
    "method,critic,gate_refresh,first",
    [
        ("comppo", "tac", "rollout", True),
        ("comppo", "standard", "rollout", True),
        ("ppo", "full", "rollout", True),
        # The gate refreshed from each epoch's actor reruns Comp-GAE: the critic's targets change per
        # epoch, so its epochs interleave with the actor's, whichever critic it is.
        ("comppo", "tac", "epoch", False),
        ("comppo", "standard", "epoch", False),
        ("comppo", "full", "epoch", False),
        ("grpo", "tac", "rollout", False),  # no critic
    ],
)
def test_the_critics_epochs_run_first_unless_the_gate_is_refreshed_per_epoch(
    tmp_path, method, critic, gate_refresh, first
):
    cfg = small_train_config(tmp_path, method=method, critic__kind=critic, gate_refresh=gate_refresh)
    assert resolve(cfg, model_config(cfg.model)).learner.critic_first is first
