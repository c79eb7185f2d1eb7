"""Config mistakes fail in one pass, naming the field and the fix, before anything is loaded or compiled."""

from __future__ import annotations

import os
import re

import pytest
from conftest import small_train_config

from comppo_jax import hub
from comppo_jax.models import ConfigError
from comppo_jax.train import loop
from comppo_jax.train.validation import PATH_FIELDS, validate_config


@pytest.fixture
def nothing_loads(monkeypatch):
    """train() stops the test if it gets past validation: the tokenizer is the first thing it loads."""

    def reached(*args, **kwargs):
        raise AssertionError("train() got past validation (it loaded the tokenizer)")

    monkeypatch.setattr("comppo_jax.train.start.load_tokenizer", reached)
    monkeypatch.setattr("comppo_jax.train.start.load_policy", reached)


def delete(dotted):
    def edit(config):
        *sections, name = dotted.split(".")
        section = config
        for part in sections:
            section = section[part]
        del section[name]

    return edit


def assign(**values):
    def edit(config):
        for key, value in values.items():
            *sections, name = key.split("__")
            section = config
            for part in sections:
                section = section[part]
            section[name] = value

    return edit


CASES = {
    "method typo": (
        assign(method="compo"),
        r"config\.method='compo': expected one of \('comppo', 'grpo', 'ppo'\); pass --config\.method=comppo",
    ),
    "inverted envelope": (
        assign(gate_envelope__kappa_lo=0.9, gate_envelope__kappa_hi=0.1),
        r"config\.gate_envelope: kappa_lo=0\.9 must be below kappa_hi=0\.1",
    ),
    "checkpoint every 0": (assign(checkpoint__every=0), r"config\.checkpoint\.every=0: must be >= 1"),
    "position gate without schedule": (
        assign(gate="position"),
        r"config\.position_schedule='': gate='position' needs a position schedule",
    ),
    "position schedule missing": (
        assign(gate="position", position_schedule="/nowhere/gate_profile.json"),
        r"config\.position_schedule='/nowhere/gate_profile\.json': does not exist",
    ),
    "no verifier workers": (assign(reward__workers=0), r"config\.reward\.workers=0: must be >= 1"),
    "deleted lam": (delete("train.lam"), r"config\.train\.lam is missing"),
    "negative learning rate": (assign(train__actor_lr=-1e-6), r"config\.train\.actor_lr=-1e-06: must be > 0"),
    "lam above one": (assign(train__lam=1.5), r"config\.train\.lam=1\.5: must be in \(0, 1\]"),
    "negative steps": (assign(steps=-3), r"config\.steps=-3: must be >= 1"),
    "unknown critic": (
        assign(critic__kind="big"),
        r"config\.critic\.kind='big': expected one of \('tac', 'standard', 'full'\)",
    ),
    "unknown attention": (assign(model__attention="flash"), r"config\.model\.attention='flash': expected one of"),
    "unknown remat": (assign(model__remat="some"), r"config\.model\.remat='some': expected one of"),
    "unknown data kind": (
        assign(data__kind="gsm8k"),
        r"config\.data\.kind='gsm8k': expected one of \('synthetic', 'dapo_math'\)",
    ),
    "missing data file": (
        assign(data__kind="dapo_math", data__path="/nowhere/dapo.parquet"),
        r"config\.data\.path='/nowhere/dapo\.parquet': does not exist",
    ),
    "warm start on DAPO-Math": (
        assign(data__kind="dapo_math", data__path=__file__),  # any existing file: it is not read
        r"config\.warm_start\.steps=3: the supervised warm start trains on worked solutions and "
        r"data\.kind='dapo_math' has none; pass --config\.warm_start\.steps=0",
    ),
    "missing model": (assign(model__path="/nowhere/qwen3"), r"config\.model\.path='/nowhere/qwen3': does not exist"),
    "negative LoRA rank": (assign(model__lora__rank=-8), r"config\.model\.lora\.rank=-8: must be >= 0"),
    "zero LoRA alpha": (
        assign(model__lora__rank=8, model__lora__alpha=0.0),
        r"config\.model\.lora\.alpha=0\.0: must be > 0",
    ),
    "unknown LoRA target": (
        assign(model__lora__rank=8, model__lora__targets="q,qkv"),
        r"config\.model\.lora\.targets='q,qkv': expected a comma-separated subset of q, k, v, o, gate, up, down",
    ),
    "minibatch does not divide": (
        assign(train__minibatch_size=3),
        r"config\.train\.minibatch_size=3: must divide the 4 responses per step",
    ),
    "top_p zero": (assign(rollout__top_p=0.0), r"config\.rollout\.top_p=0\.0: must be in \(0, 1\]"),
    "unknown old log-probs": (
        assign(rollout__old_log_probs="stored"),
        r"config\.rollout\.old_log_probs='stored': expected one of \('rescore', 'sampler'\)",
    ),
    "unknown importance-weight rule": (
        assign(train__importance_weight_rule="clamp"),
        r"config\.train\.importance_weight_rule='clamp': expected one of \('mask', 'truncate'\)",
    ),
    "unknown gate statistic": (
        assign(gate_statistic="entropi"),
        r"config\.gate_statistic='entropi': expected one of .*; "
        r"pass --config\.gate_statistic=entropy",
    ),
    "gate statistic without a gate": (
        assign(method="grpo", gate_statistic="entropy"),
        r"config\.gate_statistic='entropy': only CompPO's attention and shuffle gates read the statistic",
    ),
    "gate refresh of a fixed gate": (
        assign(gate="fixed", gate_refresh="epoch"),
        r"config\.gate_refresh='epoch': only CompPO's attention and shuffle gates depend on the actor",
    ),
    "sequence ratio with per-token credit": (
        assign(train__policy_loss="gspo"),
        r"config\.train\.policy_loss='gspo': .* pass --config\.train\.policy_loss=gspo_token",
    ),
    "Dr.GRPO switch without GRPO": (
        assign(method="ppo", train__group_std_normalization=False),
        r"config\.train\.group_std_normalization=False: only GRPO's group-relative advantages",
    ),
    "dynamic sampling of single responses": (
        assign(rollout__dynamic_sampling=True, rollout__samples_per_prompt=1, train__minibatch_size=2),
        r"config\.rollout\.dynamic_sampling=True: a group of one response always has equal rewards",
    ),
    "decoupled clip on a sequence ratio": (
        assign(method="grpo", train__policy_loss="gspo", train__clip_high_scale=1.4),
        r"config\.train\.clip_high_scale=1\.4: scales the per-token ratio's clip; gspo clips",
    ),
    "unknown loss aggregation": (
        assign(train__loss_aggregation="seq-mean"),
        r"config\.train\.loss_aggregation='seq-mean': expected one of",
    ),
    "unknown penalty scope": (
        assign(reward__length_penalty_on="some"),
        r"config\.reward\.length_penalty_on='some': expected one of",
    ),
    "unknown penalty schedule": (
        assign(reward__length_penalty_schedule="ramp"),
        r"config\.reward\.length_penalty_schedule='ramp'",
    ),
    "unknown dynamic-sampling filter": (
        assign(rollout__dynamic_sampling_filter="length"),
        r"config\.rollout\.dynamic_sampling_filter='length': expected one of",
    ),
    "refills below until-full": (assign(rollout__max_refills=-2), r"config\.rollout\.max_refills=-2: must be >= -1"),
    "decode group larger than the devices": (
        assign(rollout__mesh__tensor="2"),
        r"config\.rollout\.mesh\.tensor=2: a decode group must divide the 1 devices",
    ),
    "decode layout not a group size": (
        assign(rollout__mesh__tensor="half"),
        r"config\.rollout\.mesh\.tensor='half': expected auto, train or a positive number",
    ),
    "unknown KL aggregation": (
        assign(train__kl_aggregation="seq"),
        r"config\.train\.kl_aggregation='seq': expected one of",
    ),
    "negative sink tokens": (assign(sink_tokens=-1), r"config\.sink_tokens=-1: must be >= 0"),
    "negative staleness": (assign(rollout__staleness=-1), r"config\.rollout\.staleness=-1: must be >= 0"),
    "unknown proximal policy": (
        assign(train__proximal="current"),
        r"config\.train\.proximal='current': expected one of",
    ),
    "decoupled objective on a sequence ratio": (
        assign(train__proximal="recompute", train__policy_loss="gspo_token"),
        r"config\.train\.proximal='recompute': the decoupled objective weights per-token "
        r"ratios; gspo_token clips a sequence ratio",
    ),
    "entropy token selection on a sequence ratio": (
        assign(method="grpo", train__token_selection="entropy_top", train__policy_loss="gspo"),
        r"config\.train\.token_selection='entropy_top': selects the tokens of the per-token PPO ratio .* gspo's "
        r"ratio is the mean .* pass --config\.train\.policy_loss=ppo or --config\.train\.token_selection=all",
    ),
    "importance weight cap below one": (
        assign(train__importance_weight_cap=0.5),
        r"config\.train\.importance_weight_cap=0\.5: must be >= 1",
    ),
    "unknown rollout correction": (
        assign(train__rollout_correction="is"),
        r"config\.train\.rollout_correction='is': expected one of \('none', 'tis', 'mis'\)",
    ),
    "unknown rollout correction level": (
        assign(train__rollout_correction_level="response"),
        r"config\.train\.rollout_correction_level='response': expected one of \('token', 'sequence', 'geometric'\)",
    ),
    "inverted attention-anchor horizon": (
        assign(method="grpo", credit__estimator="attention_anchor", credit__attention_anchor_horizon_lo=200),
        r"config\.credit\.attention_anchor_horizon_lo=200: the future attention influence averages .* H_hi=100: "
        r"pass --config\.credit\.attention_anchor_horizon_lo=<at most 100>",
    ),
    "negative ktae weight": (
        assign(method="grpo", credit__estimator="ktae", credit__ktae_ig_weight=-1.0),
        r"config\.credit\.ktae_ig_weight=-1\.0: must be >= 0; pass --config\.credit\.ktae_ig_weight=<a value >= 0>",
    ),
    "rollout correction cap of one": (
        assign(train__rollout_correction_cap=1.0),
        r"config\.train\.rollout_correction_cap=1\.0: must be > 1",
    ),
    "rollout correction of the sampler's own log-probs": (
        assign(train__rollout_correction="mis", rollout__old_log_probs="sampler"),
        r"config\.train\.rollout_correction='mis': weighs the sampler -> scorer ratio, and with "
        r"rollout\.old_log_probs='sampler' .* pass --config\.rollout\.old_log_probs=rescore or "
        r"--config\.train\.rollout_correction=none",
    ),
    "misspelt logger": (
        assign(loggers="jsonl,tensorbord"),
        r"config\.loggers='jsonl,tensorbord': unknown 'tensorbord': expected a comma-separated subset of "
        r"\('jsonl', 'tensorboard', 'wandb'\)",
    ),
    "loggers without metrics.jsonl": (
        assign(loggers="tensorboard"),
        r"config\.loggers='tensorboard': jsonl is always on \(resume, plots and launch/report.py read",
    ),
    "kept responses every -2 steps": (
        assign(outputs__sample_every=-2),
        r"config\.outputs\.sample_every=-2: must be >= -1",
    ),
    "rollout devices leave none to train": (
        assign(mesh__rollout_devices=1),
        r"config\.mesh\.rollout_devices=1 must leave every process devices for both stages",
    ),
    "temperature whose log-probs overflow float32": (
        assign(rollout__temperature=1e-30),
        r"config\.rollout\.temperature=1e-30: must be >= 0\.0001; pass --config\.rollout\.temperature=",
    ),
    "negative collective timeout": (
        assign(mesh__collective_timeout_s=-5),
        r"config\.mesh\.collective_timeout_s=-5: must be >= 1; pass --config\.mesh\.collective_timeout_s=",
    ),
    "zero collective timeout": (
        assign(mesh__collective_timeout_s=0),
        r"config\.mesh\.collective_timeout_s=0: must be >= 1",
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_config_mistake_names_the_field_before_anything_loads(tmp_path, nothing_loads, case):
    edit, message = CASES[case]
    config = small_train_config(tmp_path)
    edit(config)
    with pytest.raises(ConfigError, match=message):
        loop.train(config)
    assert not (tmp_path / "checkpoints").exists()


def test_every_problem_is_listed_at_once(tmp_path, nothing_loads):
    config = small_train_config(tmp_path, steps=0, train__lam=2.0, reward__workers=0)
    with pytest.raises(ConfigError) as error:
        loop.train(config)
    assert len(str(error.value).splitlines()) == 3


def test_the_presets_validate(tmp_path):
    from comppo_jax.models import load_config_file
    from comppo_jax.train.validation import validate_config

    for preset in ("tiny", "qwen3_4b", "llama3_8b"):
        config = load_config_file(f"configs/{preset}.py")
        validate_config(config)  # the paper presets name their model and data by hub id: checked when fetched
        if config.model.path_required:
            config.model.path = config.data.path = ""
            with pytest.raises(ConfigError) as error:
                validate_config(config)
            assert {line.split("=")[0] for line in str(error.value).splitlines()} == {
                "config.model.path",
                "config.data.path",
            }


def test_wandb_without_its_extra_is_named_before_anything_loads(tmp_path, nothing_loads, monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else find_spec(name, *a))
    with pytest.raises(ConfigError, match=r"config\.loggers='jsonl,wandb': wandb is not installed: pip install"):
        loop.train(small_train_config(tmp_path, loggers="jsonl,wandb"))


def test_a_tensorboard_folder_that_is_a_file_is_named_before_anything_loads(tmp_path, nothing_loads):
    (tmp_path / "tensorboard").write_text("not a folder")
    with pytest.raises(
        ConfigError,
        match=rf"^config\.loggers='jsonl,tensorboard': TensorBoard writes its event files under "
        rf"{tmp_path}/tensorboard, which is a file, not a directory: move it away, or drop tensorboard "
        r"\(--config\.loggers=jsonl\)$",
    ):
        loop.train(small_train_config(tmp_path, loggers="jsonl,tensorboard"))
    with pytest.raises(AssertionError, match="got past validation"):  # without TensorBoard the file is no matter
        loop.train(small_train_config(tmp_path, loggers="jsonl"))
    output_file = tmp_path / "a_file"
    output_file.write_text("")
    with pytest.raises(ConfigError, match=rf"^config\.output_dir='{output_file}': is a file, not a directory"):
        loop.train(small_train_config(output_file))


# Neither a local path nor a well-formed gs:// one: each would be a relative local folder (./s3:/bucket/run) or a
# bucket name Cloud Storage refuses only after its retries.
NOT_A_LOCATION = (
    "s3://bucket/run",
    "gcs://bucket/run",
    "gs:/bucket/run",
    "http://host/run",
    "hf://owner/name",
    "gs://",
    "gs://Bucket/run",
    "gs://ab/run",
    f"gs://{'a' * 64}/run",
)


@pytest.mark.parametrize("value", NOT_A_LOCATION)
@pytest.mark.parametrize("field", PATH_FIELDS)
def test_a_path_field_that_is_not_local_or_gs_is_refused_before_anything_is_written(
    tmp_path, monkeypatch, nothing_loads, field, value
):
    monkeypatch.chdir(tmp_path)
    config = small_train_config("run")
    assign(**{field.replace(".", "__"): value})(config)
    with pytest.raises(ConfigError) as error:
        loop.train(config)
    (line,) = [line for line in str(error.value).splitlines() if line.startswith(f"config.{field}={value!r}: ")]
    assert re.search(r"write (a local path or gs://BUCKET/\.\.\.|gs://BUCKET/\.\.\. with a valid bucket)", line)
    assert os.listdir(tmp_path) == []  # no ./s3: folder, no run directory


@pytest.mark.parametrize("field", PATH_FIELDS)
def test_a_bucket_path_and_where_the_field_takes_one_a_hub_id_pass(tmp_path, field):
    hub_fields = {name for name, _ in hub.SOURCE_FIELDS}
    for value in ("gs://my-bucket.example_1/run", *(["owner/name@main"] if field in hub_fields else [])):
        config = small_train_config(tmp_path)
        assign(**{field.replace(".", "__"): value})(config)
        validate_config(config)


def test_a_launch_whose_hub_id_fails_leaves_no_run_directory_it_made(tmp_path, monkeypatch, nothing_loads):
    from hub_server import use_hub

    use_hub(monkeypatch, "http://127.0.0.1:9", tmp_path / "hf", offline=True)  # an empty cache: the fetch fails
    kept, empty = tmp_path / "kept", tmp_path / "empty_before"
    kept.mkdir()
    empty.mkdir()
    (kept / "notes.txt").write_text("a file that was there before")
    for output_dir in (tmp_path / "runs" / "new", kept, empty):
        with pytest.raises(ConfigError, match=r"^config\.model\.path='owner/name': owner/name is not"):
            loop.train(small_train_config(output_dir, model__path="owner/name"))
    assert sorted(os.listdir(tmp_path)) == ["empty_before", "kept"]  # runs/new is gone, runs/ with it
    assert os.listdir(kept) == ["notes.txt"] and os.listdir(empty) == []
