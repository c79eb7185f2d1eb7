"""train.token_selection=entropy_top through the learner's path: a config (configs/tiny.py with each method's and
DAPO's overrides) -> the learner spec's ActorLoss -> `actor_loss` on a tiny model equals the hand computation of
Wang et al. 2025's masked surrogate (their code: the clipped surrogate's token-mean over the kept tokens, the KL
over every token); the policy gradient reaches only the kept tokens; packed rows and a minibatch split over
devices select the same tokens (the threshold is the whole minibatch's)."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import textwrap

import jax
import numpy as np
import packed_batches
import pytest
from conftest import HANG_S, HELPERS_PATH, fake_devices_env, small_train_config
from update_inputs import CONFIG, update_inputs

from comppo_jax.models import forward, init_params
from comppo_jax.rollout import gather_response
from comppo_jax.train import update
from comppo_jax.train.specs import resolve
from comppo_jax.train.update import actor_loss, policy_token_stats
from comppo_jax.train.validation import validate_config

HERE = os.path.dirname(os.path.abspath(__file__))
CLIP, KL_COEF = 0.2, 0.05
# configs/experiments.py's DAPO arm: the decoupled clip 0.2 / 0.28 and no KL term (the rest leaves the loss alone).
DAPO = dict(
    train__clip_high_scale=1.4,
    rollout__dynamic_sampling=True,
    rollout__dynamic_sampling_filter="accuracy",
    reward__length_penalty="overlong",
    reward__length_penalty_on="all",
    reward__length_penalty_schedule="constant",
    reward__overlong_buffer=4,  # inside the small run's 12-token responses, as configs/experiments_tiny.py's
    train__kl_coef=0.0,
    train__kl_coef_grpo=0.0,
)
CASES = {
    "grpo": dict(method="grpo"),
    "ppo": dict(method="ppo"),
    "comppo": dict(method="comppo", train__token_selection_fraction=0.3),
    "dapo": dict(method="grpo", **DAPO),
    "comppo_dapo": dict(method="comppo", **DAPO),
}


def actor_loss_spec(tmp_path, **overrides):
    """The learner spec's ActorLoss of small_train_config with token_selection=entropy_top and `overrides`."""
    overrides = {"train__token_selection": "entropy_top", **overrides}
    cfg = small_train_config(tmp_path, critic__fused_layers=2, critic__top_k=4, **overrides)
    validate_config(cfg)
    return resolve(cfg, CONFIG).learner.actor_loss


@functools.cache
def moved_policy():
    """(a policy moved off the one that scored update_inputs' minibatch, so ratios differ from 1; the minibatch)."""
    actor, *_, batch = update_inputs()
    other = init_params(CONFIG, jax.random.PRNGKey(1), init_std=0.2)
    return jax.tree.map(lambda a, b: 0.8 * a + 0.2 * b, actor, other), batch


def hand_objective(spec, params, batch) -> dict:
    """Wang et al.'s masked DAPO/PPO surrogate in float64 from the model's log-probs and entropies: of the n valid
    tokens the k = ceil(rho n) of highest entropy H (tau the k-th; the model's entropies have no ties, so this is
    also the paper's I[H >= tau]); their clipped surrogate's mean over the k, plus the KL's over all n."""
    log_probs, entropy = (
        np.asarray(x, np.float64)
        for x in policy_token_stats(
            params, CONFIG, batch.tokens, batch.attention_mask, batch.prompt_lengths, batch.response_tokens
        )
    )
    mask = np.asarray(batch.response_mask)
    valid = entropy[mask]
    assert np.unique(valid).size == valid.size
    k = int(np.ceil(spec.token_selection_fraction * valid.size - 1e-9))
    tau = np.sort(valid)[::-1][k - 1]
    kept = mask & (entropy >= tau)
    ratio = np.exp(log_probs - np.asarray(batch.old_log_probs, np.float64))
    adv = np.asarray(batch.advantages, np.float64)
    unclipped, clipped = -ratio * adv, -np.clip(ratio, 1 - CLIP, 1 + CLIP * spec.clip_high_scale) * adv
    policy = np.maximum(unclipped, clipped)[kept].mean()
    d = np.asarray(batch.ref_log_probs, np.float64) - log_probs
    kl = (np.expm1(d) - d)[mask].mean()
    return dict(
        loss=policy + KL_COEF * kl if spec.kl_term else policy,
        policy_loss=policy,
        kept_fraction=k / valid.size,
        tau=tau,
        clip_fraction=(clipped > unclipped)[mask].mean(),  # over every token, as their code's pg_clipfrac
    )


@pytest.mark.parametrize("case", CASES)
def test_the_actor_loss_is_the_surrogate_over_the_top_entropy_tokens(tmp_path, case):
    spec = actor_loss_spec(tmp_path, **CASES[case])
    fraction = CASES[case].get("train__token_selection_fraction", 0.2)
    assert (spec.token_selection, spec.token_selection_fraction) == ("entropy_top", fraction)
    assert spec.kl_term == ("dapo" not in case) and spec.clip_high_scale == (1.4 if "dapo" in case else 1.0)
    params, batch = moved_policy()
    loss, metrics = actor_loss(params, CONFIG, batch, CLIP, KL_COEF, spec)
    want = hand_objective(spec, params, batch)
    assert float(loss) == pytest.approx(want["loss"], rel=1e-5)
    assert float(metrics["policy_loss"]) == pytest.approx(want["policy_loss"], rel=1e-5)
    assert float(metrics["token_selection/kept_fraction"]) == pytest.approx(want["kept_fraction"], rel=1e-6)
    assert float(metrics["token_selection/entropy_threshold"]) == pytest.approx(want["tau"], rel=1e-5)
    assert float(metrics["clip_fraction"]) == pytest.approx(want["clip_fraction"], rel=1e-6)
    assert ("kl_loss" in metrics) == spec.kl_term
    # All tokens (the default): another loss, and no token_selection metrics.
    every = actor_loss(
        params, CONFIG, batch, CLIP, KL_COEF, actor_loss_spec(tmp_path, **CASES[case], train__token_selection="all")
    )
    assert float(every[0]) != pytest.approx(float(loss), rel=1e-3)
    assert not any(name.startswith("token_selection/") for name in every[1])


def test_tokens_are_ranked_by_the_entropy_of_the_distribution_they_were_sampled_from(tmp_path):
    """rollout.temperature=0.5: the threshold is the k-th highest entropy of softmax(z / 0.5), as Wang et al.'s
    code takes it, not of softmax(z)."""
    spec = actor_loss_spec(tmp_path, method="grpo", rollout__temperature=0.5)
    assert spec.temperature == 0.5
    params, batch = moved_policy()
    threshold = float(actor_loss(params, CONFIG, batch, CLIP, KL_COEF, spec)[1]["token_selection/entropy_threshold"])
    full = forward(params, CONFIG, batch.tokens, batch.attention_mask).logits
    logits = np.asarray(gather_response(full, batch.prompt_lengths, batch.response_tokens.shape[1]), np.float64)
    mask = np.asarray(batch.response_mask)
    k = int(np.ceil(spec.token_selection_fraction * mask.sum() - 1e-9))

    def kth_entropy(z):
        log_p = z - np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1, keepdims=True)) - z.max(-1, keepdims=True)
        return np.sort(-(np.exp(log_p) * log_p).sum(-1)[mask])[::-1][k - 1]

    assert threshold == pytest.approx(kth_entropy(logits / 0.5), rel=1e-4)
    assert threshold != pytest.approx(kth_entropy(logits), rel=1e-2)


def test_the_policy_gradient_reaches_only_the_kept_tokens_and_the_kl_every_token(tmp_path, monkeypatch):
    """With actor_loss reading given log-probs and entropies (policy_token_stats replaced), d loss / d log-prob is
    0 at every dropped token without the KL term, r A / k (unclipped) at the kept ones; the KL's gradient reaches
    all tokens; the entropies, which only select, get none."""
    spec = actor_loss_spec(tmp_path, method="grpo")
    params, batch = moved_policy()
    log_probs, entropy = policy_token_stats(
        params, CONFIG, batch.tokens, batch.attention_mask, batch.prompt_lengths, batch.response_tokens
    )
    monkeypatch.setattr(update, "policy_token_stats", lambda stats, *args: (stats["log_probs"], stats["entropy"]))
    stats = {"log_probs": log_probs, "entropy": entropy}
    gradient = lambda kl_coef: jax.grad(lambda s: actor_loss(s, CONFIG, batch, CLIP, kl_coef, spec)[0])(stats)
    mask = np.asarray(batch.response_mask)
    tau = hand_objective(spec, params, batch)["tau"]
    kept = mask & (np.asarray(entropy) >= tau)
    dropped = mask & ~kept
    assert kept.sum() == np.ceil(0.2 * mask.sum()) and dropped.sum() > 0
    ratio = np.exp(np.asarray(log_probs, np.float64) - np.asarray(batch.old_log_probs, np.float64))
    adv = np.asarray(batch.advantages, np.float64)
    unclipped = np.clip(ratio, 1 - CLIP, 1 + CLIP) * adv >= ratio * adv  # the min's unclipped branch is active
    want = np.where(kept & unclipped, -ratio * adv / kept.sum(), 0.0)
    policy_only = gradient(0.0)
    np.testing.assert_array_equal(np.asarray(policy_only["log_probs"])[dropped], 0.0)
    np.testing.assert_allclose(policy_only["log_probs"], want, rtol=1e-5, atol=1e-8)
    assert np.count_nonzero(np.asarray(policy_only["log_probs"])[kept]) > 0
    with_kl = gradient(KL_COEF)
    d = np.asarray(batch.ref_log_probs, np.float64) - np.asarray(log_probs, np.float64)
    kl_gradient = np.where(mask, KL_COEF * -np.expm1(d) / mask.sum(), 0.0)  # d/dlogp of (e^d - 1 - d), d = ref - logp
    np.testing.assert_allclose(with_kl["log_probs"], want + kl_gradient, rtol=1e-4, atol=1e-9)
    assert np.all(np.asarray(with_kl["log_probs"])[dropped] != 0.0)
    for g in (policy_only, with_kl):
        np.testing.assert_array_equal(g["entropy"], 0.0)


def test_packed_rows_select_the_same_tokens(tmp_path):
    spec = actor_loss_spec(tmp_path, method="grpo")
    params, batch = moved_policy()
    loss = lambda b: actor_loss(params, CONFIG, b, CLIP, KL_COEF, spec)
    (plain, plain_metrics), (packed, packed_metrics) = (
        loss(batch),
        loss(batch._replace(packing=packed_batches.packing_of(batch.attention_mask))),
    )
    assert float(packed) == pytest.approx(float(plain), rel=1e-5)
    assert packed_metrics.keys() == plain_metrics.keys()
    for name in plain_metrics:
        assert float(packed_metrics[name]) == pytest.approx(float(plain_metrics[name]), rel=1e-5, abs=1e-7), name


SHARDED = textwrap.dedent(
    """
    import jax, numpy as np, optax
    from comppo_jax import sharding
    from comppo_jax.credit.registry import ActorLoss
    from comppo_jax.train.update import apply_actor_step, jit_update_steps, minibatch_shardings, policy_token_stats
    from update_inputs import CONFIG, HYPER, update_inputs

    assert len(jax.devices()) == 4
    SPEC = ActorLoss(token_selection="entropy_top", token_selection_fraction=0.2)

    def one_step(data, devices):
        mesh = sharding.make_mesh(dict(zip(sharding.AXES, (data, 1, 1))), devices)
        actor, *_, batch = update_inputs()
        batch = batch._replace(routing=None)  # no critic reads it
        # SGD: the step moves the params by the gradient itself. Adam's first step, g / (|g| + eps), would blow the
        # rounding noise of the gradients near 0 (the params no kept token reaches) up to lr.
        actor_tx = optax.inject_hyperparams(optax.sgd)(learning_rate=1e-3)
        actor_opt = actor_tx.init(actor)
        steps = jit_update_steps(mesh, dict(actor=actor, actor_opt=actor_opt), model_config=CONFIG,
                                 actor_tx=actor_tx, actor_loss=SPEC)
        actor, actor_opt = sharding.put((actor, actor_opt), sharding.tree_shardings(mesh, (actor, actor_opt)))
        batch = sharding.put(batch, minibatch_shardings(mesh, with_routing=False, hidden_size=CONFIG.hidden_size))
        return apply_actor_step(steps, actor, actor_opt, batch, HYPER["actor"]), batch

    (single, _), (sharded, batch) = one_step(1, jax.devices()[:1]), one_step(4, jax.devices())
    assert len(batch.response_mask.addressable_shards) == 4
    # The rows' top 20% of the whole minibatch is not the union of each device's top 20%: a per-device
    # selection would show in the metrics.
    actor = update_inputs()[0]
    entropy = np.asarray(policy_token_stats(actor, CONFIG, batch.tokens, batch.attention_mask, batch.prompt_lengths,
                                            batch.response_tokens)[1])
    mask = np.asarray(batch.response_mask)
    top = lambda e, m: m & (e >= np.sort(e[m])[::-1][int(np.ceil(0.2 * m.sum())) - 1])
    per_device = np.concatenate([top(entropy[i:i + 2], mask[i:i + 2]) for i in range(0, 8, 2)])
    assert not np.array_equal(top(entropy, mask), per_device)
    k = int(np.ceil(0.2 * mask.sum()))
    metrics = single[2]
    assert np.isclose(float(metrics["token_selection/kept_fraction"]), k / mask.sum())
    assert np.isclose(float(metrics["token_selection/entropy_threshold"]), np.sort(entropy[mask])[::-1][k - 1])
    paths = jax.tree_util.tree_flatten_with_path(jax.device_get(single))[0]
    for (path, a), b in zip(paths, jax.tree.leaves(jax.device_get(sharded))):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6, err_msg=jax.tree_util.keystr(path))
    print("sharded == single device:", len(paths), "leaves")
    """
)


@pytest.mark.slow
def test_a_minibatch_split_over_four_devices_selects_from_the_whole_minibatch():
    """A jitted actor step on a (data=4) mesh: the threshold over all 8 rows, not each device's 2 (the selections
    differ on this minibatch), so metrics and params equal one device's."""
    env = fake_devices_env(4, PYTHONPATH=os.pathsep.join([HERE, HELPERS_PATH]))
    result = subprocess.run([sys.executable, "-c", SHARDED], env=env, capture_output=True, text=True, timeout=HANG_S)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "sharded == single device" in result.stdout
