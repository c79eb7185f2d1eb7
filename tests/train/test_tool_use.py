"""Tool use through the train loop's own path: rollout.environment -> conversations -> rewards -> the
learner's mask and credit, and faults injected into the tools while the loop runs."""

from __future__ import annotations

import itertools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import small_train_config
from update_inputs import CONFIG

from comppo_jax import environments, sharding, workers
from comppo_jax.credit import registry
from comppo_jax.environments import ERROR, MALFORMED, OK, TIMEOUT, Environment, Reply
from comppo_jax.rollout.experience import Sampled
from comppo_jax.rollout.sampler import Generation
from comppo_jax.train.learner import Signals, credit_fields, rollout_batch
from comppo_jax.train.loop import train
from comppo_jax.train.specs import credit_spec
from comppo_jax.train.update import minibatch_shardings
from comppo_jax.train.validation import validate_config


class FaultyTools(Environment):
    """Every digit ends a call; of each 12 calls the first goes to a tool that hangs, the second to one that
    raises, the third nowhere (malformed), the rest to the calculator."""

    call_tokens = tuple("0123456789")

    def __init__(self):
        self.pool = workers.function_pool("tests.environments.faulty_tools:hangs_or_raises", 1, timeout_s=0.3)
        self.calls = itertools.count()

    def reset(self, problems):
        pass

    def step(self, turns):
        replies = []
        for _ in turns:
            kind = min(next(self.calls) % 12, 3)
            if kind == 2:
                replies.append(Reply("=malformed", outcome=MALFORMED))
                continue
            expression = {0: "1+1", 1: "2+2", 3: "6*7"}[kind]
            result = self.pool.run([[expression, 1000]])[0]
            outcome = {workers.OK: OK, workers.TIMEOUT: TIMEOUT}.get(result.status, ERROR)
            replies.append(Reply(f"={result.value if outcome == OK else outcome}", outcome=outcome))
        return replies

    def close(self):
        self.pool.close()


@pytest.mark.slow  # a whole run, about a minute
def test_the_loop_goes_on_through_hanging_raising_and_malformed_calls_and_counts_them(tmp_path, monkeypatch):
    monkeypatch.setattr(environments, "make_environment", lambda name, workers=2: FaultyTools())
    cfg = small_train_config(tmp_path, rollout__environment="calculator", rollout__max_turns=3, steps=2)
    validate_config(cfg)
    summary = train(cfg)
    assert summary["actor_updates"] == 2
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    counted = {outcome: sum(r.get(f"env/{outcome}", 0) for r in rows) for outcome in (OK, MALFORMED, ERROR, TIMEOUT)}
    assert all(count > 0 for count in counted.values()), counted
    assert all(r["env/calls"] > 0 for r in rows if "env/calls" in r)


def designed_conversation():
    """Two rows of prompt (2) + response (6): policy, call, reply (env) x2, policy, policy; reward 1 on row 0."""
    env_mask = np.array([[0, 0, 1, 1, 0, 0], [0, 0, 1, 1, 0, 0]], bool)
    mask = np.array([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0]], bool)
    attention = np.concatenate([np.ones((2, 2), bool), mask], axis=1)
    tokens = np.where(attention, 5, 0).astype(np.int32)
    generation = Generation(
        jnp.asarray(tokens),
        jnp.asarray(attention),
        jnp.full((2,), 2, jnp.int32),
        jnp.asarray(tokens[:, 2:]),
        jnp.asarray(mask),
        jnp.zeros(mask.shape),
    )
    policy = mask & ~env_mask
    reward_tokens = np.zeros(mask.shape, np.float32)
    reward_tokens[0, 5] = 1.0
    rewards = np.array([1.0, 0.0], np.float32)
    sampled = Sampled(generation, [], [], rewards, [], {}, mask, reward_tokens, attention.sum(1), env_mask)
    return sampled, policy


@pytest.mark.parametrize("method", ["comppo", "ppo", "grpo"])
def test_environment_tokens_carry_no_loss_and_no_advantage(tmp_path, method):
    """config -> credit_spec -> rollout_batch -> the learner's credit_fields: the Minibatch's mask (every
    loss's) holds the policy's tokens only, and the environment's tokens get no advantage and no return."""
    sampled, policy = designed_conversation()
    cfg = small_train_config(
        tmp_path, method=method, rollout__environment="calculator", credit__env_crossing="pass", critic__fused_layers=1
    )
    validate_config(cfg)
    credit = credit_spec(cfg, CONFIG)
    assert credit.estimator.env_crossing == "pass"
    rollout = type("Rollout", (), {"response_mask": sampled.generation.response_mask, "log_probs": None})
    rollout.ref_log_probs = rollout.hidden_states = rollout.routing = None
    mesh = sharding.make_mesh(dict(data=1, fsdp=1, tensor=1), jax.devices()[:1])
    batch = rollout_batch(sampled, rollout, minibatch_shardings(mesh, with_routing=False, hidden_size=8))
    np.testing.assert_array_equal(batch.response_mask, policy)
    values = jnp.asarray(np.random.default_rng(0).uniform(-1, 1, policy.shape), jnp.float32)
    signals = Signals(jnp.full(policy.shape, 0.5), sampled.rewards, sampled.reward_tokens, None, None, sampled.env_mask)
    fields, _ = jax.jit(lambda b, s: credit_fields(credit, lambda c, _: c, values, b, s, jax.random.PRNGKey(0)))(
        batch._replace(old_log_probs=jnp.zeros(policy.shape)), signals
    )
    env = sampled.env_mask
    assert (np.asarray(fields["advantages"])[env] == 0).all() and (np.asarray(fields["returns"])[env] == 0).all()
    assert np.abs(np.asarray(fields["advantages"])[policy]).sum() > 0
    if method != "grpo":  # the trace crosses the reply (credit.turns), not cut at the call
        arguments = (credit.estimator, sampled.rewards, sampled.reward_tokens, batch.response_tokens, values)
        crossed = registry.estimate(
            *arguments, jnp.full(policy.shape, 0.5), jnp.asarray(policy), registry.Statistics(None, env)
        )[1]
        cut = registry.estimate(*arguments, jnp.full(policy.shape, 0.5), jnp.asarray(policy))[1]
        np.testing.assert_allclose(fields["returns"], crossed, atol=1e-6)
        assert np.abs(np.asarray(crossed) - np.asarray(cut)).max() > 1e-3
