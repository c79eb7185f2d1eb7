"""Qwen3-4B, the paper's primary backbone. Training sections: appendix C's primary configuration
(comppo_jax/train/paper.py).

Usage: --config=configs/qwen3_4b.py --config.model.path=/path/to/Qwen3-4B
"""

from comppo_jax.train.paper import paper_config


def get_config():
    return paper_config(
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
