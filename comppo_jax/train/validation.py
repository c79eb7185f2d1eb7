"""One validation pass over a training config, before the warm start or any compile.

`validate_config(cfg)` checks every field a run reads: that it exists (against the preset
template, `comppo_jax.train.schema.paper_config`), every enum, every range, the paths a run needs
(model, tokenizer, data, position schedule) and the batch arithmetic. It collects every problem
and raises one `ConfigError` listing them, each naming the field, the value and the fix, so a
mistake costs seconds, not the 11-minute warm start. The mesh-dependent divisibility checks
(`check_batch`) run once the mesh exists, still before any model is built.
"""

from __future__ import annotations

import difflib
import importlib.util
import math
import os

from comppo_jax import hub, storage
from comppo_jax.credit import GATE_STATISTICS, IMPORTANCE_WEIGHT_RULES, LOSS_AGGREGATIONS
from comppo_jax.credit.losses import ROLLOUT_CORRECTION_LEVELS, ROLLOUT_CORRECTIONS
from comppo_jax.credit.schedule import load_position_schedule
from comppo_jax.credit.turns import CROSSINGS
from comppo_jax.data.rewards import LENGTH_PENALTIES, LENGTH_PENALTY_SCOPES
from comppo_jax.environments import ENVIRONMENTS
from comppo_jax.models.config import ATTENTION, DTYPES, REMAT, ConfigError
from comppo_jax.models.lora import TARGETS as LORA_TARGETS
from comppo_jax.models.lora import parse_targets as parse_lora_targets
from comppo_jax.models.paged_cache import KV_DTYPES, PAGED_ATTENTION
from comppo_jax.models.quantize import WEIGHT_DTYPES
from comppo_jax.rollout.experience import DYNAMIC_SAMPLING_FILTERS
from comppo_jax.rollout.scoring import OLD_LOG_PROBS, WINDOWS
from comppo_jax.runs.outputs import parse_loggers
from comppo_jax.sharding import AXES
from comppo_jax.train import controller
from comppo_jax.train.decode_layout import parse_tensor
from comppo_jax.train.methods import (
    ESTIMATOR_METHODS,
    ESTIMATORS,
    GATE_REFRESH,
    GATES,
    KL_AGGREGATIONS,
    METHODS,
    POLICY_LOSSES,
    PROXIMAL,
    TOKEN_SELECTIONS,
)
from comppo_jax.train.schema import paper_config

CRITIC_KINDS = ("tac", "standard", "full")
DATA_KINDS = ("synthetic", "dapo_math")


def config_fields(section, whole=(), prefix: str = ""):
    """(dotted name, value) of every field of a config section, descending into nested sections
    except those named in `whole`, which are one field each."""
    for name, value in section.items():
        dotted = f"{prefix}{name}"
        if hasattr(value, "items") and dotted not in whole:
            yield from config_fields(value, whole, dotted + ".")
        else:
            yield dotted, value


def _lookup(cfg, dotted: str):
    section = cfg
    for part in dotted.split("."):
        if not hasattr(section, "keys") or part not in section.keys():
            raise KeyError(dotted)
        section = section[part]
    return section


def missing_fields(cfg) -> list[str]:
    """Fields the preset template has and `cfg` lacks (a deleted or misspelt field)."""
    missing = []
    template = paper_config(dict(cfg.model.arch) if "model" in cfg and "arch" in cfg.model else {})
    for dotted, _ in config_fields(template, whole={"model.arch"}):  # model.arch is the model's own, not checked
        try:
            _lookup(cfg, dotted)
        except KeyError:
            missing.append(dotted)
    return missing


class _Problems:
    """Collects `config.<field>=<value>: <what is wrong>; <the fix>` lines."""

    def __init__(self, cfg):
        self.cfg, self.lines = cfg, []

    def value(self, dotted: str):
        return _lookup(self.cfg, dotted)

    def add(self, dotted: str, message: str) -> None:
        self.lines.append(f"config.{dotted}={self.value(dotted)!r}: {message}")

    def enum(self, dotted: str, allowed) -> None:
        value = self.value(dotted)
        if value not in allowed:
            close = difflib.get_close_matches(str(value), [str(a) for a in allowed], n=1)
            fix = f"pass --config.{dotted}={close[0]}" if close else f"pass --config.{dotted}=<one of them>"
            self.add(dotted, f"expected one of {tuple(allowed)}; {fix}")

    def number(self, dotted: str, *, low=None, high=None, low_open=False, high_open=False, integer=False) -> None:
        """Range check; low/high bounds are inclusive unless *_open."""
        value = self.value(dotted)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and not isinstance(value, int)):
            self.add(dotted, f"expected {'an integer' if integer else 'a number'}")
            return
        if not math.isfinite(value):
            self.add(dotted, "expected a finite number")
            return
        below = low is not None and (value <= low if low_open else value < low)
        above = high is not None and (value >= high if high_open else value > high)
        if below or above:
            if high is None:
                allowed = f"{'>' if low_open else '>='} {low}"
            elif low is None:
                allowed = f"{'<' if high_open else '<='} {high}"
            else:
                allowed = f"in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
            self.add(
                dotted,
                f"must be {allowed}; pass --config.{dotted}=<{'an integer' if integer else 'a value'} {allowed}>",
            )


# Every field holding a path; those of comppo_jax.hub.SOURCE_FIELDS also take a hub id.
PATH_FIELDS = ("output_dir", "position_schedule", "warm_start.cache_dir", "model.path", "model.tokenizer", "data.path")


def _check_locations(problems: _Problems) -> set[str]:
    """The path fields that are neither a local path nor a well-formed gs:// one (a hub id where the field takes
    one), each a problem: s3://, gcs:// or a mistyped gs:/ would be a relative local folder, lost with the worker's
    disk. Returns them, so their other checks are skipped."""
    hub_fields = {field for field, _ in hub.SOURCE_FIELDS}
    refused = set()
    for dotted in PATH_FIELDS:
        value = problems.value(dotted)
        try:
            storage.check_location(value, f"config.{dotted}", hub=dotted in hub_fields)
        except ValueError as error:
            problems.lines.append(str(error))
            refused.add(dotted)
    return refused


def _check_paths(problems: _Problems, cfg, refused: set[str]) -> None:
    """A local path must exist; a hub id or a gs:// path is taken as written (checking it means a network
    call: `comppo_jax.hub.pin_sources` does that, right after this pass). Fields in `refused` are not
    paths at all (`_check_locations`)."""
    model = cfg.model
    hub_id = "or a Hugging Face {} id (owner/name, optionally @<branch, tag or commit>)"
    if model.get("path_required") and not model.path:
        problems.lines.append(
            "config.model.path='': this preset needs an HF checkpoint: pass "
            "--config.model.path=/path/to/hf_checkpoint (a directory with config.json, *.safetensors and the "
            f"tokenizer), a gs:// one, {hub_id.format('model')} such as Qwen/Qwen3-4B"
        )
    if model.path and "model.path" not in refused and not _source_exists(model.path, os.path.isdir):
        problems.add(
            "model.path",
            "does not exist; expected a local HF checkpoint directory (config.json + *.safetensors), a gs:// one, "
            + hub_id.format("model"),
        )
    if model.tokenizer and "model.tokenizer" not in refused and not _source_exists(model.tokenizer, os.path.isdir):
        problems.add(
            "model.tokenizer",
            "does not exist; expected a local directory with tokenizer.json / tokenizer_config.json, a gs:// one, "
            f"{hub_id.format('model')}, or '' for the tokenizer saved with model.path",
        )
    if (
        cfg.data.kind == "dapo_math"
        and "data.path" not in refused
        and not _source_exists(cfg.data.path, os.path.isfile)
    ):
        problems.add(
            "data.path",
            "does not exist; pass --config.data.path=/path/to/dapo-math-17k.parquet (or .jsonl), a gs:// file, "
            f"{hub_id.format('dataset')} such as BytedTsinghua-SIA/DAPO-Math-17k",
        )
    if cfg.method == "comppo" and cfg.gate == "position" and "position_schedule" not in refused:
        if not cfg.position_schedule:
            problems.add(
                "position_schedule",
                "gate='position' needs a position schedule: pass --config.position_schedule=<a CompPO "
                "run's output_dir>/gate_profile.json",
            )
        elif not storage.path(cfg.position_schedule).is_file():
            problems.add(
                "position_schedule", "does not exist; expected a JSON schedule such as a CompPO run's gate_profile.json"
            )
        else:
            try:
                load_position_schedule(cfg.position_schedule)
            except (ValueError, KeyError, TypeError) as error:
                problems.add(
                    "position_schedule",
                    f"is not a position schedule ({error}); expected a CompPO run's gate_profile.json",
                )


def _check_output_folders(problems: _Problems, cfg, loggers: tuple[str, ...]) -> None:
    """A local output_dir, or its tensorboard/ folder when TensorBoard logs, that is a file and not a
    directory (a bucket has no directories: nothing to check there)."""
    if not isinstance(cfg.output_dir, str) or not cfg.output_dir or storage.is_remote(cfg.output_dir):
        return
    root = storage.path(cfg.output_dir)
    if root.exists() and not root.is_dir():
        problems.add("output_dir", "is a file, not a directory: move it away or choose another --config.output_dir")
        return
    board = root / "tensorboard"
    if "tensorboard" in loggers and board.exists() and not board.is_dir():
        problems.add(
            "loggers",
            f"TensorBoard writes its event files under {board}, which is a file, not a directory: move it away, "
            "or drop tensorboard (--config.loggers=jsonl)",
        )


def _source_exists(spec: str, is_local) -> bool:
    """Whether `spec` is an existing local path of the right kind (`is_local`), a gs:// path or a hub id."""
    kind = hub.source_kind(spec)
    return kind in ("gcs", "hub") or (kind == "local" and is_local(spec))


def _check_mesh(problems: _Problems, cfg) -> None:
    sizes = [cfg.mesh[axis] for axis in AXES]
    if sizes.count(-1) > 1 or any(not isinstance(s, int) or s == 0 or s < -1 for s in sizes):
        problems.lines.append(
            f"config.mesh (data, fsdp, tensor)={tuple(sizes)}: sizes must be positive integers, at most one -1 "
            "(all remaining devices)"
        )
    rows = cfg.rollout.prompts_per_step * cfg.rollout.samples_per_prompt
    minibatch = cfg.train.minibatch_size
    if isinstance(minibatch, int) and minibatch >= 1 and rows % minibatch:
        problems.add(
            "train.minibatch_size",
            f"must divide the {rows} responses per step (rollout.prompts_per_step x samples_per_prompt)",
        )
    if cfg.mesh.distributed and cfg.mesh.coordinator_address:
        problems.number("mesh.num_processes", low=1, integer=True)
        problems.number("mesh.process_id", low=0, high=max(cfg.mesh.num_processes - 1, 0), integer=True)


def _check_combinations(problems: _Problems, cfg) -> None:
    """Switches that mean nothing for the config's method (a silent no-op would mislead a comparison)."""
    gated = cfg.method == "comppo" and cfg.gate in (
        "attention",
        "shuffle",
    )  # the runs whose kappa comes from the statistic
    if cfg.gate_statistic != "herfindahl" and not gated:
        problems.add(
            "gate_statistic",
            f"only CompPO's attention and shuffle gates read the statistic (method={cfg.method!r}, "
            f"gate={cfg.gate!r}); pass --config.gate_statistic=herfindahl",
        )
    if cfg.gate_refresh == "epoch" and not gated:
        problems.add(
            "gate_refresh",
            f"only CompPO's attention and shuffle gates depend on the actor (method={cfg.method!r}, "
            f"gate={cfg.gate!r}); pass --config.gate_refresh=rollout",
        )
    if cfg.train.policy_loss == "gspo" and cfg.method != "grpo":
        problems.add(
            "train.policy_loss",
            f"GSPO's one ratio per response would average away {cfg.method}'s per-token credit; pass "
            "--config.train.policy_loss=gspo_token (the same sequence-mean objective, each token "
            "carrying its own advantage), or --config.method=grpo for GSPO with GRPO's advantages",
        )
    if cfg.train.clip_high_scale != 1.0 and cfg.train.policy_loss != "ppo":
        problems.add(
            "train.clip_high_scale",
            f"scales the per-token ratio's clip; {cfg.train.policy_loss} clips its sequence ratio at "
            "train.gspo_clip_low / gspo_clip_high instead: pass --config.train.clip_high_scale=1.0",
        )
    if not cfg.train.group_std_normalization and cfg.method != "grpo":
        problems.add(
            "train.group_std_normalization",
            f"only GRPO's group-relative advantages divide by a group std "
            f"(method={cfg.method!r}); pass --config.train.group_std_normalization=True",
        )
    if cfg.train.proximal == "recompute" and cfg.train.policy_loss != "ppo":
        problems.add(
            "train.proximal",
            f"the decoupled objective weights per-token ratios; {cfg.train.policy_loss} clips a sequence "
            "ratio: pass --config.train.proximal=behaviour or --config.train.policy_loss=ppo",
        )
    if cfg.train.token_selection != "all" and cfg.train.policy_loss != "ppo":
        problems.add(
            "train.token_selection",
            "selects the tokens of the per-token PPO ratio (as its authors' code, for that loss only); "
            f"{cfg.train.policy_loss}'s ratio is the mean over all of a response's tokens, which a selection would "
            "either still move through the dropped tokens or redefine: pass --config.train.policy_loss=ppo or "
            "--config.train.token_selection=all",
        )
    if cfg.train.rollout_correction != "none" and cfg.rollout.old_log_probs != "rescore":
        problems.add(
            "train.rollout_correction",
            f"weighs the sampler -> scorer ratio, and with rollout.old_log_probs={cfg.rollout.old_log_probs!r} the "
            "old log-probs are the sampler's: pass --config.rollout.old_log_probs=rescore or "
            "--config.train.rollout_correction=none",
        )
    estimator = cfg.credit.estimator
    if estimator != "auto" and cfg.method != ESTIMATOR_METHODS[estimator]:
        problems.add(
            "credit.estimator",
            f"{estimator} replaces {ESTIMATOR_METHODS[estimator]}'s own advantages (method={cfg.method!r}): pass "
            f"--config.method={ESTIMATOR_METHODS[estimator]} or --config.credit.estimator=auto",
        )
    if cfg.credit.attention_anchor_horizon_lo > cfg.credit.attention_anchor_horizon_hi:
        problems.add(
            "credit.attention_anchor_horizon_lo",
            f"the future attention influence averages the attention of the tokens H_lo to H_hi after each one, and "
            f"H_hi={cfg.credit.attention_anchor_horizon_hi}: pass --config.credit.attention_anchor_horizon_lo=<at most "
            f"{cfg.credit.attention_anchor_horizon_hi}> or raise --config.credit.attention_anchor_horizon_hi",
        )
    if cfg.rollout.dynamic_sampling and cfg.rollout.samples_per_prompt < 2:
        problems.add(
            "rollout.dynamic_sampling",
            "a group of one response always has equal rewards, so every group would be "
            "dropped; raise rollout.samples_per_prompt or pass --config.rollout.dynamic_sampling=False",
        )


# Each enumerated field and what it takes.
ENUM_FIELDS = {
    "method": METHODS,
    "gate": GATES,
    "critic.kind": CRITIC_KINDS,
    "model.attention": ATTENTION,
    "model.remat": REMAT,
    "model.arch.dtype": DTYPES,
    "train.master_dtype": DTYPES,
    "data.kind": DATA_KINDS,
    "rollout.window": WINDOWS,
    "rollout.old_log_probs": OLD_LOG_PROBS,
    "rollout.paged_attention": PAGED_ATTENTION,
    "rollout.kv_dtype": KV_DTYPES,
    "rollout.weight_dtype": WEIGHT_DTYPES,
    "reward.length_penalty": LENGTH_PENALTIES,
    "reward.length_penalty_on": LENGTH_PENALTY_SCOPES,
    "gate_statistic": GATE_STATISTICS,
    "gate_refresh": GATE_REFRESH,
    "train.policy_loss": POLICY_LOSSES,
    "train.loss_aggregation": ("auto",) + LOSS_AGGREGATIONS,
    "train.kl_aggregation": KL_AGGREGATIONS,
    "rollout.dynamic_sampling_filter": DYNAMIC_SAMPLING_FILTERS,
    "rollout.environment": ENVIRONMENTS,
    "credit.env_crossing": CROSSINGS,
    "train.proximal": PROXIMAL,
    "train.importance_weight_rule": IMPORTANCE_WEIGHT_RULES,
    "train.rollout_correction": ROLLOUT_CORRECTIONS,
    "train.rollout_correction_level": ROLLOUT_CORRECTION_LEVELS,
    "credit.estimator": ESTIMATORS,
    "train.token_selection": TOKEN_SELECTIONS,
}
COUNT = dict(low=1, integer=True)  # a positive whole number
ZERO_OR_MORE = dict(low=0, integer=True)
POSITIVE = dict(low=0, low_open=True)
# The lowest temperature a run samples and scores at. Training reads log-probs of softmax(logits / T), and
# they and their gradients grow as 1 / T: at 1e-30 they overflow float32 and the non-finite stop blames the
# learning rate. At 1e-4 a logit gap of 0.01 (bf16's resolution near 1) already weighs exp(-100) < 1e-43, so a
# lower temperature samples no differently, only less finitely. (T = 0, greedy, has no log-probs to train on.)
MIN_TEMPERATURE = 1e-4
# Each numeric field's range (`_Problems.number`'s keywords).
NUMBER_FIELDS = {
    "sink_tokens": ZERO_OR_MORE,
    "train.clip_high_scale": POSITIVE,
    "train.gspo_clip_low": dict(low=0, high=1, low_open=True),
    "train.gspo_clip_high": POSITIVE,
    "rollout.max_refills": dict(low=-1, integer=True),
    "rollout.staleness": ZERO_OR_MORE,
    "rollout.max_turns": COUNT,
    "warm_start.answer_noise": dict(low=0, high=1),
    "warm_start.step_noise": dict(low=0, high=1),
    "warm_start.noisy_first_steps": dict(low=0, integer=True),
    "warm_start.tool_calls": dict(low=0, high=1),
    "rollout.max_reply_tokens": COUNT,
    "train.importance_weight_cap": dict(low=1),
    "train.rollout_correction_cap": dict(low=1, low_open=True),
    "train.rollout_correction_lower_cap": dict(low=0, high=1, high_open=True),
    "train.packing_min_saving": dict(low=0, high=1, high_open=True),
    "credit.vapo_alpha": POSITIVE,
    "credit.vapo_critic_lam": dict(low=0, high=1),
    "credit.ktae_fisher_weight": dict(low=0),
    "credit.ktae_ig_weight": dict(low=0),
    "credit.ktae_tf_weight": dict(low=0),
    "credit.ktae_scale": dict(low=0),
    "credit.attention_anchor_fraction": dict(low=0, high=1, low_open=True),
    "credit.attention_anchor_amplification": POSITIVE,
    "credit.attention_anchor_horizon_lo": COUNT,
    "credit.attention_anchor_horizon_hi": COUNT,
    "train.token_selection_fraction": dict(low=0, high=1, low_open=True),
    "mesh.rollout_devices": ZERO_OR_MORE,
    # passed as it is to --xla_cpu_collective_timeout_seconds (sharding.with_collective_timeout): no "0: none" there
    "mesh.collective_timeout_s": COUNT,
    "model.lora.rank": ZERO_OR_MORE,
    "model.lora.alpha": POSITIVE,
    "outputs.sample_every": dict(low=-1, integer=True),
    "outputs.samples_per_step": ZERO_OR_MORE,
    "outputs.sample_tokens": dict(low=2, integer=True),
    "steps": COUNT,
    "seed": ZERO_OR_MORE,
    "train.actor_lr": POSITIVE,
    "train.critic_lr": POSITIVE,
    "train.kl_coef": dict(low=0),
    "train.kl_coef_grpo": dict(low=0),
    "train.lam": dict(low=0, high=1, low_open=True),
    "train.minibatch_size": COUNT,
    "train.critic_warmup_steps": ZERO_OR_MORE,
    "train.eval_every": ZERO_OR_MORE,
    "train.max_skipped_updates": COUNT,
    "gate_envelope.kappa_lo": dict(low=0, high=1),
    "gate_envelope.kappa_hi": dict(low=0, high=1),
    "gate_envelope.tau": POSITIVE,
    "fixed_gate": dict(low=0, high=1),
    "rollout.prompts_per_step": COUNT,
    "rollout.samples_per_prompt": COUNT,
    "rollout.max_new_tokens": COUNT,
    "rollout.temperature": dict(low=MIN_TEMPERATURE),
    "rollout.top_p": dict(low=0, high=1, low_open=True),
    "rollout.page_size": COUNT,
    "rollout.decode_slots": ZERO_OR_MORE,
    "critic.fused_layers": COUNT,
    "critic.bottleneck": COUNT,
    "critic.top_k": COUNT,
    "reward.workers": COUNT,
    "reward.timeout_s": POSITIVE,
    "checkpoint.every": COUNT,
    "checkpoint.keep_last": COUNT,
    "checkpoint.keep_best": ZERO_OR_MORE,
    "resume_step": dict(low=-1, integer=True),
    "data.dev_size": COUNT,
}
# Checked only where the field is read: (the condition on the config, the field, its range).
CONDITIONAL_NUMBER_FIELDS = (
    (lambda cfg: cfg.data.kind == "synthetic", "data.train_size", COUNT),
    (lambda cfg: bool(cfg.warm_start.steps), "warm_start.steps", ZERO_OR_MORE),
    (lambda cfg: bool(cfg.warm_start.steps), "warm_start.batch_size", COUNT),
    (lambda cfg: bool(cfg.warm_start.steps), "warm_start.learning_rate", POSITIVE),
)


def _check_parsed_fields(problems: _Problems, cfg) -> None:
    """The fields a parser reads: the LoRA targets, the decode layout's group, the loggers (and the
    output folders they write)."""
    try:
        parse_lora_targets(problems.value("model.lora.targets"))
    except ConfigError:
        problems.add("model.lora.targets", f"expected a comma-separated subset of {', '.join(LORA_TARGETS)}, e.g. q,v")
    try:
        parse_tensor(problems.value("rollout.mesh.tensor"))
    except ValueError:
        problems.add(
            "rollout.mesh.tensor",
            "expected auto, train or a positive number of devices per tensor-parallel group, "
            "e.g. --config.rollout.mesh.tensor=4",
        )
    try:
        loggers = parse_loggers(problems.value("loggers"))
    except ValueError as error:
        problems.add("loggers", str(error))
    else:
        if "wandb" in loggers and importlib.util.find_spec("wandb") is None:
            problems.add("loggers", "wandb is not installed: pip install 'comppo_jax[wandb]' (or drop wandb)")
        _check_output_folders(problems, cfg, loggers)


def _check_relations(problems: _Problems, cfg) -> None:
    """What one field's range cannot say: the gate's range in order, a warm start with worked
    solutions to train on, and the controller's and reward schedule's own checks."""
    envelope = cfg.gate_envelope
    if envelope.kappa_lo >= envelope.kappa_hi:
        problems.lines.append(
            f"config.gate_envelope: kappa_lo={envelope.kappa_lo} must be below kappa_hi={envelope.kappa_hi} "
            "(0 <= kappa_lo < kappa_hi <= 1); swap them"
        )
    if cfg.warm_start.steps and cfg.data.kind == "dapo_math":  # the warm start reads each problem's solution
        problems.add(
            "warm_start.steps",
            "the supervised warm start trains on worked solutions and data.kind='dapo_math' has "
            "none; pass --config.warm_start.steps=0 (or --config.data.kind=synthetic)",
        )
    for check in (
        lambda: controller.controller_config(cfg.controller),
        lambda: controller.reward_schedule(cfg.reward, cfg.rollout.max_new_tokens),
    ):
        try:
            check()
        except (ValueError, TypeError) as error:
            problems.lines.append(str(error))


def validate_config(cfg) -> None:
    """Raises ConfigError listing every problem of a training config (nothing is loaded or compiled)."""
    missing = missing_fields(cfg)
    if missing:
        raise ConfigError(
            "\n".join(
                f"config.{name} is missing: restore it from configs/ (the preset's value) or pass --config.{name}=..."
                for name in missing
            )
        )
    problems = _Problems(cfg)
    for dotted, allowed in ENUM_FIELDS.items():
        problems.enum(dotted, allowed)
    for dotted, bounds in NUMBER_FIELDS.items():
        problems.number(dotted, **bounds)
    for applies, dotted, bounds in CONDITIONAL_NUMBER_FIELDS:
        if applies(cfg):
            problems.number(dotted, **bounds)
    _check_parsed_fields(problems, cfg)
    _check_relations(problems, cfg)
    _check_mesh(problems, cfg)
    _check_paths(problems, cfg, _check_locations(problems))
    if not problems.lines:  # the combinations read several fields: only once each is valid
        _check_combinations(problems, cfg)
    if problems.lines:
        raise ConfigError("\n".join(problems.lines))
