"""Qwen3-4B, the paper's primary backbone. Training sections: appendix C's primary configuration (comppo_jax/train/paper.py).

Usage: --config=configs/qwen3_4b.py --config.model.path=/path/to/Qwen3-4B
"""

from ml_collections import config_dict

from comppo_jax.train.paper import add_training_sections


def get_config():
    config = config_dict.ConfigDict()
    config.seed = 0
    config.model = config_dict.ConfigDict()
    config.model.path = ""  # local HF checkpoint directory (config.json + *.safetensors); required
    config.model.arch = config_dict.ConfigDict(
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
    add_training_sections(config)
    # The paper's minibatch of 4 responses is split over 4 FSDP shards; the remaining chips
    # (-1) split heads and MLP width (tensor parallelism). Override for other slices.
    config.mesh.update(data=1, fsdp=4, tensor=-1)
    return config
