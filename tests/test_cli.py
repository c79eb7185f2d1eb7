"""How the launch/ entry points start: --help, and one error line for a config that does not load."""

from __future__ import annotations

import os
import re

import pytest
from conftest import REPO, launch_quick

from comppo_jax.cli import _config_rows, _override_problem, with_run_config
from comppo_jax.eval.experiment import FIELD_HELP as EXPERIMENT_HELP
from comppo_jax.models import load_config_file
from comppo_jax.models.loading import PRESET_DIR
from comppo_jax.train.schema import FIELD_HELP


@pytest.mark.parametrize("preset", ["tiny.py", "qwen3_4b.py", "llama3_8b.py"])
def test_every_field_of_each_preset_has_a_description(preset):
    rows = _config_rows(load_config_file(os.path.join(REPO, "configs", preset)), FIELD_HELP)
    undescribed = [name for fields in rows.values() for name, _, description in fields if not description]
    assert not undescribed and len(rows) == 15  # 14 sections and the top level


def test_help_exits_0_and_lists_the_loaded_configs_fields():
    result = launch_quick("launch/train.py", "--config=configs/qwen3_4b.py", "--help")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("Train with CompPO, GRPO or PPO")
    assert (
        "--config fields (from configs/qwen3_4b.py, with the overrides given)" in result.stdout
        and "\n[rollout]\n" in result.stdout
    )
    line = next(line for line in result.stdout.splitlines() if "--config.rollout.max_new_tokens=" in line)
    assert re.fullmatch(r"\s+--config\.rollout\.max_new_tokens=16384\s+longest response", line), line
    # method, steps, seed and output_dir come before the sections (not after eval, alphabetically)
    fields = result.stdout.split("--config fields", 1)[1].splitlines()
    assert fields[2] == "[top level]", fields[:3]
    assert any(line.startswith("  --config.method=") for line in fields[:20]), fields[:20]

    # A field whose "auto" stands for another value says which, with the command line's overrides applied.
    line = next(line for line in result.stdout.splitlines() if "--config.train.loss_aggregation=" in line)
    assert "'auto'" in line and "[here: token-mean]" in line, line
    gspo = launch_quick("launch/train.py", "--config.method=grpo", "--config.train.policy_loss=gspo", "--help")
    assert gspo.returncode == 0, gspo.stderr
    assert "--config.train.policy_loss='gspo'" in gspo.stdout and "[here: seq-mean-token-mean]" in gspo.stdout

    experiment = launch_quick("launch/experiment.py", "--experiment=configs/experiments.py:main", "--help")
    assert experiment.returncode == 0, experiment.stderr
    for name, description in EXPERIMENT_HELP.items():
        assert f"--experiment.{name}=" in experiment.stdout and description in experiment.stdout


def test_a_run_named_without_a_config_brings_its_own_config_first():
    own = f"--config={PRESET_DIR / 'run.py'}:runs/a"
    assert with_run_config(["eval.py", "--checkpoint=runs/a", "--config.eval.samples=2"], "checkpoint") == [
        "eval.py",
        own,
        "--checkpoint=runs/a",
        "--config.eval.samples=2",
    ]
    assert with_run_config(["eval.py", "--config.eval.samples=2", "--checkpoint", "runs/a"], "checkpoint")[1] == own
    for given in (
        ["eval.py", "--config=configs/tiny.py", "--checkpoint=runs/a"],
        ["eval.py", "--config", "x.py", "--checkpoint=runs/a"],
        ["eval.py", "--step=best"],
    ):
        assert with_run_config(given, "checkpoint") == given


# {case: (launch/train.py's arguments, the one error line)}; {tmp} is the directory the test writes CONFIG_FILES to.
CONFIG_CASES = {
    "missing file": (
        ["--config=configs/tiy.py"],
        "ConfigFileError: configs/tiy.py does not exist (--config=configs/tiy.py)",
    ),
    "missing file with an override": (
        ["--config", "configs/tiy.py", "--config.steps=3"],
        "ConfigFileError: configs/tiy.py does not exist (--config=configs/tiy.py)",
    ),
    "syntax error": (
        ["--config={tmp}/unclosed.py"],
        "ConfigFileError: {tmp}/unclosed.py line 2: SyntaxError: '(' was never closed",
    ),
    "no get_config": (
        ["--config={tmp}/no_get_config.py", "--config.steps=3"],
        "ConfigFileError: {tmp}/no_get_config.py has no get_config()",
    ),
    "get_config raises": (
        ["--config={tmp}/presets.py:big"],
        "ConfigFileError: {tmp}/presets.py line 4: ValueError: no preset 'big'",
    ),
    # ml_collections defers an OSError loading a config to the config's first use.
    "get_config raises an OSError": (
        ["--config={tmp}/presets.py:file"],
        "ConfigFileError: {tmp}/presets.py line 3: FileNotFoundError: file.json does not exist",
    ),
    # Without --config the default loads, with the overrides, where launch/train.py defines the flag.
    "unknown field of the default": (
        ["--config.stepz=5"],
        "ConfigFileError: --config.stepz=5: configs/tiny.py has no field stepz; "
        "did you mean steps or warm_start.steps?",
    ),
    "unknown nested field": (
        ["--config=configs/tiny.py", "--config.rollout.max_new_token=8"],
        "ConfigFileError: --config.rollout.max_new_token=8: configs/tiny.py has no field rollout.max_new_token; "
        "did you mean rollout.max_new_tokens or rollout.max_reply_tokens?",
    ),
    "value of the wrong type": (
        ["--config.steps=abc"],
        "ConfigFileError: --config.steps=abc: expected int (configs/tiny.py has steps=60)",
    ),
    "warm start on DAPO-Math": (
        ["--config.data.kind=dapo_math", "--config.data.path={tmp}/dapo.jsonl", "--config.output_dir={tmp}/run"],
        "ConfigError: config.warm_start.steps=1000: the supervised warm start trains on worked solutions and "
        "data.kind='dapo_math' has none; pass --config.warm_start.steps=0 (or --config.data.kind=synthetic)",
    ),
}
CONFIG_FILES = {
    "unclosed.py": "def get_config():\n    return dict(steps=(1\n",
    "no_get_config.py": "STEPS = 1\n",
    "presets.py": "def get_config(name):\n    if name == 'file':\n"
    "        raise FileNotFoundError('file.json does not exist')\n"
    "    raise ValueError(f'no preset {name!r}')\n",
    "dapo.jsonl": '{"prompt": "What is 1 + 1?", "reward_model": {"ground_truth": "2"}}\n',
}


@pytest.mark.parametrize("case", CONFIG_CASES)
def test_a_config_that_does_not_load_is_one_line_naming_the_file_and_field(tmp_path, case):
    for name, text in CONFIG_FILES.items():
        (tmp_path / name).write_text(text)
    arguments, line = CONFIG_CASES[case]
    result = launch_quick("launch/train.py", *(argument.format(tmp=tmp_path) for argument in arguments))
    assert result.returncode == 1, result.stderr
    assert result.stderr.splitlines() == [
        f"error: {line.format(tmp=tmp_path)}",
        "(--verbosity=1 shows the traceback)",
    ], result.stderr


def test_a_misspelt_field_suggests_the_close_fields_of_every_section(monkeypatch):
    """A name close to fields of other sections (or to a field's `lr`, read as learning_rate) lists them."""
    monkeypatch.chdir(REPO)
    problem = _override_problem("config", "configs/tiny.py", ["train.py", "--config.train.lerning_rate=0.1"])
    assert str(problem) == (
        "--config.train.lerning_rate=0.1: configs/tiny.py has no field train.lerning_rate; "
        "did you mean warm_start.learning_rate, train.actor_lr or train.critic_lr?"
    )


def test_a_config_error_with_verbosity_shows_the_traceback():
    result = launch_quick("launch/train.py", "--config.stepz=5", "--verbosity=1")
    assert result.returncode == 1 and "Traceback" in result.stderr and 'Did you mean "steps"' in result.stderr


def test_an_override_of_a_parameterised_config_file_is_checked_against_its_fields():
    """`file.py:arg` passes arg to get_config: the fields named are that config's."""
    result = launch_quick("launch/experiment.py", "--experiment=configs/experiments.py:main", "--experiment.seed=1")
    assert result.returncode == 1 and result.stderr.splitlines()[0] == (
        "error: ConfigFileError: --experiment.seed=1: configs/experiments.py:main has no field seed; "
        "did you mean seeds?"
    ), result.stderr


def test_help_with_a_config_that_does_not_load_fails_in_one_line():
    result = launch_quick("launch/train.py", "--config=configs/tiy.py", "--help")
    assert result.returncode == 1 and result.stderr.splitlines() == [
        "error: ConfigFileError: configs/tiy.py does not exist (--config=configs/tiy.py)",
        "(--verbosity=1 shows the traceback)",
    ], result.stderr
