"""Qwen3-4B, the paper's primary backbone. Training sections: appendix C's primary configuration
(comppo_jax/train/schema.py).

Usage: --config=configs/qwen3_4b.py (the model and DAPO-Math-17K by hub id; --config.model.path= and
--config.data.path= take a local or gs:// path instead)
"""

from comppo_jax.train.schema import paper_config


def get_config():
    config = paper_config(
        dict(
            architecture="qwen3",
            vocab_size=151936,
            hidden_size=2560,
            intermediate_size=9728,
            num_layers=36,
            num_heads=32,
            num_kv_heads=8,
            head_dim=128,
            rms_norm_eps=1e-6,
            rope_theta=1_000_000.0,
            tie_word_embeddings=True,
            max_position_embeddings=40960,
            dtype="bfloat16",
            bos_token_id=151643,
            eos_token_ids=(151645, 151643),  # <|im_end|>, <|endoftext|>
        )
    )
    # By hub id, fetched at the start (HF_HOME) and pinned to its commit in the run's config.json; a local or
    # gs:// path works too.
    config.model.path = "Qwen/Qwen3-4B"
    config.data.path = "BytedTsinghua-SIA/DAPO-Math-17k"
    return config
