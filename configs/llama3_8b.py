"""Llama-3.1-8B-Instruct, the paper's transfer backbone. Training sections: appendix C's primary configuration (comppo_jax/train/paper.py).

Usage: --config=configs/llama3_8b.py --config.model.path=/path/to/Llama-3.1-8B-Instruct
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
            rope_scaling=dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192),
            tie_word_embeddings=False,
            max_position_embeddings=131072,
            dtype="bfloat16",
            bos_token_id=128000,
            eos_token_ids=(128001, 128008, 128009),
        )
    )
    add_training_sections(config)
    # The paper's minibatch of 4 responses is split over 4 FSDP shards; the remaining chips
    # (-1) split heads and MLP width (tensor parallelism). Override for other slices.
    config.mesh.update(data=1, fsdp=4, tensor=-1)
    return config
