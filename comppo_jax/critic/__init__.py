"""Critics: TAC (transport-aligned, paper section 4.3), the standard value head and, for comparison,
the full-copy value model PPO usually trains."""

from comppo_jax.critic.routing import Routing, window_topk
from comppo_jax.critic.tac import (
    CriticOutput,
    TransportAlignedCritic,
    critic_from_config,
    fuse_layers,
    fused_hidden_layers,
    init_standard_value_head,
    init_tac,
    mix_values,
    pool_history,
    routed_pool,
    standard_value_head,
    token_relevance,
    value_refined_routing,
)
from comppo_jax.critic.value_model import init_value_model, value_model_values

__all__ = [
    "CriticOutput",
    "Routing",
    "TransportAlignedCritic",
    "critic_from_config",
    "fuse_layers",
    "fused_hidden_layers",
    "init_standard_value_head",
    "init_tac",
    "init_value_model",
    "mix_values",
    "pool_history",
    "routed_pool",
    "standard_value_head",
    "token_relevance",
    "value_model_values",
    "value_refined_routing",
    "window_topk",
]
