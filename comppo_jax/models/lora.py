"""Low-rank adapters (LoRA, Hu et al. 2021) beside the frozen base in the params pytree.

A target projection W [N, in, out] of `params["layers"]` gains `{W}_lora_a` [N, in, r] and
`{W}_lora_b` [N, r, out]; the layer computes

    x @ W + (alpha / r) * (x @ A) @ B

(PEFT's convention: `config.lora_alpha` / the rank r read from A's shape). B starts at zero, so
fresh adapters leave the base's function unchanged. Only the adapters train (`split` hands the
update the adapters and, apart, the frozen base); the reference policy is the base with the
adapters off (`base`), the same arrays, so no second copy of the weights exists. `merged` folds
the adapters into the base for decoding and export.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, PRNGKeyArray

from comppo_jax.models.config import ConfigError, ModelConfig
from comppo_jax.models.transformer import LORA_A as A
from comppo_jax.models.transformer import LORA_B as B
from comppo_jax.models.transformer import lora_scale, param_shapes

# model.lora.targets names -> the layer weights they adapt.
TARGETS = {
    "q": "q_proj",
    "k": "k_proj",
    "v": "v_proj",
    "o": "o_proj",
    "gate": "gate_proj",
    "up": "up_proj",
    "down": "down_proj",
}


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """A config's `model.lora`: rank 0 is full fine-tuning."""

    rank: int = 0
    alpha: float = 64.0
    targets: tuple[str, ...] = tuple(TARGETS)

    @classmethod
    def of(cls, model_section: Mapping[str, Any]) -> LoraConfig:
        """The `model.lora` section of a config (absent: full fine-tuning; comppo_jax.train.validation
        checks its fields); targets comma-separated."""
        section = model_section.get("lora")
        if section is None:
            return cls()
        return cls(int(section["rank"]), float(section["alpha"]), parse_targets(section["targets"]))

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def weights(self) -> tuple[str, ...]:
        """The adapted layer weights, e.g. ("q_proj", "v_proj")."""
        return tuple(TARGETS[name] for name in self.targets)


def parse_targets(text: str) -> tuple[str, ...]:
    """`model.lora.targets` ("q, v") as names of TARGETS; ConfigError naming the first other one."""
    targets = tuple(name.strip() for name in str(text).split(","))
    unknown = [name for name in targets if name not in TARGETS]
    if unknown:
        raise ConfigError(f"config.model.lora.targets: {unknown[0]!r} is not one of {', '.join(TARGETS)}")
    return targets


def adapter_shapes(config: ModelConfig, lora: LoraConfig) -> dict:
    """The adapters as shapes: {"layers": {"q_proj_lora_a": (N, D, r), "q_proj_lora_b": (N, r, E), ...}}."""
    layers = param_shapes(config)["layers"]
    shapes = {}
    for weight in lora.weights:
        n, fan_in, fan_out = layers[weight]
        shapes[weight + A], shapes[weight + B] = (n, fan_in, lora.rank), (n, lora.rank, fan_out)
    return {"layers": shapes}


def init_adapters(config: ModelConfig, lora: LoraConfig, rng: PRNGKeyArray, dtype: str = "float32") -> dict:
    """Fresh adapters: A ~ U(-1/sqrt(in), 1/sqrt(in)) (PEFT's Kaiming-uniform init), B = 0."""
    shapes = adapter_shapes(config, lora)["layers"]
    keys = dict(zip(sorted(shapes), jax.random.split(rng, len(shapes))))

    def make(name: str, shape: tuple[int, ...]) -> Array:
        if name.endswith(B):
            return jnp.zeros(shape, dtype)
        bound = 1.0 / math.sqrt(shape[1])
        return jax.random.uniform(keys[name], shape, jnp.float32, -bound, bound).astype(dtype)

    return {"layers": {name: make(name, shape) for name, shape in shapes.items()}}


def is_adapter(name: str) -> bool:
    return name.endswith(A) or name.endswith(B)


def has_adapters(params: dict) -> bool:
    return any(is_adapter(name) for name in params.get("layers", {}))


def split(params: dict) -> tuple[dict, dict | None]:
    """(what trains, what is frozen): (the adapters, the base) with adapters, else (params, None)."""
    if not has_adapters(params):
        return params, None
    layers = params["layers"]
    adapters = {"layers": {name: w for name, w in layers.items() if is_adapter(name)}}
    return adapters, base(params)


def base(params: dict) -> dict:
    """The params without their adapters (the same arrays): the base policy, the reference of a LoRA run."""
    if not has_adapters(params):
        return params
    return {**params, "layers": {name: w for name, w in params["layers"].items() if not is_adapter(name)}}


def join(frozen: dict | None, trainable: dict) -> dict:
    """`split`'s inverse: the base with the adapters beside it (`trainable` alone without a base)."""
    if frozen is None:
        return trainable
    return {**frozen, "layers": {**frozen["layers"], **trainable["layers"]}}


def trainable(params: dict) -> dict:
    """What a checkpoint of the actor holds and AdamW updates: the adapters, or every weight."""
    return split(params)[0]


def merged(params: dict, config: ModelConfig) -> dict:
    """The base with each adapter folded in, W + (alpha / r) A @ B in W's dtype (computed in
    float32): one set of weights computing what the base and adapters compute together."""
    if not has_adapters(params):
        return params
    layers = dict(base(params)["layers"])
    for name, lora_a in params["layers"].items():
        if name.endswith(A):
            weight = name[: -len(A)]
            update = jnp.einsum(
                "nir,nro->nio", lora_a.astype(jnp.float32), params["layers"][weight + B].astype(jnp.float32)
            )
            layers[weight] = (layers[weight].astype(jnp.float32) + lora_scale(config, lora_a) * update).astype(
                layers[weight].dtype
            )
    return {**params, "layers": layers}
