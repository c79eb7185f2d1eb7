"""The train loop end to end on the tiny default, shrunk to a couple of steps, for each method.

In this process, so the runs share compiled programs; launch/train.py itself runs in
tests/train/test_presets_train.py and tests/runs/test_checkpoint.py."""

from __future__ import annotations

import json
import os

import jax
import numpy as np
import pytest
from conftest import WALL_CLOCK, assert_same_checkpoint_state, restored_on_one_device, small_train_config

from comppo_jax import sharding
from comppo_jax.credit import load_position_schedule
from comppo_jax.eval.held_out import held_out_diagnostics
from comppo_jax.eval.restore import restore_policy
from comppo_jax.runs.checkpoint import RunCheckpoints
from comppo_jax.runs.outputs import AGAINST_THE_OUTCOME
from comppo_jax.runs.samples import load_samples
from comppo_jax.train.loop import bar_label, step_postfix, train
from comppo_jax.train.schema import load_run_config


@pytest.mark.slow
# GRPO takes the sampler's log-probs, so it runs no behaviour pass and has no gate to log.
@pytest.mark.parametrize("method,warmup_counts", [("comppo", False), ("grpo", False), ("ppo", False), ("ppo", True)])
def test_train_runs_each_method(tmp_path, capsys, method, warmup_counts):
    progress = method == "comppo"
    old_log_probs = "sampler" if method == "grpo" else "rescore"
    summary = train(
        small_train_config(
            tmp_path,
            method=method,
            plot=True,
            progress=progress,
            train__critic_warmup_counts_toward_steps=warmup_counts,
            rollout__old_log_probs=old_log_probs,
        )
    )
    if progress:  # every long phase shows itself: warm start, evaluations, first compiles, steps
        out, err = capsys.readouterr()
        assert "warm start: 100%" in err and "loss=" in err and "dev eval" in err
        assert "comppo: 1 critic warm-up + 2 actor updates: 100%" in err
        assert [line for line in out.splitlines() if line.startswith("compiling ")] == [
            "compiling the warm start...",
            "compiling the dev evaluation...",
            "compiling the sampler...",
            "compiling the scoring pass and credit...",
            "compiling the critic update...",
            "compiling the actor update...",
        ]
    assert summary == json.loads((tmp_path / "summary.json").read_text())
    assert summary["method"] == method and 0.0 <= summary["final_dev_accuracy"] <= 1.0
    steps = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    # The critic warm-up (1 step) comes on top of the 2 actor updates unless it counts toward them.
    warmup = 0 if method == "grpo" else 1
    total = 2 if warmup_counts else 2 + warmup
    assert [s["step"] for s in steps] == list(range(1, total + 1))  # step N: the N-th step, checkpoint N after it
    assert summary["steps"] == total and summary["actor_updates"] == total - warmup == sum(
        "policy_loss" in s for s in steps
    )
    # Evaluations (every step here) count actor updates: a prepended warm-up step is not evaluated.
    prepended = total - 2
    assert [s["step"] for s in steps if "dev_accuracy" in s] == list(range(prepended + 1, total + 1))
    assert [s["actor_updates"] for s in steps] == [max(0, step - warmup) for step in range(1, total + 1)]
    # One numbering: checkpoint N is step N's row, and the best checkpoint is the best evaluated row.
    assert total in {int(name) for name in os.listdir(tmp_path / "checkpoints")} <= {s["step"] for s in steps}
    best_row = next(s for s in steps if s["step"] == summary["best_checkpoint_step"])
    assert best_row["dev_accuracy"] == max(s["dev_accuracy"] for s in steps if "dev_accuracy" in s)
    assert ("value_loss" in steps[1]) == (method != "grpo")
    assert "policy_loss" in steps[1] and ("policy_loss" in steps[0]) == (method == "grpo")  # critic warm-up
    assert {"entropy", "clip_fraction", "kl_loss"} <= set(steps[1])
    gated = {"gate/mean", "gate/iqr", "gate/first_third", "gate/last_third"}
    assert gated <= set(steps[1]) if method != "grpo" else not gated & set(steps[1])
    if method != "grpo":
        assert {"critic/value_mae", "critic/clamp_saturation"} <= set(steps[1])
    # How far back a final reward reaches, every step and every method. The fields measured against the
    # outcome need outcomes that differ (here every response is wrong): tests/launch/test_local_cluster.py.
    assert all(s["credit/trace_horizon"] >= 1 for s in steps)
    assert (tmp_path / "curves.png").stat().st_size > 0
    # Responses kept with their credit at each evaluation (outputs.sample_every=0), as the method has it.
    records, unreadable = load_samples(str(tmp_path))
    assert [r["step"] for r in records] == [s["step"] for s in steps if "dev_accuracy" in s] and not unreadable
    credit = {"grpo"} if method == "grpo" else {"kappa", "H", "n", "c", "value", "comp_gae", "gae"}
    assert set(records[0]["responses"][0]["tokens"]) == credit and records[0]["method"] == method
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(tmp_path / "tensorboard"))
    if method == "grpo":
        assert not (tmp_path / "gate_profile.json").exists() and "mean_gate" not in summary
        # The held-out diagnostics still measure the run's gate: they run the behaviour pass.
        config = small_train_config(tmp_path, method=method, rollout__old_log_probs=old_log_probs)
        held_out = held_out_diagnostics(config, RunCheckpoints(str(tmp_path), read_only=True), problems=2)
        assert {"gate/mean", "gate/iqr"} <= set(held_out) and held_out["problems"] == 2
    else:
        # The run directory alone restores: config.json is the config it ran with.
        config = small_train_config(
            tmp_path,
            method=method,
            plot=True,
            progress=progress,
            train__critic_warmup_counts_toward_steps=warmup_counts,
            rollout__old_log_probs=old_log_probs,
        )
        assert load_run_config(str(tmp_path)).to_dict() == config.to_dict()
        restored = restore_policy(str(tmp_path), "best")
        assert restored.step == summary["best_checkpoint_step"] and restored.cfg.to_dict() == config.to_dict()
        profile = load_position_schedule(tmp_path / "gate_profile.json")  # every rollout token's own gate, by t/T
        assert profile.token_counts.sum() == sum(
            s["response_length"] * 4 for s in steps
        )  # 2 prompts x 2 samples per step
        assert summary["mean_gate"] == pytest.approx(
            np.sum(profile.mean_gate * profile.token_counts) / profile.token_counts.sum()
        )

    # Resuming a finished run changes nothing and says so.
    written = {path: path.stat().st_mtime_ns for path in tmp_path.rglob("*") if path.is_file()}
    capsys.readouterr()
    assert (
        train(
            small_train_config(
                tmp_path,
                method=method,
                plot=True,
                resume=True,
                train__critic_warmup_counts_toward_steps=warmup_counts,
                rollout__old_log_probs=old_log_probs,
            )
        )
        == summary
    )
    assert (
        capsys.readouterr().out
        == f"run already complete at step {total}: nothing to do ({tmp_path / 'summary.json'})\n"
    )
    assert {path: path.stat().st_mtime_ns for path in tmp_path.rglob("*") if path.is_file()} == written


@pytest.mark.slow
def test_offloading_idle_state_and_the_critics_epochs_first_change_no_number(tmp_path, monkeypatch):
    """Against a CompPO run as the defaults have it (state resident; the learner runs the critic's epochs
    before the actor's, then frees the critic's features): the run with the epochs interleaved runs the same
    programs in another order, and logs and saves the same numbers, bitwise; the run with its idle state
    offloaded to the host selects each minibatch on the host (another update program: XLA may sum in
    another order), and logs every metric within float32 rounding and saves every weight within 1e-4 of its
    array's largest magnitude (AdamW's moments within 1e-3). Two steps that update the actor and the critic
    from the first (no critic warm-up, whose lone critic step turns rounding-level gradients of TAC's
    relevance weights into whole steps: see test_a_packed_run_matches_the_padded_run)."""
    from comppo_jax.train import learner, specs

    freed, kinds = [], []
    free, to_memory = learner.free_device_arrays, sharding.to_memory
    monkeypatch.setattr(learner, "free_device_arrays", lambda *arrays: freed.append(arrays) or free(*arrays))
    monkeypatch.setattr(sharding, "to_memory", lambda tree, kind: kinds.append(kind) or to_memory(tree, kind))
    rows = {}
    for name, overrides in (("default", {}), ("offloaded", dict(train__offload_idle=True)), ("interleaved", {})):
        if name == "interleaved":
            monkeypatch.setattr(specs, "critic_epochs_first", lambda cfg, made: False)
        config = small_train_config(
            tmp_path / name, method="comppo", steps=2, train__critic_warmup_steps=0, **SHAPED_REWARDS, **overrides
        )
        summary = train(config)
        rows[name] = [{k: v for k, v in row.items() if k not in WALL_CLOCK} for row in _rows(tmp_path / name)]
        rows[name].append({"final_dev_accuracy": summary["final_dev_accuracy"]})
        if name == "default":
            # Each step freed the critic's features and routing, every device copy.
            assert len(freed) == 2 and all(x.is_deleted() for arrays in freed for x in arrays)
            assert all(any(x.ndim == 4 and x.shape[0] == 4 for x in arrays) for arrays in freed)  # TAC's 4 layers
        if name == "offloaded":
            assert {"pinned_host", "device"} <= set(kinds)  # the offloaded run did move state between memories
    assert rows["interleaved"] == rows["default"]
    assert_same_checkpoint_state(tmp_path / "default", tmp_path / "interleaved", 2)
    assert _close_rows(rows["offloaded"], rows["default"]) == []
    errors = largest_relative_errors(*(restored_on_one_device(tmp_path / name, 2) for name in ("offloaded", "default")))
    for leaf, error in errors.items():
        assert error <= (1e-3 if "_opt" in leaf else 1e-4), f"{leaf}: {error:.2e} of its largest magnitude"


@pytest.mark.slow
def test_comppo_composes_with_the_post_paper_variants(tmp_path):
    """One CompPO run with every switch that composes with it: a sink-masked gate statistic refreshed
    per epoch, dynamic sampling, DAPO's decoupled clip and overlong shaping, GSPO's aggregation.
    Each shows in the metrics."""
    summary = train(
        small_train_config(
            tmp_path,
            method="comppo",
            gate_statistic="sink_herfindahl",
            sink_tokens=1,
            gate_refresh="epoch",
            rollout__dynamic_sampling=True,
            rollout__max_refills=2,
            train__clip_high_scale=1.4,
            reward__length_penalty="overlong",
            reward__overlong_buffer=4,
            reward__length_penalty_on="all",
            train__loss_aggregation="seq-mean-token-mean",
        )
    )
    steps = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert "mean_gate" in summary and "kl_loss" in steps[-1]
    for row in steps:
        # Refills stop early only once the batch is full; the dropped groups are whole groups of the rounds drawn.
        rounds, kept = row["dynamic_sampling/refills"] + 1, row["dynamic_sampling/uninformative_kept"]
        assert rounds == 3 or kept == 0
        dropped = row["dynamic_sampling/dropped_fraction"] * 2 * rounds  # 2 prompts a round
        assert dropped == pytest.approx(round(dropped)) and round(dropped) >= kept
    # The actor moved during epoch 0, so its refreshed gate differs from the behaviour policy's.
    updated = [row for row in steps if "policy_loss" in row]
    assert updated and all(row["gate_refresh/mean_abs_change"] > 0 for row in updated)


def _rows(directory) -> list[dict]:
    return [json.loads(line) for line in (directory / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_each_variant_switch_changes_the_metrics_it_must_change(tmp_path):
    """Runs that differ from a base run in one switch only: the first step that the switch can act on
    sees the same samples and, until the switch acts, the same params, so the metric it governs must move.
    PPO (per-token advantages) with a large learning rate, so ratios leave [0.8, 1.2] within a step; the
    3-step warm start answers nothing right, so DAPO's overlong shaping is what makes rewards (and advantages)
    differ."""
    base = dict(method="ppo", train__actor_lr=1e-2, steps=1, train__eval_every=0)  # the warm-up and one update
    shaped = dict(
        reward__length_penalty="overlong",
        reward__overlong_buffer=12,
        reward__length_penalty_on="all",
        reward__length_penalty_schedule="constant",
    )
    runs = {
        "plain": {},
        "shaped": shaped,
        "clip_high": dict(shaped, train__clip_high_scale=5.0),
        "sequence_mean": dict(shaped, train__loss_aggregation="seq-mean-token-mean"),
    }
    rows = {}
    for name, switch in runs.items():
        train(small_train_config(tmp_path / name, **base, **switch))
        rows[name] = _rows(tmp_path / name)
    first_update = 1  # step 2, after the 1-step critic warm-up: the actor's first update
    # No evaluation, yet the last step keeps responses: the run page shows where a short run's credit went.
    assert [record["step"] for record in load_samples(str(tmp_path / "plain"))[0]] == [2]
    # Every response wrong: the outcomes differ by the shaping alone, so the update step logs how far its transport
    # carries a reward and nothing it would measure against the outcome (an EV over the shaping's variance).
    logged = rows["shaped"][first_update]
    assert logged["reward/correct"] == 0
    assert "credit/trace_horizon" in logged and not set(AGAINST_THE_OUTCOME) & logged.keys()
    # Identical sampling at step 1, so the shaping alone lowers the reward: every response pays len / 12.
    assert rows["shaped"][0]["reward/mean"] < rows["plain"][0]["reward/mean"]
    assert rows["sequence_mean"][0]["reward/mean"] == rows["shaped"][0]["reward/mean"]
    # DAPO's higher upper clip clips fewer positive-advantage tokens than the symmetric clip.
    assert rows["clip_high"][first_update]["clip_fraction_high"] < rows["shaped"][first_update]["clip_fraction_high"]
    # The same advantages and ratios, reduced over responses instead of tokens.
    assert rows["sequence_mean"][first_update]["policy_loss"] != pytest.approx(
        rows["shaped"][first_update]["policy_loss"], abs=1e-6
    )
    assert all("kl_loss" in row for row in rows["shaped"][first_update:])


@pytest.mark.slow
def test_the_dynamic_sampling_filter_switch_reaches_the_loop(tmp_path, monkeypatch):
    """Verdicts all wrong, shaped rewards all different (a stand-in verifier): DAPO's accuracy filter
    drops every group (and refills to its cap), the reward filter keeps every group. No KL term: no kl_loss."""
    from comppo_jax.data.rewards import Verdict
    from comppo_jax.rollout import experience

    def all_wrong_and_distinct(texts, golds, lengths, pool, coefficients):
        rewards = np.linspace(-0.5, 0.5, len(texts)).astype(np.float32)
        return rewards, [Verdict.INCORRECT] * len(texts), {"reward/mean": float(rewards.mean())}

    monkeypatch.setattr(experience, "score_responses", all_wrong_and_distinct)
    rows = {}
    for filter_by in ("accuracy", "reward"):
        train(
            small_train_config(
                tmp_path / filter_by,
                method="grpo",
                rollout__dynamic_sampling=True,
                rollout__max_refills=1,
                rollout__dynamic_sampling_filter=filter_by,
                train__kl_coef_grpo=0.0,
                train__eval_every=0,
            )
        )
        rows[filter_by] = _rows(tmp_path / filter_by)
    for row in rows["accuracy"]:
        assert (
            row["dynamic_sampling/dropped_fraction"],
            row["dynamic_sampling/refills"],
            row["dynamic_sampling/uninformative_kept"],
        ) == (1.0, 1.0, 2.0)
    for row in rows["reward"]:
        assert (
            row["dynamic_sampling/dropped_fraction"],
            row["dynamic_sampling/refills"],
            row["dynamic_sampling/uninformative_kept"],
        ) == (0.0, 0.0, 0.0)
    assert not any("kl_loss" in row for row in rows["accuracy"] + rows["reward"])


def test_the_step_bar_shows_the_last_dev_accuracy_measured_or_none():
    metrics = {"reward/mean": 0.5, "kl_loss": 0.001, "gate/mean": 0.6, "phase": 0}
    fields = {"reward": "0.50", "kl": "0.0010", "gate": "0.60", "phase": "0"}
    assert step_postfix(metrics, 0.31) == {**fields, "dev": "0.310"}
    assert "dev" not in step_postfix(metrics, None)  # a resumed run before its first evaluation
    # The bar counts a critic's warm-up steps too (the tiny default's 62 are 2 of them and 60 updates).
    assert bar_label("comppo", 2, 62) == "comppo: 2 critic warm-up + 60 actor updates"
    assert bar_label("grpo", 0, 60) == "grpo"
    # A run with a tool environment (configs/tiny_tools.py): its calls per response.
    assert step_postfix({**metrics, "env/calls": 1.25}, None) == {**fields, "calls": "1.2"}


def largest_relative_errors(a, b) -> dict[str, float]:
    """{leaf path: max |a - b| / max |b|} over two pytrees of the same structure (None: no leaves)."""
    return {
        jax.tree_util.keystr(path): float(np.max(np.abs(np.asarray(x, np.float64) - y), initial=0.0))
        / max(float(np.max(np.abs(y), initial=0.0)), 1e-30)
        for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(a)[0], jax.tree.leaves(b), strict=True)
    }


# The sampler's log-probs against the scorer's (same weights, two programs): float32 rounding itself, of a
# log-prob's size, which two runs whose weights differ by rounding need not share (1e-7 or 5e-7 on one CPU's
# programs, 7e-7 or 5e-7 on another's).
MISMATCH_ATOL = 1e-5


def _close_rows(rows: list[dict], against: list[dict], rtol: float = 1e-5) -> list[str]:
    """Where one run's metrics rows leave another's (numbers within `rtol` relative, 1e-7 absolute, the sampler
    mismatch within MISMATCH_ATOL; everything else equal); the packing metrics and wall-clock fields aside."""
    differences = []
    for step, (a, b) in enumerate(zip(rows, against, strict=True)):
        names = (set(a) | set(b)) - set(WALL_CLOCK) - {name for name in a if name.startswith("packing/")}
        for name in sorted(names):
            x, y = a.get(name), b.get(name)
            if isinstance(x, float) and isinstance(y, float):
                atol = MISMATCH_ATOL if name.startswith("mismatch/") else 1e-7
                if not np.isclose(x, y, rtol=rtol, atol=atol):
                    differences.append(f"step row {step} {name}: {x} against {y}")
            elif x != y:
                differences.append(f"step row {step} {name}: {x!r} against {y!r}")
    return differences


# DAPO's overlong shaping: a 3-step warm start answers nothing right, and without it every reward is 0, the
# advantages 0 and the gradient rounding noise (test_each_variant_switch_changes_the_metrics_it_must_change).
SHAPED_REWARDS = dict(
    reward__length_penalty="overlong",
    reward__overlong_buffer=12,
    reward__length_penalty_on="all",
    reward__length_penalty_schedule="constant",
)


@pytest.mark.slow
@pytest.mark.parametrize(
    "method,overrides",
    [("ppo", {}), ("ppo", {"critic__kind": "full"}), ("comppo", {"model__lora__rank": 4})],
    ids=["ppo-standard-critic", "ppo-full-critic", "comppo-lora"],
)
def test_a_packed_run_matches_the_padded_run(tmp_path, method, overrides):
    """train.packing (the default) against train.packing=False, over one step that updates the critic and the
    actor from the same weights (no critic warm-up). A full actor with each critic kind (PPO's, whose actor
    weights are held to 1e-5), CompPO's gate and TAC on packed rows with LoRA adapters on the actor (a full-actor
    CompPO run adds no code path the other two miss): every metric within float32 rounding (1e-5 relative), the
    packing efficiencies logged, the actor's weights within 1e-5 of each array's largest magnitude and the
    critic's within 1e-4 (GRPO's loss and gradients are compared in tests/train/test_packed_update.py: here its
    advantages are 0, every response running to the limit, and its gradient rounding noise).
    AdamW scales a gradient at rounding level to a whole step of its learning rate: LoRA's B, zero at the start,
    shows its rounding at that size (the adapters within 2e-3: 1.0e-3 on one CPU's programs). A second step would
    compound it into the metrics (a critic warm-up step moves TAC's relevance and routing weights so, and the next
    step's critic gradient norm by half, with XLA:CPU's elemental emitters), as any change of summation order
    would."""
    rows = {}
    for packing in (True, False):
        # Its short responses fill their rows: packing saves no row (train.packing_min_saving would keep
        # every batch unpacked), and it packs them all the same.
        cfg = small_train_config(
            tmp_path / str(packing),
            method=method,
            steps=1,
            train__critic_warmup_steps=0,
            train__packing=packing,
            train__packing_min_saving=0.0,
            **SHAPED_REWARDS,
            **overrides,
        )
        train(cfg)
        rows[packing] = _rows(tmp_path / str(packing))
    assert _close_rows(rows[True], rows[False]) == []
    assert any(row.get("policy_loss") for row in rows[True])  # a real gradient, not rounding noise
    assert all(0 < row["packing/update_efficiency"] <= 1 for row in rows[True] if "packing/update_efficiency" in row)
    assert all(0 < row["packing/scoring_efficiency"] <= 1 for row in rows[True])
    assert not any(name.startswith("packing/") for row in rows[False] for name in row)
    last = rows[True][-1]["step"]
    packed, padded = (restored_on_one_device(tmp_path / str(p), last) for p in (True, False))
    for part, tolerance in (("actor", 2e-3 if "model__lora__rank" in overrides else 1e-5), ("critic", 1e-4)):
        for leaf, error in largest_relative_errors(packed.get(part), padded.get(part)).items():
            assert error <= tolerance, f"{part}{leaf}: {error:.2e} of its largest magnitude"
