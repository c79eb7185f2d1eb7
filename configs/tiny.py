"""The embedded default: a few-layer Qwen3-shaped model that runs on a laptop CPU.

`model.path` empty means random init from `model.arch`; set it to load an HF checkpoint.
"""

from ml_collections import config_dict


def get_config():
    config = config_dict.ConfigDict()
    config.seed = 0
    config.model = config_dict.ConfigDict()
    config.model.path = ""
    config.model.arch = config_dict.ConfigDict(
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
    # TAC (paper section 4.3): the last `fused_layers` HF hidden states are fused; `bottleneck` is
    # d; `top_k` routed positions per token (K = 64 in the paper). kind "standard" = linear head.
    config.critic = config_dict.ConfigDict(
        dict(kind="tac", fused_layers=4, bottleneck=32, top_k=64, eps=1e-6, query_block=128)
    )
    return config
