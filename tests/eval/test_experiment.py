"""Experiment planning (arms, grids, screens, references, shared runs) and the report tables."""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import re
import shlex
import sys

import numpy as np
import pytest

from comppo_jax.eval import experiment as ex
from comppo_jax.eval.report import (
    FACTORIAL_CELLS,
    comparison_report,
    factorial_report,
    main_report,
    regime_report,
    stress_report,
)
from comppo_jax.eval.statistics import factorial_interaction
from comppo_jax.train.validation import validate_config
from configs import experiments, experiments_credit, experiments_decision, experiments_tiny, experiments_tools


def test_grid_cells_and_stress_expansion():
    assert ex.grid_cells(("a.lr=1,2", "kl=0,5")) == [
        ("a.lr=1", "kl=0"),
        ("a.lr=1", "kl=5"),
        ("a.lr=2", "kl=0"),
        ("a.lr=2", "kl=5"),
    ]
    stress = experiments.get_config("stress")
    arms = ex.arms_of(stress)
    assert len(arms) == 12 and arms[0][0] == "ppo[actor_lr=2e-7,kl_coef=0]"
    assert "controller.enabled=False" in arms[0][1] and arms[0][1][-2:] == ("train.actor_lr=2e-7", "train.kl_coef=0")


def test_screen_plans_one_run_per_cell_at_the_screen_seed():
    main = experiments.get_config("main")
    screens = ex.screen_runs(main)
    assert sorted(screens) == ["comppo", "grpo"] and all(len(runs) == 9 for runs in screens.values())
    assert {run.seed for runs in screens.values() for run in runs} == {42}
    assert ex.arms_of(main) == [
        ("comppo", ex.arms_of(main)[0][1]),
        ("grpo", ("method=grpo",) + experiments.MATCHED_BUDGET),
    ]


@pytest.mark.parametrize("name", ["main", "factorial", "controls", "stress", "group", "statistics", "variants"])
def test_every_arm_has_a_matched_actor_update_budget(name):
    for definitions in (experiments, experiments_tiny):
        assert all(
            "train.critic_warmup_counts_toward_steps=False" in overrides
            for _, overrides in ex.arms_of(definitions.get_config(name))
        )


def _overridden(base_config: str, overrides) -> object:
    """`base_config` with "key=value" overrides typed as the fields they replace (launch/train.py's flags)."""
    spec = importlib.util.spec_from_file_location("base_config", base_config)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cfg = module.get_config()
    for override in overrides:
        key, value = override.split("=", 1)
        *parents, name = key.split(".")
        node = cfg
        for parent in parents:
            node = node[parent]
        current = node[name]
        typed = {bool: lambda v: v == "True", int: int, float: float}.get(type(current), str)
        node[name] = typed(value)
    return cfg


EXPERIMENT_NAMES = {
    experiments: ("main", "factorial", "controls", "stress", "group", "statistics", "variants", "lora", "baselines"),
    experiments_tiny: ("main", "factorial", "controls", "stress", "group", "statistics", "variants", "lora"),
    experiments_credit: (
        "discrimination",
        "baselines",
        "factorial",
        "controls",
        "lora",
        "transport",
        "outcome",
        "probes",
    ),
    experiments_tools: ("tools",),
    experiments_decision: ("regime", "comparison", "factorial", "controls"),
}


@pytest.mark.parametrize(
    "definitions, name",
    [(definitions, name) for definitions, names in EXPERIMENT_NAMES.items() for name in names],
    ids=lambda x: x if isinstance(x, str) else x.__name__.split(".")[-1],
)
def test_every_arm_of_every_experiment_is_a_valid_config(definitions, name):
    exp = definitions.get_config(name)
    for _, overrides in ex.arms_of(exp):
        if any("{gate_profile:" in o for o in overrides):  # a file another run writes
            continue
        overrides = tuple(re.sub(r"\{mean_gate:\w+\}", "0.6", o) for o in overrides)
        cfg = _overridden(exp.base_config, tuple(exp.overrides) + overrides)
        if cfg.model.path_required:  # the paper-scale presets need the user's model.path and data.path
            cfg.model.path_required = False
            cfg.data.update(kind="synthetic", train_size=8, dev_size=4, min_steps=1, max_steps=2, operations="+")
        validate_config(cfg)


def run_keys(definitions, name: str, arm: str) -> set[str]:
    """The run keys (directories) of experiment `name`'s arm `arm`, one per seed."""
    exp = definitions.get_config(name)
    return {
        ex.Run(arm, seed, exp.base_config, overrides + (f"seed={seed}",)).key
        for label, overrides in ex.arms_of(exp)
        if label == arm
        for seed in exp.seeds
    }


def test_the_credit_testbed_runs_each_shared_arm_once():
    """The baselines' GRPO and PPO are the discrimination runs, and full CompPO one set of runs for the
    baselines, factorial, controls, lora and transport: DAPO's overlong buffer rides on the DAPO arms alone."""
    runs = lambda name, arm: run_keys(experiments_credit, name, arm)
    for arm in ("grpo", "ppo"):
        assert runs("baselines", arm) == runs("discrimination", arm) and len(runs("baselines", arm)) == 5
    full = runs("factorial", "full")
    assert runs("baselines", "comppo") == runs("controls", "full") == runs("lora", "comppo") == full
    assert runs("transport", "comppo") == full and not runs("transport", "kappa_1_lam_1") & full
    dapo = experiments_credit.get_config("baselines")
    assert all(("reward.overlong_buffer=16" in o) == ("dapo" in arm) for arm, o in ex.arms_of(dapo))


def test_the_decision_testbed_shares_its_runs_and_only_its_critic_probe_skips_the_actor():
    """PPO is one set of runs for the regime and the comparison, full CompPO one for the comparison, factorial
    and controls; every arm makes 40 actor updates but the regime's probes, whose critics train alone for 30
    steps."""
    keys = lambda name, arm: run_keys(experiments_decision, name, arm)
    assert keys("regime", "ppo") == keys("comparison", "ppo") and len(keys("regime", "ppo")) == 5
    assert keys("comparison", "comppo") == keys("factorial", "full") == keys("controls", "full")
    for name in ("regime", "comparison", "factorial", "controls"):
        exp = experiments_decision.get_config(name)
        for arm, overrides in ex.arms_of(exp):
            cfg = _overridden(exp.base_config, [o for o in overrides if "{" not in o])
            probe = name == "regime" and arm != "ppo"
            assert (cfg.steps, cfg.train.critic_warmup_steps) == ((1, 30) if probe else (40, 2)), arm
            assert cfg.steps % cfg.train.eval_every == 0, arm  # its last update is evaluated: a result to load


def test_the_regime_report_reads_each_critic_on_the_warm_start_and_each_learner_against_it(tmp_path):
    """The probe's reading is the mean of its last 5 warm-up steps (actor_updates 0); a learner's gain is its
    Final less its own seed's warm start, seed-matched."""
    exp = experiments_decision.get_config("regime")
    arms = {
        "standard_critic": {
            s: _result(tmp_path, "standard_critic", s, [0.3], base=0.3, actor_updates=1) for s in (0, 1, 2)
        },
        "ppo": {
            s: _result(tmp_path, "ppo", s, [0.4, 0.3 + 0.1 * s], base=0.2 + 0.1 * s, actor_updates=40)
            for s in (0, 1, 2)
        },
    }
    for seed, result in arms["standard_critic"].items():
        rows = [
            {
                "step": step,
                "actor_updates": 0,
                "credit/outcome_explained_variance": 9.0 if step <= 15 else 0.5 + 0.1 * seed,
            }
            for step in range(1, 21)
        ] + [{"step": 21, "actor_updates": 1, "credit/outcome_explained_variance": -9.0}]
        (pathlib.Path(result.directory) / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for result in arms["ppo"].values():  # two warm-up steps: too few for a reading
        rows = [{"step": step, "actor_updates": 0, "credit/outcome_explained_variance": 0.9} for step in (1, 2)]
        (pathlib.Path(result.directory) / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    text, _ = regime_report(exp, ex.Outcome(arms, {}, {}, {}, []))
    assert "| standard_critic | 0.60 [0.35, 0.85] | -- | -- | -- |" in text and "| ppo | 0." not in text
    assert "| 2 | 0.70 |" in text
    # Final - warm start is +10 points at every seed (Best: +20, +10, +10); a probe (one actor update) is no learner.
    assert "| ppo | 30.0 [5.2, 54.8] | 40.0 [15.2, 64.8] | +10.0 [+10.0, +10.0] | +13.3 [-1.0, +27.7] |" in text
    assert "| standard_critic | 30.0" not in text


def test_the_tool_runs_twin_is_the_same_warm_start_without_its_environment():
    exp = experiments_tools.get_config("tools")
    configs = {arm: _overridden(exp.base_config, tuple(exp.overrides) + o) for arm, o in ex.arms_of(exp)}
    assert configs["tool_free"].rollout.environment == "" and configs["tools_pass"].rollout.environment == "calculator"
    assert {c.credit.env_crossing for arm, c in configs.items() if arm != "tool_free"} == {"pass", "transition"}
    assert configs["grpo_tools"].method == "grpo" and configs["grpo_tools"].rollout.environment == "calculator"
    assert configs["grpo_tool_free"].method == "grpo" and configs["grpo_tool_free"].rollout.environment == ""
    assert configs["ppo_tools"].method == "ppo" and configs["ppo_tools"].rollout.environment == "calculator"
    untransported = configs["kappa_1_lam_1"]
    assert (untransported.gate, untransported.fixed_gate, untransported.train.lam) == ("fixed", 1.0, 1.0)
    assert len({json.dumps(c.warm_start.to_dict(), sort_keys=True) for c in configs.values()}) == 1


def test_identical_runs_share_a_directory_whatever_the_arm_or_order():
    a = ex.Run("full", 0, "configs/tiny.py", ("method=comppo", "seed=0"))
    b = ex.Run("comppo", 0, "configs/tiny.py", ("seed=0", "method=comppo"))
    assert a.directory("root") == b.directory("root")
    assert ex.Run("full", 1, "configs/tiny.py", ("method=comppo", "seed=1")).key != a.key


def _result(tmp_path, arm, seed, accuracies, base=0.5, **summary):
    run = ex.Run(arm, seed, "configs/tiny.py", (f"arm={arm}", f"seed={seed}"))
    directory = tmp_path / run.key
    directory.mkdir(exist_ok=True)
    return ex.RunResult(
        run,
        str(directory),
        {"warm_start_dev_accuracy": base, **summary},
        np.arange(1, len(accuracies) + 1) * 5.0,
        np.asarray(accuracies, float),
        {},
    )


def test_references_resolve_to_the_mean_gate_and_the_same_seeds_profile(tmp_path):
    done = {
        "full": {
            0: _result(tmp_path, "full", 0, [0.6], mean_gate=0.5),
            1: _result(tmp_path, "full", 1, [0.6], mean_gate=0.7),
        }
    }
    resolved = ex.resolve(("fixed_gate={mean_gate:full}", "position_schedule={gate_profile:full}"), 1, done)
    assert float(resolved[0].split("=")[1]) == pytest.approx(0.6)
    # Kept free of the root, so that a run's identity is the same wherever its root is; its command gets the path.
    key = done["full"][1].run.key
    assert resolved[1] == f"position_schedule={{root}}/runs/{key}/gate_profile.json"
    run = ex.Run("position", 1, "configs/tiny.py", resolved)
    assert f"--config.position_schedule={tmp_path}/runs/{key}/gate_profile.json" in run.command(str(tmp_path))
    with pytest.raises(ValueError, match="no finished run for seed 2"):
        ex.resolve(("position_schedule={gate_profile:full}",), 2, done)
    with pytest.raises(ValueError, match="arm 'other'"):
        ex.resolve(("fixed_gate={mean_gate:other}",), 0, done)
    done["grpo"] = {0: _result(tmp_path, "grpo", 0, [0.6])}  # rollout.old_log_probs=sampler: no gate logged
    for reference in ("fixed_gate={mean_gate:grpo}", "position_schedule={gate_profile:grpo}"):
        with pytest.raises(ValueError, match=r"arm 'grpo'.s runs \[.*\] logged no gate \(no behaviour pass\)"):
            ex.resolve((reference,), 0, done)
    assert ex.references(("a={mean_gate:full}", "b=1")) == [("mean_gate", "full")]


def test_screen_selects_best_final_then_best(tmp_path):
    results = [
        _result(tmp_path, "a", 0, [0.9, 0.6]),
        _result(tmp_path, "b", 0, [0.5, 0.7]),
        _result(tmp_path, "c", 0, [0.8, 0.7]),
    ]
    assert ex.select(results).run.arm == "c"


def test_load_result_reads_the_curve_and_refuses_a_run_without_evaluations(tmp_path):
    run = ex.Run("x", 0, "configs/tiny.py", ("seed=0",))
    directory = run.directory(str(tmp_path))
    assert ex.load_result(run, str(tmp_path)) is None
    os.makedirs(directory)
    with open(os.path.join(directory, "summary.json"), "w") as f:
        json.dump({"warm_start_dev_accuracy": 0.5, "final_dev_accuracy": 0.7}, f)
    with open(os.path.join(directory, "metrics.jsonl"), "w") as f:
        rows = [
            {"step": 6, "actor_updates": 5, "dev_accuracy": 0.6},
            {"step": 7, "actor_updates": 6},
            {"step": 11, "actor_updates": 10, "dev_accuracy": 0.7},
        ]
        f.write("".join(json.dumps(row) + "\n" for row in rows))
    result = ex.load_result(run, str(tmp_path))
    assert result.steps.tolist() == [5.0, 10.0] and result.accuracies.tolist() == [0.6, 0.7] and result.held_out == {}
    with open(os.path.join(directory, "metrics.jsonl"), "w") as f:
        f.write(json.dumps({"step": 0}) + "\n")
    with pytest.raises(ValueError, match="no dev_accuracy rows"):
        ex.load_result(run, str(tmp_path))


def test_a_torn_summary_leaves_its_run_unfinished_for_the_resume_to_rewrite(tmp_path, capsys):
    run = ex.Run("x", 0, "configs/tiny.py", ("seed=0",))
    os.makedirs(run.directory(str(tmp_path)))
    with open(os.path.join(run.directory(str(tmp_path)), "summary.json"), "w") as f:
        f.write('{"final_dev_accuracy": 0.')  # a crash mid-write
    results, failures, unfinished = ex.execute(
        [run], str(tmp_path), jobs=1, held_out_problems=0, train=False, children=ex.Children(), log=print
    )
    assert not results and not failures and unfinished[run].startswith("no checkpoint yet")
    assert "summary.json cannot be read" in capsys.readouterr().err


def test_factorial_report_interaction_matches_the_statistics(tmp_path):
    exp = experiments_tiny.get_config("factorial")
    finals = {
        "full": [0.9, 0.8, 0.85],
        "gate_std": [0.7, 0.7, 0.75],
        "fixed_aligned": [0.75, 0.7, 0.7],
        "fixed_std": [0.6, 0.65, 0.6],
    }
    arms = {
        arm: {s: _result(tmp_path, arm, s, [0.5, 0.6, 0.7, v]) for s, v in enumerate(values)}
        for arm, values in finals.items()
    }
    outcome = ex.Outcome(arms, {}, {}, {}, [])
    assert "Credit against the outcome" not in factorial_report(exp, outcome)[0]  # records older than the metric
    for arm, runs in arms.items():  # each cell's critic reads 0.1 x its index over its last steps, at every seed
        index = [a for a, _ in FACTORIAL_CELLS].index(arm)
        logged = {"credit/outcome_explained_variance": 0.1 * index, "critic/td_spearman": 0.2 * index}
        for result in runs.values():
            rows = [
                {"step": 1, "credit/outcome_explained_variance": 9.0},
                *({"step": s, **logged} for s in range(2, 13)),
            ]
            (pathlib.Path(result.directory) / "metrics.jsonl").write_text(
                "".join(json.dumps(row) + "\n" for row in rows)
            )
    text, plots = factorial_report(exp, outcome)
    # The credit table labels each cell as the factorial's tables do; step 1 is outside the last 10 steps' window.
    assert "| Full CompPO | 0.30 | -- | -- | -- | -- | 0.60 | -- |" in text
    assert "| Fixed gate + standard critic | 0.00 |" in text
    interaction = factorial_interaction(
        finals["full"], finals["gate_std"], finals["fixed_aligned"], finals["fixed_std"]
    )
    expected = f"{100 * interaction.mean:+.1f} [{100 * interaction.low:+.1f}, {100 * interaction.high:+.1f}]"
    assert "| Interaction I | " in text and expected in text
    assert "| Full CompPO | 85.0 | 85.0 | 66." in text  # Best, Final, Last-4 = mean of (0.5, 0.6, 0.7, 0.85)
    for name, draw in plots.items():
        draw(str(tmp_path / name))
        assert (tmp_path / name).stat().st_size > 0


def test_main_and_stress_reports(tmp_path):
    exp = experiments_tiny.get_config("main")
    arms = {
        "comppo": {s: _result(tmp_path, "comppo", s, [0.6, 0.8 + 0.01 * s]) for s in range(3)},
        "grpo": {s: _result(tmp_path, "grpo", s, [0.7, 0.75]) for s in range(3)},
    }
    text, _ = main_report(exp, ex.Outcome(arms, {}, {}, {}, []))
    assert "| Final | +6.0 [" in text  # paired comppo - grpo final: 0.81 - 0.75
    stress = experiments_tiny.get_config("stress")
    cells = {
        "ppo[actor_lr=1e-05,kl_coef=0]": {0: _result(tmp_path, "p", 0, [0.9, 0.4, 0.4], base=0.5)},
        "comppo[actor_lr=1e-05,kl_coef=0]": {0: _result(tmp_path, "c", 0, [0.6, 0.7, 0.65], base=0.5)},
    }
    text, _ = stress_report(stress, ex.Outcome(cells, {}, {}, {}, []))
    assert "| ppo | 0/1 |" in text and "| comppo | 1/1 |" in text


def test_an_experiment_under_way_reports_the_arms_that_finished_the_first_arms_seeds(tmp_path):
    exp = experiments_tools.get_config("tools")
    arms = {
        "tools_transition": {s: _result(tmp_path, "t", s, [0.6, 0.7 + 0.01 * s]) for s in range(3)},
        "tool_free": {s: _result(tmp_path, "f", s, [0.5, 0.4]) for s in range(3)},
        "tools_pass": {s: _result(tmp_path, "p", s, [0.6, 0.6]) for s in range(2)},  # seed 2 running
    }
    text, plots = comparison_report(exp, ex.Outcome(arms, {}, {}, {}, []), "tools")
    missing = [arm for arm, _ in exp.arms if arm not in ("tools_transition", "tool_free")]
    assert f"Seeds [0, 1, 2]. Not finished at these seeds, so not in the tables: {', '.join(missing)}." in text
    assert "| tools_transition - tool_free | +21.0 [+18.5, +23.5] | +31.0 [" in text and "tools_pass |" not in text
    assert comparison_report(exp, ex.Outcome({"tool_free": arms["tool_free"]}, {}, {}, {}, []), "tools")[0] == (
        "No seed finished every arm."
    )  # nothing to compare with until the first arm has finished a seed


def test_a_comparison_reports_each_arms_credit_against_the_outcome_from_its_records(tmp_path):
    """Each run's last 10 logged values (of 12 steps here) averaged, then over seeds; "--" for what an arm never
    logged (GRPO: no critic)."""
    exp = experiments_credit.get_config("outcome")
    arms = {arm: {s: _result(tmp_path, arm, s, [0.3, 0.4]) for s in (0, 1)} for arm, _ in exp.arms}
    for index, (arm, runs) in enumerate(arms.items()):
        for seed, result in runs.items():
            rows = []
            for step in range(1, 13):
                row = {"step": step, "credit/early_sign_agreement": 0.5 + 0.1 * seed, "credit/trace_horizon": 2.0}
                if arm != "grpo":  # steps 1-2 fall outside the window
                    row.update({"credit/outcome_explained_variance": 9.0 if step <= 2 else 0.1 * index})
                    row.update({"credit/outcome_spearman": 0.2, "critic/explained_variance": 0.7})
                    row.update({"critic/td_spearman": 0.4, "critic/clamp_saturation": 0.0})
                rows.append(row)
            (pathlib.Path(result.directory) / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    text, _ = comparison_report(exp, ex.Outcome(arms, {}, {}, {}, []), "outcome")
    assert "| ppo_lam_1 | 0.10 | 0.20 | 0.55 | 2.00 | 0.70 | 0.40 | 0.00 |" in text
    assert "| grpo | -- | -- | 0.55 | 2.00 | -- | -- | -- |" in text
    # Records older than the metrics: no table.
    for runs in arms.values():
        for result in runs.values():
            (pathlib.Path(result.directory) / "metrics.jsonl").unlink()
    assert "Credit against the outcome" not in comparison_report(exp, ex.Outcome(arms, {}, {}, {}, []), "outcome")[0]


@pytest.mark.slow
def test_controls_experiment_end_to_end(tmp_path):
    """launch/experiment.py on one seed of tiny 2-step runs: the position-only arm is built from the
    full run's gate profile, held-out diagnostics are computed, and the report, plot, CSV and
    commands are written; a second invocation reruns nothing."""
    from conftest import SMALL_TRAIN_RUN, launch_script

    overrides = tuple(f"{k}={v}" for k, v in SMALL_TRAIN_RUN.items() if k not in ("progress", "plot"))
    command = [
        "launch/experiment.py",
        "--experiment=configs/experiments_tiny.py:controls",
        f"--root={tmp_path}",
        "--experiment.seeds=(0,)",
        f"--experiment.overrides={overrides!r}",
        "--experiment.held_out_problems=2",
    ]
    first = launch_script(*command)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    folder = tmp_path / "controls"
    report = (folder / "report.md").read_text()
    assert "| full - position |" in report and "| full - shuffle |" in report and "Mean / median" in report
    assert (folder / "controls_final.png").stat().st_size > 0
    links = re.findall(r"\]\((\.\./runs/[^)]+/report\.html)\)", report)
    assert len(links) == 3 and all((folder / link).exists() for link in links)  # each run's own page
    commands = (folder / "commands.sh").read_text()
    assert commands.count("launch/train.py") == 3 and "--config.gate=position" in commands
    runs = list((tmp_path / "runs").iterdir())
    position = [r for r in runs if "gate=position" in (r / "run.json").read_text()][0]
    schedule = json.loads((position / "run.json").read_text())["overrides"]
    profile = [o.split("=", 1)[1] for o in schedule if o.startswith("position_schedule=")][0]
    assert profile.startswith("{root}/runs/") and os.path.exists(profile.replace("{root}", str(tmp_path)))
    for run in runs:
        held_out = json.loads((run / "held_out.json").read_text())
        assert {"gate/mean", "gate/median", "critic/value_mae"} <= set(held_out) and held_out["problems"] == 2
    second = launch_script(*command)
    assert second.returncode == 0 and "start " not in second.stdout


@pytest.mark.parametrize("module", [experiments, experiments_tiny])
@pytest.mark.parametrize("name", ["main", "factorial", "controls", "stress", "group", "statistics", "variants"])
def test_every_experiment_plans(module, name):
    from comppo_jax.models import load_config_file

    exp = module.get_config(name)
    assert exp.kind in ex.KINDS and exp.seeds
    arms = ex.arms_of(exp)
    names = {arm for arm, _ in arms}
    for _, overrides in arms:
        assert all(target in names for _, target in ex.references(overrides))
        assert all(ex.parse_override(o) for o in overrides)
    base = load_config_file(exp.base_config)
    cells = [cell for _, axes in exp.grids for cell in ex.grid_cells(axes)]
    for overrides in [o for _, o in arms] + cells:  # every override names a field of the base config
        for key, _ in map(ex.parse_override, overrides):
            section = base
            for part in key.split("."):
                assert part in section, f"{name}: {key} is not a field of {exp.base_config}"
                section = section[part]
    with pytest.raises(ValueError):
        module.get_config("nope")


def test_a_running_command_reports_its_progress_every_interval(tmp_path, monkeypatch):
    monkeypatch.setattr(ex, "PROGRESS_EVERY_S", 0.2)
    (tmp_path / "metrics.jsonl").write_text(
        json.dumps({"step": 3}) + "\n" + json.dumps({"step": 4, "dev_accuracy": 0.5}) + "\n"
    )
    command = [sys.executable, "launch/train.py"]  # only its script name is read by run_progress
    assert ex.run_progress(str(tmp_path), command) == "step 4, dev accuracy 0.500"
    assert ex.run_progress(str(tmp_path / "new"), command) == "warm start, first evaluation or compiling"
    logged = []
    sleeper = [sys.executable, "-c", "import time; time.sleep(1.5); print('done')"]
    with open(tmp_path / "train.log", "w") as out:
        code = ex.Children().run_reporting(sleeper, out, lambda: "step 4", logged.append)
    assert code == 0 and (tmp_path / "train.log").read_text() == f"$ {shlex.join(sleeper)}\ndone\n"
    assert len(logged) >= 3 and all(line.startswith("  step 4 (") for line in logged), logged


@pytest.mark.parametrize("train", [True, False])
def test_a_missing_bucket_is_named_before_any_run_starts(bucket, train, monkeypatch):
    monkeypatch.setattr(ex, "execute", lambda *a, **k: pytest.fail("a run was planned under a missing bucket"))
    root = f"{bucket}-missing/experiments"
    with pytest.raises(FileNotFoundError, match=rf"^{bucket}-missing does not exist \(needed for {root}\): create it"):
        ex.run_experiment(experiments_tiny.get_config("controls"), root, train=train)
