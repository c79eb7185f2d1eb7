"""Llama-3.1-8B-Instruct, the paper's transfer backbone. Training sections: appendix C's primary configuration
(comppo_jax/train/schema.py).

Usage: --config=configs/llama3_8b.py (the model, gated on the hub: HF_TOKEN, and DAPO-Math-17K by hub id;
--config.model.path= and --config.data.path= take a local or gs:// path instead)
"""

from comppo_jax.train.schema import paper_config


def get_config():
    config = paper_config(
        dict(
            architecture="llama",
            vocab_size=128256,
            hidden_size=4096,
            intermediate_size=14336,
            num_layers=32,
            num_heads=32,
            num_kv_heads=8,
            head_dim=128,
            rms_norm_eps=1e-5,
            rope_theta=500_000.0,
            rope_scaling=dict(
                factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
            ),
            tie_word_embeddings=False,
            max_position_embeddings=131072,
            dtype="bfloat16",
            bos_token_id=128000,
            eos_token_ids=(128001, 128008, 128009),
        )
    )
    # By hub id, fetched at the start (HF_HOME) and pinned to its commit in the run's config.json; a local or
    # gs:// path works too.
    config.model.path = "meta-llama/Llama-3.1-8B-Instruct"
    config.data.path = "BytedTsinghua-SIA/DAPO-Math-17k"
    return config
