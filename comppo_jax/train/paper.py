"""The paper's training settings (appendix C, "Primary configuration" and the controller), as
ml_collections sections shared by the presets. Presets call `paper_config(arch)` with their
`model.arch` and override what differs (configs/tiny.py overrides most of it for a CPU run).

Every field is declared once, as `name=(default, "one-line description")`; the descriptions are
what `launch/train.py --help` lists beside each field of the loaded config (`FIELD_HELP`).
"""

from __future__ import annotations

from ml_collections import config_dict

from comppo_jax.sharding import COLLECTIVE_TIMEOUT_S
from comppo_jax.train import controller

# "section.field" -> one-line description, for every field paper_config declares.
FIELD_HELP: dict[str, str] = {}

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


def _section(prefix: str, **fields) -> config_dict.ConfigDict:
    """A ConfigDict of `name=(default, description)`; each description goes to FIELD_HELP[prefix + name]."""
    for name, (_, description) in fields.items():
        FIELD_HELP[prefix + name] = description
    return config_dict.ConfigDict({name: default for name, (default, _) in fields.items()})


def paper_config(arch: dict) -> config_dict.ConfigDict:
    """A config for the model `arch` (ModelConfig fields) with the paper's model, method, data,
    rollout, train, critic, reward, controller, mesh, checkpoint, eval and output sections."""
    config = _section(
        "",
        seed=(0, "seed of the params, data order, sampling and warm start"),
        output_dir=("runs/default", "where metrics.jsonl, tensorboard/, checkpoints/, summary.json and curves.png go"),
        progress=(True, "progress bars and first-call compile notices on the terminal"),
        method=("comppo", "comppo | grpo | ppo"),
        gate=("attention", "CompPO's gate control: attention | fixed | shuffle | position"),
        position_schedule=("", "the position-only control's JSON schedule (a run's gate_profile.json)"),
        fixed_gate=(0.61, "the fixed control's constant: the full method's empirical mean gate (section 6.3)"),
        gate_statistic=(
            "herfindahl",
            "the concentration statistic kappa reads: herfindahl (the paper's) | entropy | sink_herfindahl "
            "| max_weight (comppo_jax.credit.statistic_concentration)",
        ),
        sink_tokens=(
            4,
            "gate_statistic=sink_herfindahl: key positions at the window's start left out (attention sinks)",
        ),
        gate_refresh=(
            "rollout",
            "rollout (the paper's: the behaviour policy's gate serves every update epoch) | epoch (recomputed "
            "with the current actor before each later epoch; one forward pass per epoch)",
        ),
        steps=(
            200,
            "actor-update steps (the critic warm-up comes on top unless train.critic_warmup_counts_toward_steps)",
        ),
        resume=(False, "continue the run in output_dir from its newest checkpoint that verifies"),
        resume_step=(-1, "with resume: this checkpoint step instead (-1: the newest that verifies)"),
        resume_allow_changes=(
            "",
            "with resume: fields (or sections) that may differ from the run's config.json although they change "
            "what is computed, comma-separated; each change is recorded in config_changes.jsonl",
        ),
        loggers=(
            "jsonl,tensorboard",
            "where each step's metrics go, comma-separated: jsonl (metrics.jsonl, always on: resume, plots and "
            "launch/report.py read it) | tensorboard (output_dir/tensorboard) | wandb (Weights & Biases, the "
            "wandb extra; WANDB_MODE=offline logs under output_dir/wandb with no network)",
        ),
        plot=(True, "write curves.png at the end"),
    )
    config.model = _section(
        "model.",
        path=(
            "",
            "HF checkpoint (config.json + *.safetensors): a local directory, a gs:// one, or a hub id owner/name"
            "[@revision], fetched at the start and recorded in config.json pinned to its commit",
        ),
        path_required=(True, "refuse a random init of the preset's architecture when path is empty"),
        tokenizer=(
            "",
            'HF tokenizer: a local or gs:// directory or a hub id ("": the one saved with path; no path either: the '
            "character tokenizer)",
        ),
        attention=(
            "auto",
            "training attention: auto | xla | chunked | splash | splash_interpret | cudnn "
            "(comppo_jax.models.attention)",
        ),
        remat=("full", "per-layer jax.checkpoint policy: none | full | dots | dots_no_batch"),
        logits_chunk=(1024, "response tokens per chunk of the vocabulary projection (0: all at once)"),
    )
    config.model.arch = config_dict.ConfigDict(arch)  # the architecture, when no path is given
    config.model.lora = _section(
        "model.lora.",
        rank=(
            0,
            "LoRA rank (0: full fine-tuning): adapters train beside the frozen base, which is also the reference "
            "policy",
        ),
        alpha=(64.0, "LoRA scale numerator: the adapter term is (alpha / rank) * x @ A @ B (PEFT's lora_alpha)"),
        targets=("q,k,v,o,gate,up,down", "the adapted projections, comma-separated: any of q, k, v, o, gate, up, down"),
    )
    FIELD_HELP.update({f"model.arch.{name}": text for name, text in ARCH_HELP.items()})
    config.gate_envelope = _section(
        "gate_envelope.",
        kappa_lo=(0.1, "lowest retention gate (eq. kappa_attention)"),
        kappa_hi=(0.9, "highest retention gate (eq. kappa_attention)"),
        tau=(4.0, "gate temperature on the normalized concentration (eq. kappa_attention)"),
    )
    config.data = _section(
        "data.",
        kind=("dapo_math", "dapo_math (a local DAPO-Math-17K parquet/jsonl) | synthetic (chained arithmetic)"),
        path=("", "the dapo_math file: local or gs:// (.parquet, .jsonl), or a hub dataset id owner/name[@revision]"),
        train_size=(0, "synthetic: training problems"),
        dev_size=(500, "ID dev problems (they drive the controller and the best checkpoint)"),
        min_steps=(0, "synthetic: fewest chained operations per problem"),
        max_steps=(0, "synthetic: most chained operations per problem"),
        operations=("", "synthetic: the operators used, e.g. +-"),
    )
    # Runs that differ only after the warm start (an experiment's arms) share it through cache_dir.
    config.warm_start = _section(
        "warm_start.",
        steps=(0, "supervised steps on the task's worked solutions before RL (0: none)"),
        batch_size=(0, "warm-start batch size"),
        learning_rate=(0.0, "warm-start AdamW learning rate"),
        answer_noise=(0.0, "probability that an odd answer's warm-start Answer line reads answer + 1"),
        cache_dir=(
            "",
            'where a warm-started policy is kept, keyed by everything it depends on ("": output_dir, for this run '
            "alone: a stop after the warm start, or a lost reference/, reuses it)",
        ),
    )
    # Batch / responses / minibatch 4 / 4 / 4 (minibatch counted in responses); 16K responses;
    # temperature / top-p 1.0 / 0.7.
    config.rollout = _section(
        "rollout.",
        prompts_per_step=(4, "prompts sampled per step"),
        samples_per_prompt=(4, "responses per prompt (the GRPO group)"),
        max_new_tokens=(16384, "longest response"),
        temperature=(1.0, "sampling temperature"),
        top_p=(0.7, "nucleus sampling mass"),
        window=("response", "the keys H_t is taken over: response (the response so far) | full (prompt and response)"),
        page_size=(64, "tokens per KV-cache page of the rollout engine"),
        decode_slots=(0, "rows decoded at once (0: every row; fewer bounds the cache and reuses slots as rows end)"),
        paged_attention=(
            "auto",
            "decode attention: auto (the Pallas kernel on TPU / GPU, XLA elsewhere) | xla | tpu | tpu_interpret | "
            "gpu | gpu_interpret",
        ),
        old_log_probs=(
            "rescore",
            "the behaviour log-probs of the PPO ratio: rescore (teacher-forced in the scoring pass) | sampler "
            "(recorded while sampling; GRPO then skips the behaviour forward pass and logs no gate statistics)",
        ),
        dynamic_sampling=(
            False,
            "DAPO's dynamic sampling: drop uninformative prompt groups (dynamic_sampling_filter) and refill "
            "the batch from the prompt stream",
        ),
        dynamic_sampling_filter=(
            "accuracy",
            "dynamic_sampling drops a group whose verdicts are all correct or all wrong: accuracy "
            "(DAPO's) | reward (whose shaped rewards are all equal)",
        ),
        max_refills=(
            3,
            "dynamic_sampling: extra sampling rounds per step at most; groups still missing then are filled with "
            "dropped ones (-1: draw until the batch is full, stopping the run if a whole pass over the training "
            "prompts cannot fill it, as DAPO)",
        ),
        staleness=(
            0,
            "bounded staleness k: batch n is generated and behaviour-scored by the policy after update "
            "max(0, n-1-k), so the rollout of later batches runs during earlier updates (0: the synchronous loop)",
        ),
    )
    # The sampler's own layout (comppo_jax.train.decode_layout): weights split over a tensor-parallel
    # group, replicated over the rest, moved there once per step.
    config.rollout.mesh = _section(
        "rollout.mesh.",
        tensor=(
            "auto",
            "the decode layout: devices per tensor-parallel group, the group replicated over the rest and the rows "
            "split across replicas (auto: the fastest by the decode cost model that fits; train: decode on the "
            "training mesh, gathering the fsdp-split weights at every token)",
        ),
    )
    # Clip 0.2, grad clip 1 and 2 epochs are the controller's stable-phase knobs. AdamW (0.9, 0.999), weight decay 0.
    config.train = _section(
        "train.",
        actor_lr=(1e-6, "actor AdamW learning rate"),
        critic_lr=(1e-5, "critic AdamW learning rate"),
        kl_coef=(2e-3, "KL-to-reference coefficient (PPO, CompPO; 0: no KL term and no reference forward pass)"),
        kl_coef_grpo=(1e-3, "KL-to-reference coefficient (GRPO; 0: no KL term and no reference forward pass)"),
        lam=(0.95, "GAE / Comp-GAE lambda"),
        policy_loss=(
            "ppo",
            "the actor's surrogate: ppo (per-token ratio, eq. ppo_outer) | gspo (one length-normalized ratio per "
            "response; GRPO only) | gspo_token (GSPO's ratio carrying per-token advantages)",
        ),
        loss_aggregation=(
            "auto",
            "auto (the variant's own: seq-mean-token-mean for gspo / gspo_token, seq-mean-token-scale "
            "without the group std (Dr.GRPO), else token-mean) | token-mean (the paper's, DAPO's) | "
            "seq-mean-token-mean (GSPO's) | seq-mean-token-sum | seq-mean-token-sum-norm (verl's Dr.GRPO: "
            "all token sums / max_new_tokens) | seq-mean-token-scale (Dr.GRPO's own and tunix's: the mean "
            "over responses of token sums / max_new_tokens)",
        ),
        kl_aggregation=(
            "token-mean",
            "how the reference KL is aggregated: token-mean | policy (as the policy loss, verl's)",
        ),
        gspo_clip_low=(
            3e-4,
            "gspo, gspo_token: the sequence ratio's lower clip (GSPO's; the controller's clip does not apply)",
        ),
        gspo_clip_high=(4e-4, "gspo, gspo_token: the sequence ratio's upper clip (GSPO's)"),
        clip_high_scale=(
            1.0,
            "DAPO's decoupled clip: the ratio's upper clip is this times the controller's clip (1.4: DAPO's 0.28/0.2)",
        ),
        group_std_normalization=(True, "GRPO: divide by the group's reward std (False: Dr.GRPO)"),
        minibatch_size=(4, "responses per minibatch"),
        critic_warmup_steps=(10, "critic-only steps before the actor's first update"),
        critic_warmup_counts_toward_steps=(False, "the paper's literal reading: the warm-up is part of steps"),
        eval_every=(10, "dev evaluation every this many actor-update steps (0: none)"),
        master_dtype=("float32", "the actor's trained copy (fp32 master weights under bf16 compute)"),
        max_skipped_updates=(3, "non-finite updates skipped in a row before the run stops (docs/reliability.md)"),
        offload_idle=(
            False,
            "keep idle state in host memory: the AdamW moments outside the update, the reference between "
            "scoring passes, the rollout batch during the update (launch/plan.py shows the HBM freed and the "
            "transfer time)",
        ),
        proximal=(
            "behaviour",
            "the policy the PPO ratio is clipped against: behaviour (the generating policy, the paper's) | "
            "recompute (AReaL's decoupled objective: a proximal policy recomputed with the current params "
            "before the update, importance weights behaviour -> proximal capped at importance_weight_cap)",
        ),
        importance_weight_cap=(5.0, "proximal=recompute: the cap on the behaviour -> proximal importance weight"),
        importance_weight_rule=(
            "mask",
            "proximal=recompute: a weight over the cap: mask (its token dropped from the loss, AReaL's "
            "behav_imp_weight_cap) | truncate (min(w, cap), truncated importance sampling)",
        ),
    )
    config.critic = _section(
        "critic.",
        kind=(
            "tac",
            "tac (paper section 4.3) | standard (a linear value head) | full (a copy of the policy with a value "
            "head, all of it trained: PPO's usual critic, for comparison). PPO takes standard unless full",
        ),
        fused_layers=(4, "TAC: the last this many HF hidden states are fused"),
        bottleneck=(128, "TAC: width d"),
        top_k=(64, "TAC: routed positions per token (K)"),
        eps=(1e-6, "TAC: normalization epsilon"),
        query_block=(128, "TAC: query positions per routing block"),
    )
    # Only correct, well-formed responses pay for length (comppo_jax.data.rewards; the schedule:
    # comppo_jax.train.controller.RewardSchedule, 3e-5 -> 8e-5 per token over steps 20-60).
    config.reward = _section(
        "reward.",
        workers=(8, "math-verify worker processes"),
        timeout_s=(5.0, "seconds a verification may take before it counts as incorrect"),
        length_penalty=(
            "linear",
            "linear (the paper's per-token coefficient) | overlong (DAPO's soft overlong punishment)",
        ),
        overlong_buffer=(4096, "overlong: tokens before max_new_tokens where the penalty ramps in"),
        overlong_penalty=(1.0, "overlong: the penalty at max_new_tokens"),
        correct_never_below_incorrect=(True, "a correct answer's reward stays >= an incorrect one's"),
        length_penalty_on=(
            "correct",
            "who pays the length penalty: correct (the paper's: correct, well-formed responses) | all "
            "(DAPO's overlong shaping: every response)",
        ),
        length_penalty_schedule=(
            "paper",
            "paper (off before step 20, ramped in over steps 20-60) | constant (its full value from "
            "step 0, as DAPO's overlong shaping)",
        ),
    )
    config.controller = controller.config_section()
    FIELD_HELP.update({f"controller.{name}": text for name, text in controller.FIELD_HELP.items()})
    # The minibatch of 4 responses is split over 4 FSDP shards; the remaining chips split heads and
    # MLP width (tensor parallelism). TPU pods need no coordinator address.
    config.mesh = _section(
        "mesh.",
        data=(1, "data-parallel axis size (-1: the remaining devices)"),
        fsdp=(4, "FSDP axis size (-1: the remaining devices)"),
        tensor=(-1, "tensor-parallel axis size (-1: the remaining devices)"),
        distributed=(False, "multi-host: call jax.distributed.initialize"),
        coordinator_address=("", 'multi-host: host:port of process 0 ("": found by JAX, e.g. on TPU pods)'),
        num_processes=(0, "multi-host: processes (0: found by JAX)"),
        process_id=(0, "multi-host: this process's index"),
        collective_timeout_s=(
            COLLECTIVE_TIMEOUT_S,
            "multi-process on the CPU backend: seconds a gloo collective waits for its peers before it fails",
        ),
        rollout_devices=(
            0,
            "devices of every process the rollout stage runs on, training on the rest (0: both on every device)",
        ),
    )
    # Every checkpoint carries per-leaf content digests, verified on restore.
    config.checkpoint = _section(
        "checkpoint.",
        every=(10, "async Orbax checkpoint every this many steps (and at the end)"),
        keep_last=(2, "newest checkpoints kept"),
        keep_best=(1, "best checkpoints by dev accuracy kept"),
    )
    # Responses kept with their per-token credit for launch/report.py (comppo_jax.train.samples).
    config.outputs = _section(
        "outputs.",
        sample_every=(
            0,
            "keep sampled responses with their per-token gate, advantages and values every this many steps "
            "(0: at each dev evaluation, train.eval_every; -1: never), one file per step under output_dir/samples",
        ),
        samples_per_step=(4, "responses kept per such step (spread over the batch)"),
        sample_tokens=(
            2048,
            "most tokens kept of one response (its first and last halves beyond that), which bounds a step's file",
        ),
    )
    config.eval = _section(
        "eval.",
        benchmarks=("", "launch/eval.py: frozen benchmarks as name=path,... (comppo_jax.data.datasets.BENCHMARKS)"),
        samples=(8, "launch/eval.py: responses n per problem for avg@n, pass@k and majority@n"),
        temperature=(1.0, "launch/eval.py: sampling temperature of those responses (0: greedy)"),
        top_p=(0.7, "launch/eval.py: nucleus mass of those responses"),
        pass_k=("", 'launch/eval.py: the k of pass@k, e.g. 1,4,16 ("": 1 and samples)'),
        batch_size=(32, "launch/eval.py: problems per batch"),
    )
    return config
