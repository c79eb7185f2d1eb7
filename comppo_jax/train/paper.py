"""The paper's training settings (appendix C, "Primary configuration" and the controller), as
ml_collections sections shared by the presets. Presets call `paper_config(arch)` with their
`model.arch` and override what differs (configs/tiny.py overrides most of it for a CPU run).
"""

from __future__ import annotations

from ml_collections import config_dict

from comppo_jax.train import controller


def paper_config(arch: dict) -> config_dict.ConfigDict:
    """A config for the model `arch` (ModelConfig fields) with the paper's model, method, data,
    rollout, train, critic, reward, controller, mesh, checkpoint, eval and output sections."""
    section = lambda **kw: config_dict.ConfigDict(kw)
    config = config_dict.ConfigDict()
    config.seed = 0
    # model.path: a local HF checkpoint directory (config.json + *.safetensors). Required (no random
    # 4B/8B init by accident); nothing is downloaded. tokenizer "" = the one saved with model.path.
    # attention / remat / logits_chunk: how the model runs at 16K tokens (comppo_jax.models.attention;
    # jax.checkpoint policy per scanned layer; response tokens per chunk of the vocabulary projection).
    config.model = section(path="", path_required=True, tokenizer="", arch=section(**arch), attention="auto", remat="full",
                           logits_chunk=1024)
    config.output_dir = "runs/default"
    config.progress = True
    # Algorithm: comppo | grpo | ppo; CompPO's gate control: attention | fixed | shuffle | position.
    config.method = "comppo"
    config.gate = "attention"
    config.position_schedule = ""  # JSON written by comppo_jax.credit.save_position_schedule (a run's gate_profile.json)
    config.fixed_gate = 0.61  # the fixed control's constant: the full method's empirical mean gate (section 6.3)
    config.gate_envelope = section(kappa_lo=0.1, kappa_hi=0.9, tau=4.0)  # eq. kappa_attention
    config.steps = 200
    # DAPO-Math-17K from a local parquet/jsonl; the 500-problem ID dev split drives the controller.
    config.data = section(kind="dapo_math", path="", train_size=0, dev_size=500, min_steps=0, max_steps=0, operations="")
    # cache_dir: where a warm-started policy is kept, keyed by everything it depends on, so runs that
    # differ only after the warm start (an experiment's arms) compute it once.
    config.warm_start = section(steps=0, batch_size=0, learning_rate=0.0, answer_noise=0.0, cache_dir="")
    # Batch / responses / minibatch 4 / 4 / 4 (minibatch counted in responses); 16K responses;
    # temperature / top-p 1.0 / 0.7.
    # The rollout engine (comppo_jax.rollout.engine): KV pages of page_size tokens; decode_slots
    # rows decoded at once (0: every row; fewer bounds the cache and reuses slots as rows end);
    # paged_attention "auto" is the TPU / GPU Pallas kernel on those platforms, XLA elsewhere.
    config.rollout = section(prompts_per_step=4, samples_per_prompt=4, max_new_tokens=16384, temperature=1.0, top_p=0.7,
                             window="response", page_size=64, decode_slots=0, paged_attention="auto")
    # Actor LR 1e-6, critic LR 1e-5, KL 2e-3 (GRPO 1e-3), lambda 0.95. Clip 0.2, grad clip 1 and
    # 2 epochs are the controller's stable-phase knobs. AdamW (0.9, 0.999), weight decay 0.
    # master_dtype: the actor's trained copy (fp32 master weights under bf16 compute).
    # max_skipped_updates: updates skipped for non-finite rewards, values, advantages, losses or
    # gradient norms (params unchanged) in a row before the run stops (docs/reliability.md).
    # critic_warmup_steps: critic-only steps before the actor's first update. They come on top of
    # `steps` (every method gets `steps` actor updates) unless critic_warmup_counts_toward_steps,
    # the paper's literal reading, where a critic method then gets steps - 10 actor updates.
    config.train = section(actor_lr=1e-6, critic_lr=1e-5, kl_coef=2e-3, kl_coef_grpo=1e-3, lam=0.95, minibatch_size=4,
                           critic_warmup_steps=10, critic_warmup_counts_toward_steps=False, eval_every=10, master_dtype="float32",
                           max_skipped_updates=3)
    # TAC (paper section 4.3): the last `fused_layers` HF hidden states are fused; `bottleneck` is
    # d; `top_k` routed positions per token (K = 64). kind "standard" = the linear value head.
    config.critic = section(kind="tac", fused_layers=4, bottleneck=128, top_k=64, eps=1e-6, query_block=128)
    # Rewards (comppo_jax.data.rewards; schedule: comppo_jax.train.controller.RewardSchedule). Only
    # correct, well-formed responses pay for length. length_penalty "linear": the paper's per-token
    # coefficient (3e-5 -> 8e-5 over steps 20-60; at 8e-5 a correct answer of 12,500 tokens or more
    # reaches 0); "overlong": DAPO's soft overlong punishment, 0 up to max_new_tokens -
    # overlong_buffer, then a ramp to overlong_penalty at max_new_tokens (ramped in by the same
    # schedule). correct_never_below_incorrect keeps a correct answer's reward >= 0 (an incorrect one's).
    config.reward = section(workers=8, timeout_s=5.0, length_penalty="linear", overlong_buffer=4096, overlong_penalty=1.0,
                            correct_never_below_incorrect=True)
    # Phase controller (comppo_jax.train.controller; its docstring has each signal's unit and the
    # table of thresholds). thresholds "calibrated": entropy relative to the run's own baseline and
    # KL loss on the token-mean k3's scale; "paper_literal": appendix C's numbers as printed.
    # phase0_drift "none": the stable phase keeps the stable knobs; "warning": steps 25-40 drift
    # them to the warning knobs for good (the literal reading). Every ControllerConfig field is here
    # (e.g. --config.controller.kl_loss_at_least="(0.1, 0.2, 0.4)"); those left None come from `thresholds`.
    config.controller = controller.config_section()
    # (data, fsdp, tensor) device mesh, -1 = all remaining devices (comppo_jax.sharding). The
    # minibatch of 4 responses is split over 4 FSDP shards; the remaining chips split heads and MLP
    # width (tensor parallelism). Multi-host runs set distributed=True (TPU pods need no address).
    config.mesh = section(data=1, fsdp=4, tensor=-1, distributed=False, coordinator_address="", num_processes=0, process_id=0)
    # Async Orbax checkpoints every `every` steps and at the end: the last `keep_last` plus the
    # `keep_best` best by dev accuracy. resume=True continues the run in output_dir exactly.
    # Every checkpoint carries per-leaf content digests, verified on restore: resume falls back to
    # the newest checkpoint that verifies unless resume_step (>= 0) names one.
    config.checkpoint = section(every=10, keep_last=2, keep_best=1)
    config.resume = False
    config.resume_step = -1
    # launch/eval.py: frozen benchmarks as "name=path,..." (loaders: comppo_jax.data.datasets.BENCHMARKS),
    # majority@samples with the rollout temperature / top-p.
    config.eval = section(benchmarks="", samples=8, batch_size=32)
    config.tensorboard = True
    config.plot = True  # curves.png at the end
    return config
