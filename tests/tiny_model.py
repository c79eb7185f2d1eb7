"""The tests' tiny Qwen3-shaped policy, one definition for the test modules and the 8-device payload
scripts (tests/rollout/mesh_policy.py): 2 layers of width 32, 4 query heads over 2 KV heads of 8, a
64-token vocabulary with EOS 1 and padding 0, untied embeddings. A test changes a field by name."""

from comppo_jax.models import ModelConfig


def tiny_config(**fields) -> ModelConfig:
    """The tiny policy's config, `fields` replaced (e.g. num_layers=3, eos_token_ids=(6, 7))."""
    tiny = dict(
        architecture="qwen3",
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        tie_word_embeddings=False,
        eos_token_ids=(1,),
        pad_token_id=0,
    )
    return ModelConfig(**{**tiny, **fields})
