"""Critics: TAC (transport-aligned, paper section 4.3) and the standard value head."""

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

__all__ = [
    "CriticOutput",
    "Routing",
    "TransportAlignedCritic",
    "critic_from_config",
    "fuse_layers",
    "fused_hidden_layers",
    "init_standard_value_head",
    "init_tac",
    "mix_values",
    "pool_history",
    "routed_pool",
    "standard_value_head",
    "token_relevance",
    "value_refined_routing",
    "window_topk",
]
