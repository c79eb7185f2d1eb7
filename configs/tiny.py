"""The embedded default: CompPO with a 4-layer Qwen3-shaped model on the synthetic arithmetic task.

A supervised warm start on the task's worked solutions gives an imperfect, non-zero policy; then
60 RL steps on a laptop CPU (about 4 minutes on 2 cores; docs/benchmarks.md#tiny-default-run).
`model.path` empty means random init from `model.arch`; set it to load an HF checkpoint.
"""

from comppo_jax.train.schema import paper_config


def get_config():
    config = paper_config(
        dict(
            architecture="qwen3",
            vocab_size=128,
            hidden_size=128,
            intermediate_size=384,
            num_layers=4,
            num_heads=4,
            num_kv_heads=2,
            head_dim=32,
            rms_norm_eps=1e-6,
            rope_theta=10000.0,
            tie_word_embeddings=True,
            max_position_embeddings=1024,
            dtype="float32",
            # The character tokenizer's ids (comppo_jax.data.tokenizers.CharTokenizer).
            bos_token_id=1,
            eos_token_ids=(2,),
            pad_token_id=0,
        )
    )
    # The paper's sections (comppo_jax.train.schema), overridden below for a few CPU minutes.
    config.model.path_required = False
    # Short sequences: no remat and one vocabulary pass are fastest and fit easily.
    config.model.update(remat="none", logits_chunk=0)
    config.mesh.update(data=-1, fsdp=1, tensor=1)  # every local device does data parallelism
    config.output_dir = "runs/tiny"
    config.steps = 60
    # Addition and subtraction only: a 4-layer model learns them well enough in a 1000-step warm start.
    config.data.update(
        kind="synthetic", path="", train_size=2000, dev_size=100, min_steps=2, max_steps=3, operations="+-"
    )
    # Supervised warm start on the task's solutions: RL starts from an imperfect, non-zero policy.
    # answer_noise: odd answers' warm-start Answer lines read answer + 1 with this probability
    # (comppo_jax.train.warm_start): a systematic, verifiable mistake RL can fix in minutes on a CPU.
    config.warm_start.update(steps=1000, batch_size=32, learning_rate=1e-3, answer_noise=0.7)
    config.rollout.update(prompts_per_step=16, max_new_tokens=40)
    config.train.update(
        actor_lr=1e-5, critic_lr=1e-3, kl_coef=1e-2, kl_coef_grpo=1e-2, minibatch_size=32, critic_warmup_steps=2
    )
    # 40-token answers after 10-20-token prompts fill their rows: packing would save no row here, and
    # its gathers cost on a CPU, so a batch packs only where that saves 1/8 of its rows (none does).
    config.train.packing_min_saving = 0.125
    config.reward.workers = 2
    config.critic.bottleneck = 32
    return config
