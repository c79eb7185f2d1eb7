"""The training config's schema as data: every section's fields with their defaults (appendix C,
"Primary configuration" and the controller) and a one-line description each, which
`launch/train.py --help` lists beside each field of the loaded config (`FIELD_HELP`).

Presets call `paper_config(arch)` with their `model.arch` and override what differs
(configs/tiny.py overrides most of it for a CPU run). `load_run_config` reads a run's config.json
back against the schema, so fields added after the run was written take their defaults.
Validation is beside it (comppo_jax.train.validation).
"""

from __future__ import annotations

import json
from typing import Any, NamedTuple

import ml_collections
from ml_collections import config_dict

from comppo_jax import storage
from comppo_jax.sharding import COLLECTIVE_TIMEOUT_S
from comppo_jax.train import controller

CONFIG_FILE = "config.json"


class Field(NamedTuple):
    name: str
    default: Any
    help: str


# model.arch: the ModelConfig fields a preset passes (comppo_jax.models.config).
ARCH_HELP = {
    "architecture": "qwen3 | llama",
    "vocab_size": "vocabulary size",
    "hidden_size": "residual width",
    "intermediate_size": "MLP width",
    "num_layers": "decoder layers",
    "num_heads": "query heads",
    "num_kv_heads": "key/value heads (grouped-query attention)",
    "head_dim": "width of one head",
    "rms_norm_eps": "RMSNorm epsilon",
    "rope_theta": "RoPE base",
    "rope_scaling": "Llama-3.1 RoPE scaling (factor, low/high_freq_factor, original_max_position_embeddings)",
    "tie_word_embeddings": "the output projection is the embedding",
    "max_position_embeddings": "longest sequence (prompt + response)",
    "dtype": "params and activations (float32 | bfloat16); softmax and norms accumulate in float32",
    "bos_token_id": "beginning-of-sequence token id",
    "eos_token_ids": "token ids that end a response",
    "pad_token_id": "padding token id",
}

# Section -> its fields, in the order a config lists them ("": the top level; a dotted name nests:
# model.lora sits in model beside model.arch, which a preset passes). The controller's fields are
# its ControllerConfig's (comppo_jax.train.controller.config_section).
SCHEMA: dict[str, tuple[Field, ...] | None] = {
    "": (
        Field("seed", 0, "seed of the params, data order, sampling and warm start"),
        Field(
            "output_dir",
            "runs/default",
            "where metrics.jsonl, tensorboard/, checkpoints/, summary.json and curves.png go",
        ),
        Field("progress", True, "progress bars and first-call compile notices on the terminal"),
        Field("method", "comppo", "comppo | grpo | ppo"),
        Field("gate", "attention", "CompPO's gate control: attention | fixed | shuffle | position"),
        Field("position_schedule", "", "the position-only control's JSON schedule (a run's gate_profile.json)"),
        Field("fixed_gate", 0.61, "the fixed control's constant: the full method's empirical mean gate (section 6.3)"),
        Field(
            "gate_statistic",
            "herfindahl",
            "the concentration statistic kappa reads: herfindahl (the paper's) | entropy | sink_herfindahl | "
            "max_weight (comppo_jax.credit.statistic_concentration)",
        ),
        Field(
            "sink_tokens",
            4,
            "gate_statistic=sink_herfindahl: key positions at the window's start left out (attention sinks)",
        ),
        Field(
            "gate_refresh",
            "rollout",
            "rollout (the paper's: the behaviour policy's gate serves every update epoch) | epoch (recomputed "
            "with the current actor before each later epoch; one forward pass per epoch)",
        ),
        Field(
            "steps",
            200,
            "actor-update steps (the critic warm-up comes on top unless train.critic_warmup_counts_toward_steps)",
        ),
        Field("resume", False, "continue the run in output_dir from its newest checkpoint that verifies"),
        Field("resume_step", -1, "with resume: this checkpoint step instead (-1: the newest that verifies)"),
        Field(
            "resume_allow_changes",
            "",
            "with resume: fields (or sections) that may differ from the run's config.json although they change "
            "what is computed, comma-separated; each change is recorded in config_changes.jsonl",
        ),
        Field(
            "loggers",
            "jsonl,tensorboard",
            "where each step's metrics go, comma-separated: jsonl (metrics.jsonl, always on: resume, plots and "
            "launch/report.py read it) | tensorboard (output_dir/tensorboard) | wandb (Weights & Biases, the "
            "wandb extra; WANDB_MODE=offline logs under output_dir/wandb with no network)",
        ),
        Field("plot", True, "write curves.png at the end"),
    ),
    "model": (
        Field(
            "path",
            "",
            "HF checkpoint (config.json + *.safetensors): a local directory, a gs:// one, or a hub id "
            "owner/name[@revision], fetched at the start and recorded in config.json pinned to its commit",
        ),
        Field("path_required", True, "refuse a random init of the preset's architecture when path is empty"),
        Field(
            "tokenizer",
            "",
            'HF tokenizer: a local or gs:// directory or a hub id ("": the one saved with path; no path either: '
            "the character tokenizer)",
        ),
        Field(
            "attention",
            "auto",
            "training attention: auto | xla | chunked | splash | splash_interpret | cudnn "
            "(comppo_jax.models.attention)",
        ),
        Field("remat", "full", "per-layer jax.checkpoint policy: none | full | dots | dots_no_batch"),
        Field("logits_chunk", 1024, "response tokens per chunk of the vocabulary projection (0: all at once)"),
    ),
    "model.lora": (
        Field(
            "rank",
            0,
            "LoRA rank (0: full fine-tuning): adapters train beside the frozen base, which is also the reference "
            "policy",
        ),
        Field(
            "alpha",
            64.0,
            "LoRA scale numerator: the adapter term is (alpha / rank) * x @ A @ B (PEFT's lora_alpha)",
        ),
        Field(
            "targets",
            "q,k,v,o,gate,up,down",
            "the adapted projections, comma-separated: any of q, k, v, o, gate, up, down",
        ),
    ),
    "gate_envelope": (
        Field("kappa_lo", 0.1, "lowest retention gate (eq. kappa_attention)"),
        Field("kappa_hi", 0.9, "highest retention gate (eq. kappa_attention)"),
        Field("tau", 4.0, "gate temperature on the normalized concentration (eq. kappa_attention)"),
    ),
    "data": (
        Field("kind", "dapo_math", "dapo_math (a local DAPO-Math-17K parquet/jsonl) | synthetic (chained arithmetic)"),
        Field(
            "path",
            "",
            "the dapo_math file: local or gs:// (.parquet, .jsonl), or a hub dataset id owner/name[@revision]",
        ),
        Field("train_size", 0, "synthetic: training problems"),
        Field("dev_size", 500, "ID dev problems (they drive the controller and the best checkpoint)"),
        Field("min_steps", 0, "synthetic: fewest chained operations per problem"),
        Field("max_steps", 0, "synthetic: most chained operations per problem"),
        Field("operations", "", "synthetic: the operators used, e.g. +-"),
    ),
    # Runs that differ only after the warm start (an experiment's arms) share it through cache_dir.
    "warm_start": (
        Field("steps", 0, "supervised steps on the task's worked solutions before RL (0: none)"),
        Field("batch_size", 0, "warm-start batch size"),
        Field("learning_rate", 0.0, "warm-start AdamW learning rate"),
        Field("answer_noise", 0.0, "probability that an odd answer's warm-start Answer line reads answer + 1"),
        Field(
            "step_noise",
            0.0,
            "probability that a warm-start step whose operand is in noisy_operands writes its result + 1 (the chain "
            "goes on from it)",
        ),
        Field("noisy_operands", "", 'step_noise: the operands (digits) whose steps it hits, e.g. "789"'),
        Field("noisy_first_steps", 0, "step_noise: hits only the chain's first this many steps (0: every step)"),
        Field(
            "mark_mistakes",
            False,
            "a step step_noise writes wrong writes ~ for its =, and so does every step after it: the mistake shows",
        ),
        Field(
            "tool_calls",
            0.0,
            "probability that a warm-start step is written as a calculator call, [36*7]=252, its result as noisy as "
            "any step's (with rollout.environment=calculator the calculator writes it, always right)",
        ),
        Field(
            "cache_dir",
            "",
            'where a warm-started policy is kept, keyed by everything it depends on ("": output_dir, for this run'
            " alone: a stop after the warm start, or a lost reference/, reuses it)",
        ),
    ),
    # Batch / responses / minibatch 4 / 4 / 4 (minibatch counted in responses); 16K responses;
    # temperature / top-p 1.0 / 0.7.
    "rollout": (
        Field("prompts_per_step", 4, "prompts sampled per step"),
        Field("samples_per_prompt", 4, "responses per prompt (the GRPO group)"),
        Field("max_new_tokens", 16384, "longest response"),
        Field("temperature", 1.0, "sampling temperature"),
        Field("top_p", 0.7, "nucleus sampling mass"),
        Field(
            "window",
            "response",
            "the keys H_t is taken over: response (the response so far) | full (prompt and response)",
        ),
        Field("page_size", 64, "tokens per KV-cache page of the rollout engine"),
        Field(
            "decode_slots",
            0,
            "rows decoded at once (0: every row; fewer bounds the cache and reuses slots as rows end)",
        ),
        Field(
            "paged_attention",
            "auto",
            "decode attention: auto (the Pallas kernel on TPU / GPU, XLA elsewhere) | xla | tpu | tpu_interpret |"
            " gpu | gpu_interpret",
        ),
        Field(
            "kv_dtype",
            "auto",
            "the KV cache's pages: auto (the model's compute dtype) | float32 | bfloat16 | int8 | float8_e4m3fn (8-bit "
            "pages with a scale per token and kv head: half the bytes of bfloat16)",
        ),
        Field(
            "weight_dtype",
            "auto",
            "the sampler's weights: auto (the model's compute dtype) | float32 | bfloat16 | int8 (a scale per output "
            "channel, quantized once per step when the weights move to the sampler; the learner keeps its own)",
        ),
        Field(
            "old_log_probs",
            "rescore",
            "the behaviour log-probs of the PPO ratio: rescore (teacher-forced in the scoring pass) | sampler "
            "(recorded while sampling; GRPO then skips the behaviour forward pass and logs no gate statistics)",
        ),
        Field(
            "dynamic_sampling",
            False,
            "DAPO's dynamic sampling: drop uninformative prompt groups (dynamic_sampling_filter) and refill the "
            "batch from the prompt stream",
        ),
        Field(
            "dynamic_sampling_filter",
            "accuracy",
            "dynamic_sampling drops a group whose verdicts are all correct or all wrong: accuracy (DAPO's) | "
            "reward (whose shaped rewards are all equal)",
        ),
        Field(
            "max_refills",
            3,
            "dynamic_sampling: extra sampling rounds per step at most; groups still missing then are filled with "
            "dropped ones (-1: draw until the batch is full, stopping the run if a whole pass over the training "
            "prompts cannot fill it, as DAPO)",
        ),
        Field(
            "environment",
            "",
            'multi-turn rollouts with a tool: "" (none: one turn) | calculator (the synthetic task\'s: [36*7] -> '
            "=252) | sandbox (Python programs between <tool_call> and </tool_call>, run confined); the "
            "environment's reply tokens are read, never trained (comppo_jax.rollout.turns)",
        ),
        Field("max_turns", 4, "environment: policy turns per response at most (a call at the last one ends it)"),
        Field("max_reply_tokens", 32, "environment: a reply's tokens at most (cut beyond)"),
        Field(
            "staleness",
            0,
            "bounded staleness k: batch n is generated and behaviour-scored by the policy after update max(0, "
            "n-1-k), so the rollout of later batches runs during earlier updates (0: the synchronous loop)",
        ),
    ),
    # The sampler's own layout (comppo_jax.train.decode_layout): weights split over a tensor-parallel
    # group, replicated over the rest, moved there once per step.
    "rollout.mesh": (
        Field(
            "tensor",
            "auto",
            "the decode layout: devices per tensor-parallel group, the group replicated over the rest and the "
            "rows split across replicas (auto: the fastest by the decode cost model that fits; train: decode on "
            "the training mesh, gathering the fsdp-split weights at every token)",
        ),
    ),
    # Clip 0.2, grad clip 1 and 2 epochs are the controller's stable-phase knobs. AdamW (0.9, 0.999), weight decay 0.
    "train": (
        Field("actor_lr", 1e-6, "actor AdamW learning rate"),
        Field("critic_lr", 1e-5, "critic AdamW learning rate"),
        Field(
            "kl_coef",
            2e-3,
            "KL-to-reference coefficient (PPO, CompPO; 0: no KL term and no reference forward pass)",
        ),
        Field("kl_coef_grpo", 1e-3, "KL-to-reference coefficient (GRPO; 0: no KL term and no reference forward pass)"),
        Field("lam", 0.95, "GAE / Comp-GAE lambda"),
        Field(
            "policy_loss",
            "ppo",
            "the actor's surrogate: ppo (per-token ratio, eq. ppo_outer) | gspo (one length-normalized ratio per "
            "response; GRPO only) | gspo_token (GSPO's ratio carrying per-token advantages)",
        ),
        Field(
            "loss_aggregation",
            "auto",
            "auto (the variant's own: seq-mean-token-mean for gspo / gspo_token, seq-mean-token-scale without the"
            " group std (Dr.GRPO), else token-mean) | token-mean (the paper's, DAPO's) | seq-mean-token-mean "
            "(GSPO's) | seq-mean-token-sum | seq-mean-token-sum-norm (verl's Dr.GRPO: all token sums / "
            "max_new_tokens) | seq-mean-token-scale (Dr.GRPO's own and tunix's: the mean over responses of token "
            "sums / max_new_tokens)",
        ),
        Field(
            "kl_aggregation",
            "token-mean",
            "how the reference KL is aggregated: token-mean | policy (as the policy loss, verl's)",
        ),
        Field(
            "gspo_clip_low",
            3e-4,
            "gspo, gspo_token: the sequence ratio's lower clip (GSPO's; the controller's clip does not apply)",
        ),
        Field("gspo_clip_high", 4e-4, "gspo, gspo_token: the sequence ratio's upper clip (GSPO's)"),
        Field(
            "clip_high_scale",
            1.0,
            "DAPO's decoupled clip: the ratio's upper clip is this times the controller's clip (1.4: DAPO's 0.28/0.2)",
        ),
        Field("group_std_normalization", True, "GRPO: divide by the group's reward std (False: Dr.GRPO)"),
        Field("minibatch_size", 4, "responses per minibatch"),
        Field("critic_warmup_steps", 10, "critic-only steps before the actor's first update"),
        Field("critic_warmup_counts_toward_steps", False, "the paper's literal reading: the warm-up is part of steps"),
        Field("eval_every", 10, "dev evaluation every this many actor-update steps (0: none)"),
        Field("master_dtype", "float32", "the actor's trained copy (fp32 master weights under bf16 compute)"),
        Field(
            "max_skipped_updates",
            3,
            "non-finite updates skipped in a row before the run stops (docs/reliability.md)",
        ),
        Field(
            "offload_idle",
            False,
            "keep idle state in host memory: the AdamW moments outside the update, the reference between scoring "
            "passes, the rollout batch during the update (launch/plan.py shows the HBM freed and the transfer "
            "time)",
        ),
        Field(
            "packing",
            True,
            "sequence packing: the scoring pass, the critic's values and the actor and critic updates run on "
            "rows holding several responses end to end (first-fit-decreasing, bucketed row counts), no padded "
            "token computed; equal to the padded path within float32 rounding (False: one response per row)",
        ),
        Field(
            "packing_min_saving",
            0.0,
            "packing: a batch runs packed only when that saves at least this fraction of its rows (0: always; "
            "short sequences that fill their rows save nothing on a CPU, and packing's gathers cost)",
        ),
        Field(
            "proximal",
            "behaviour",
            "the policy the PPO ratio is clipped against: behaviour (the generating policy, the paper's) | "
            "recompute (AReaL's decoupled objective: a proximal policy recomputed with the current params before "
            "the update, importance weights behaviour -> proximal capped at importance_weight_cap)",
        ),
        Field(
            "importance_weight_cap",
            5.0,
            "proximal=recompute: the cap on the behaviour -> proximal importance weight",
        ),
        Field(
            "importance_weight_rule",
            "mask",
            "proximal=recompute: a weight over the cap: mask (its token dropped from the loss, AReaL's "
            "behav_imp_weight_cap) | truncate (min(w, cap), truncated importance sampling)",
        ),
        Field(
            "rollout_correction",
            "none",
            "old_log_probs=rescore: the policy gradient times r = pi_score / pi_sample (e.g. 8-bit rollouts): none | "
            "tis (min(r, cap)) | mis (r, or 0 outside [lower cap, cap]: the token leaves the loss); mismatch/* is "
            "logged anyway",
        ),
        Field("rollout_correction_cap", 2.0, "rollout_correction: the cap C on r (> 1)"),
        Field(
            "rollout_correction_lower_cap",
            0.0,
            "rollout_correction=mis: r under it leaves the loss too, in [0, 1); 0 takes 1 / rollout_correction_cap "
            "(verl's rejection bounds)",
        ),
        Field(
            "token_selection",
            "all",
            "which tokens the policy gradient flows through: all | entropy_top (the train.token_selection_fraction "
            "of a minibatch's tokens with the highest entropy under the current policy, Wang et al. 2025's 80/20)",
        ),
        Field("token_selection_fraction", 0.2, "token_selection=entropy_top: the share of tokens kept"),
        Field(
            "rollout_correction_level",
            "token",
            "rollout_correction: token | sequence (r: the product of its response's ratios, verl's) | geometric "
            "(r: their geometric mean, GSPO's length normalization)",
        ),
    ),
    # Beyond the paper: advantage estimators published since it (docs/variants.md#token-credit-baselines).
    "credit": (
        Field(
            "estimator",
            "auto",
            "auto (the method's own: comp_gae for comppo, gae for ppo, grpo for grpo) | vapo (ppo: VAPO's "
            "length-adaptive GAE) | ktae (grpo: key-token advantages from the group's rollouts) | "
            "attention_anchor (grpo: the advantage amplified on the tokens later tokens attend to most)",
        ),
        Field("vapo_alpha", 0.05, "vapo: the policy's lambda per response of length l is 1 - 1 / (alpha * l)"),
        Field("vapo_critic_lam", 1.0, "vapo: the critic's targets' lambda, decoupled from the policy's"),
        Field(
            "env_crossing",
            "transition",
            "rollout.environment: the gate at a tool call, where the trace crosses the environment's reply: "
            "transition (the call's own kappa) | pass (kappa 1); docs/conventions.md",
        ),
        Field("ktae_fisher_weight", 1.0, "ktae: h1, the weight of Fisher's exact test in the key-token strength"),
        Field("ktae_ig_weight", 1.0, "ktae: h2, the weight of the information gain in the key-token strength"),
        Field("ktae_tf_weight", 1.0, "ktae: h3, the weight of the BM25 frequency ratio in the key-token direction"),
        Field("ktae_scale", 1.0, "ktae: the key-token values lie in (-scale, scale), added to GRPO's advantage"),
        Field(
            "attention_anchor_fraction",
            0.4,
            "attention_anchor: q, the share of each response's tokens of highest future attention influence whose "
            "advantage is amplified (Li et al. 2025's TopQ)",
        ),
        Field("attention_anchor_amplification", 1.5, "attention_anchor: gamma_amp, their advantage's factor"),
        Field("attention_anchor_horizon_lo", 10, "attention_anchor: H_lo, the nearest later token counted in FAI"),
        Field("attention_anchor_horizon_hi", 100, "attention_anchor: H_hi, the farthest later token counted in FAI"),
    ),
    "critic": (
        Field(
            "kind",
            "tac",
            "tac (paper section 4.3) | standard (a linear value head) | full (a copy of the policy with a value "
            "head, all of it trained: PPO's usual critic, for comparison). PPO takes standard unless full",
        ),
        Field("fused_layers", 4, "TAC: the last this many HF hidden states are fused"),
        Field("bottleneck", 128, "TAC: width d"),
        Field("top_k", 64, "TAC: routed positions per token (K)"),
        Field("eps", 1e-6, "TAC: normalization epsilon"),
        Field("query_block", 128, "TAC: query positions per routing block"),
    ),
    # Only correct, well-formed responses pay for length (comppo_jax.data.rewards; the schedule:
    # comppo_jax.train.controller.RewardSchedule, 3e-5 -> 8e-5 per token over steps 20-60).
    "reward": (
        Field("workers", 8, "math-verify worker processes"),
        Field("timeout_s", 5.0, "seconds a verification may take before it counts as incorrect"),
        Field(
            "length_penalty",
            "linear",
            "linear (the paper's per-token coefficient) | overlong (DAPO's soft overlong punishment)",
        ),
        Field("overlong_buffer", 4096, "overlong: tokens before max_new_tokens where the penalty ramps in"),
        Field("overlong_penalty", 1.0, "overlong: the penalty at max_new_tokens"),
        Field("correct_never_below_incorrect", True, "a correct answer's reward stays >= an incorrect one's"),
        Field(
            "length_penalty_on",
            "correct",
            "who pays the length penalty: correct (the paper's: correct, well-formed responses) | all (DAPO's "
            "overlong shaping: every response)",
        ),
        Field(
            "length_penalty_schedule",
            "paper",
            "paper (off before step 20, ramped in over steps 20-60) | constant (its full value from step 0, as "
            "DAPO's overlong shaping)",
        ),
    ),
    # The minibatch of 4 responses is split over 4 FSDP shards; the remaining chips split heads and
    # MLP width (tensor parallelism). TPU pods need no coordinator address.
    "controller": None,
    "mesh": (
        Field("data", 1, "data-parallel axis size (-1: the remaining devices)"),
        Field("fsdp", 4, "FSDP axis size (-1: the remaining devices)"),
        Field("tensor", -1, "tensor-parallel axis size (-1: the remaining devices)"),
        Field("distributed", False, "multi-host: call jax.distributed.initialize"),
        Field("coordinator_address", "", 'multi-host: host:port of process 0 ("": found by JAX, e.g. on TPU pods)'),
        Field("num_processes", 0, "multi-host: processes (0: found by JAX)"),
        Field("process_id", 0, "multi-host: this process's index"),
        Field(
            "collective_timeout_s",
            COLLECTIVE_TIMEOUT_S,
            "multi-process on the CPU backend: seconds a gloo collective waits for its peers before it fails",
        ),
        Field(
            "rollout_devices",
            0,
            "devices of every process the rollout stage runs on, training on the rest (0: both on every device)",
        ),
    ),
    # Every checkpoint carries per-leaf content digests, verified on restore.
    "checkpoint": (
        Field("every", 10, "async Orbax checkpoint every this many steps (and at the end)"),
        Field("keep_last", 2, "newest checkpoints kept"),
        Field("keep_best", 1, "best checkpoints by dev accuracy kept"),
    ),
    # Responses kept with their per-token credit for launch/report.py (comppo_jax.train.samples).
    "outputs": (
        Field(
            "sample_every",
            0,
            "keep sampled responses with their per-token gate, advantages and values every this many steps (0: at"
            " each dev evaluation, train.eval_every; -1: never), one file per step under output_dir/samples",
        ),
        Field("samples_per_step", 4, "responses kept per such step (spread over the batch)"),
        Field(
            "sample_tokens",
            2048,
            "most tokens kept of one response (its first and last halves beyond that), which bounds a step's file",
        ),
    ),
    "eval": (
        Field(
            "benchmarks",
            "",
            "launch/eval.py: frozen benchmarks as name=path,... (comppo_jax.data.datasets.BENCHMARKS)",
        ),
        Field("samples", 8, "launch/eval.py: responses n per problem for avg@n, pass@k and majority@n"),
        Field("temperature", 1.0, "launch/eval.py: sampling temperature of those responses (0: greedy)"),
        Field("top_p", 0.7, "launch/eval.py: nucleus mass of those responses"),
        Field("pass_k", "", 'launch/eval.py: the k of pass@k, e.g. 1,4,16 ("": 1 and samples)'),
        Field("batch_size", 32, "launch/eval.py: problems per batch"),
    ),
}


def _section(fields: tuple[Field, ...]) -> config_dict.ConfigDict:
    return config_dict.ConfigDict({field.name: field.default for field in fields})


def _field_help() -> dict[str, str]:
    """ "section.field" -> its one-line description, for every field `paper_config` declares."""
    described = {
        (f"{section}." if section else "") + field.name: field.help
        for section, fields in SCHEMA.items()
        for field in fields or ()
    }
    described.update({f"model.arch.{name}": text for name, text in ARCH_HELP.items()})
    described.update({f"controller.{name}": text for name, text in controller.FIELD_HELP.items()})
    return described


FIELD_HELP: dict[str, str] = _field_help()


def paper_config(arch: dict) -> config_dict.ConfigDict:
    """A config for the model `arch` (ModelConfig fields) with every section of SCHEMA at its default."""
    config = _section(SCHEMA[""])
    for section, fields in SCHEMA.items():
        if not section:
            continue
        *parents, name = section.split(".")
        parent = config
        for part in parents:
            parent = parent[part]
        parent[name] = controller.config_section() if fields is None else _section(fields)
        if section == "model":
            config.model.arch = config_dict.ConfigDict(arch)  # the architecture, when no path is given
    return config


# config.json is the run's whole config as it ran (written at every start, so a resume that raised
# `steps` records the new value); `load_run_config` reads it back as the ConfigDict that trains and
# evaluates the same way, so a run directory alone is enough to restore and evaluate it.
def save_run_config(cfg, output_dir: str) -> None:
    storage.write_text(storage.path(output_dir) / CONFIG_FILE, cfg.to_json_best_effort(indent=2, sort_keys=True))


def _tuples(value):
    """JSON arrays back to tuples: every sequence in this project's configs is a tuple."""
    if isinstance(value, dict):
        return {key: _tuples(item) for key, item in value.items()}
    return tuple(_tuples(item) for item in value) if isinstance(value, list) else value


def _with_defaults(values: dict, defaults: dict) -> dict:
    """`values` with every field of `defaults` it lacks added (nested sections merged); its own values win."""
    merged = dict(values)
    for name, default in defaults.items():
        if name not in merged:
            merged[name] = default
        elif isinstance(default, dict) and isinstance(merged[name], dict):
            merged[name] = _with_defaults(merged[name], default)
    return merged


def load_run_config(run_dir: str):
    """The ml_collections ConfigDict a run trained with (`<run_dir>/config.json`). Fields added to
    the project after the run was written take their defaults (`paper_config`),
    so `--config.<new field>=` overrides and evaluation work on older runs too."""
    path = storage.path(run_dir) / CONFIG_FILE
    if not path.exists():
        raise FileNotFoundError(
            f"{path} does not exist: {run_dir} is not a training run's output_dir "
            "(launch/train.py writes config.json there when it starts; for a run without one, "
            "pass the config it trained with: --config=<file> and its overrides)"
        )
    try:
        values = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not valid JSON ({error})") from error
    arch = values.get("model", {}).get("arch", {}) if isinstance(values, dict) else {}
    return ml_collections.ConfigDict(_tuples(_with_defaults(values, paper_config(arch).to_dict())))
