"""Pure-functional Qwen3 / Llama-3.x decoder.

Params are a plain dict of arrays; the decoder layers are stacked on a leading axis
[num_layers, ...] and run under `jax.lax.scan` (unrolled on CPU, `scan_layers`):

    embed [V, D]; final_norm [D]; lm_head [D, V] (absent when tied)
    layers: attn_norm [N, D], q_proj [N, D, Hq*hd], k_proj / v_proj [N, D, Hkv*hd],
            o_proj [N, Hq*hd, D], q_norm / k_norm [N, hd] (Qwen3 only), mlp_norm [N, D],
            gate_proj / up_proj [N, D, F], down_proj [N, F, D]

LoRA adapters, when present, sit beside the weight they adapt (`q_proj_lora_a` [N, D, r],
`q_proj_lora_b` [N, r, Hq*hd], ...; comppo_jax.models.lora). Matrices are stored [in, out] (x @ W).
Matmuls run in `config.dtype` with float32 accumulation; RMSNorm, RoPE, softmax and the logits are
float32.

Memory at long lengths: attention runs `config.attention` (comppo_jax.models.attention: splash on
TPU, cuDNN on GPU, chunked flash attention in XLA on CPU), each scanned layer is rematerialized
with the `config.remat` policy, and `compute_logits=False` skips the [B, L, V] logits so callers
can project the vocabulary chunk by chunk (comppo_jax.rollout.scoring.response_token_stats).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P
from jax.typing import DTypeLike
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray, Shaped

import pallas_kernels
from comppo_jax import sharding
from comppo_jax.models.attention import training_attention
from comppo_jax.models.config import ModelConfig
from comppo_jax.models.quantize import SCALE

# config.remat -> what a rematerialized layer keeps for the backward pass (None: no remat).
REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_saveable,
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


class FinalAttention(NamedTuple):
    """The final layer's attention inputs, detached: enough to recompute its probabilities blockwise."""

    q: Float[Array, "B L Hq hd"]  # after q-norm and RoPE, config.dtype
    k: Float[Array, "B L Hkv hd"]  # after k-norm and RoPE, config.dtype
    lse: Float[Array, "B Hq L"]  # float32, per-head log-sum-exp of the scaled causal logits


class ForwardOutput(NamedTuple):
    logits: Float[Array, "B L V"] | None  # float32 (None with compute_logits=False)
    hidden_states: Float[Array, "K B L D"]  # the requested `hidden_layers` (HF indexing)
    herfindahl: Float[Array, "B L"] | None  # float32, final-layer concentration (None without window_start)
    window_size: Int[Array, "B L"] | None  # int32, n for the same window
    final_attention: FinalAttention | None = None  # with return_final_attention=True
    # {name: [B, L] float32}, the `concentration_statistics` asked for
    statistics: dict[str, Float[Array, "B L"]] | None = None


def param_shapes(config: ModelConfig) -> dict:
    """The params pytree as shapes (tuples), for init, loading and checks."""
    n, d, f, hd = config.num_layers, config.hidden_size, config.intermediate_size, config.head_dim
    layers = {
        "attn_norm": (n, d),
        "q_proj": (n, d, config.num_heads * hd),
        "k_proj": (n, d, config.num_kv_heads * hd),
        "v_proj": (n, d, config.num_kv_heads * hd),
        "o_proj": (n, config.num_heads * hd, d),
        "mlp_norm": (n, d),
        "gate_proj": (n, d, f),
        "up_proj": (n, d, f),
        "down_proj": (n, f, d),
    }
    if config.qk_norm:
        layers.update(q_norm=(n, hd), k_norm=(n, hd))
    shapes = {"embed": (config.vocab_size, d), "layers": layers, "final_norm": (d,)}
    if not config.tie_word_embeddings:
        shapes["lm_head"] = (d, config.vocab_size)
    return shapes


@functools.partial(jax.jit, static_argnums=(0, 2))  # one program, not an eager op per leaf
def init_params(config: ModelConfig, rng: PRNGKeyArray, init_std: float = 0.02) -> dict:
    """Random params: N(0, init_std) matrices, unit norm weights, in `config.dtype`."""
    shapes = param_shapes(config)
    is_shape = lambda x: isinstance(x, tuple)
    keys = iter(jax.random.split(rng, len(jax.tree.leaves(shapes, is_leaf=is_shape))))
    dtype = jnp.dtype(config.dtype)

    def make(path: tuple[Any, ...], shape: tuple[int, ...]) -> Array:
        key = next(keys)
        if "norm" in jax.tree_util.keystr(path):
            return jnp.ones(shape, dtype)
        # the barrier keeps the draw's rounding what it is outside this jit
        return (init_std * jax.lax.optimization_barrier(jax.random.normal(key, shape, jnp.float32))).astype(dtype)

    return jax.tree_util.tree_map_with_path(make, shapes, is_leaf=is_shape)


def rms_norm(x: Float[Array, "*batch D"], weight: Float[Array, " D"], eps: float) -> Float[Array, "*batch D"]:
    """RMSNorm with float32 statistics; returns x's dtype."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + eps)
    return (normed * weight.astype(jnp.float32)).astype(x.dtype)


def rope_inv_freq(config: ModelConfig) -> np.ndarray:
    """Rotary inverse frequencies [hd/2], with the llama3 rescaling when configured."""
    inv_freq = 1.0 / (config.rope_theta ** (np.arange(0, config.head_dim, 2, dtype=np.float64) / config.head_dim))
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq.astype(np.float32)
    old_context = scaling.original_max_position_embeddings
    wavelen = 2 * math.pi / inv_freq
    low_freq_wavelen = old_context / scaling.low_freq_factor
    high_freq_wavelen = old_context / scaling.high_freq_factor
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_context / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def apply_rope(
    x: Float[Array, "B L H hd"], positions: Int[Array, "B L"], inv_freq: Float[Array, " hd//2"]
) -> Float[Array, "B L H hd"]:
    """Rotate-half RoPE (HF convention). x [B, L, H, hd]; positions [B, L]."""
    angles = positions[..., None].astype(jnp.float32) * inv_freq  # [B, L, hd/2]
    cos = jnp.concatenate([jnp.cos(angles)] * 2, axis=-1)[:, :, None, :]
    sin = jnp.concatenate([jnp.sin(angles)] * 2, axis=-1)[:, :, None, :]
    x32 = x.astype(jnp.float32)
    first, second = jnp.split(x32, 2, axis=-1)
    rotated = jnp.concatenate([-second, first], axis=-1)
    return (x32 * cos + rotated * sin).astype(x.dtype)


def _project(
    x: Float[Array, "B L D"], weight: Shaped[Array, "D E"], scale: Float[Array, " E"] | None = None
) -> Float[Array, "B L E"]:
    """x @ W with float32 accumulation; an 8-bit W (comppo_jax.models.quantize) times its
    per-output-channel `scale` on the accumulator."""
    y = jnp.einsum("bld,de->ble", x, weight.astype(x.dtype), preferred_element_type=jnp.float32)
    return (y if scale is None else y * scale).astype(x.dtype)


def embed_tokens(params: dict, tokens: Int[Array, "*B"], dtype: DTypeLike) -> Float[Array, "*B D"]:
    """The embedding rows of `tokens` in `dtype` (an 8-bit table's rows times their scales)."""
    rows = params["embed"][tokens]
    scale = params.get("embed" + SCALE)
    return (rows if scale is None else rows.astype(jnp.float32) * scale[tokens][..., None]).astype(dtype)


# A LoRA adapter of layer weight W sits beside it as W + LORA_A [in, r] and W + LORA_B [r, out]
# (comppo_jax.models.lora); the layer adds (alpha / r) * (x @ A) @ B to x @ W.
LORA_A, LORA_B = "_lora_a", "_lora_b"


def lora_scale(config: ModelConfig, lora_a: Float[Array, "*N D r"]) -> float:
    """alpha / r (PEFT's scaling) for an adapter whose A has rank r on its last axis."""
    return config.lora_alpha / lora_a.shape[-1]


def _adapted(
    y: Float[Array, "B L E"], x: Float[Array, "B L D"], layer: dict[str, Array], name: str, config: ModelConfig
) -> Float[Array, "B L E"]:
    """y = x @ W plus W's low-rank adapter term, when W = layer[name] has one."""
    if name + LORA_A not in layer:
        return y
    low_rank = _project(_project(x, layer[name + LORA_A].astype(x.dtype)), layer[name + LORA_B].astype(x.dtype))
    return y + (low_rank * lora_scale(config, layer[name + LORA_A])).astype(y.dtype)


def _linear(x: Float[Array, "B L D"], layer: dict[str, Array], name: str, config: ModelConfig) -> Float[Array, "B L E"]:
    return _adapted(_project(x, layer[name], layer.get(name + SCALE)), x, layer, name, config)


def _qkv(
    layer: dict[str, Array],
    x: Float[Array, "B L D"],
    positions: Int[Array, "B L"],
    config: ModelConfig,
    inv_freq: Float[Array, " hd//2"],
) -> tuple[Float[Array, "B L Hq hd"], Float[Array, "B L Hkv hd"], Float[Array, "B L Hkv hd"]]:
    batch, length, _ = x.shape
    hd = config.head_dim
    if "qkv_proj" in layer:  # one matmul (`fuse_projections`)
        fused = jnp.split(
            _project(x, layer["qkv_proj"], layer.get("qkv_proj" + SCALE)),
            np.cumsum([config.num_heads * hd, config.num_kv_heads * hd]),
            axis=-1,
        )
        q, k, v = (_adapted(y, x, layer, name, config) for y, name in zip(fused, ("q_proj", "k_proj", "v_proj")))
    else:
        q, k, v = (_linear(x, layer, name, config) for name in ("q_proj", "k_proj", "v_proj"))
    q = q.reshape(batch, length, config.num_heads, hd)
    k = k.reshape(batch, length, config.num_kv_heads, hd)
    v = v.reshape(batch, length, config.num_kv_heads, hd)
    if config.qk_norm:
        q = rms_norm(q, layer["q_norm"], config.rms_norm_eps)
        k = rms_norm(k, layer["k_norm"], config.rms_norm_eps)
    return apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq), v


def _mlp(layer: dict[str, Array], x: Float[Array, "B L D"], config: ModelConfig) -> Float[Array, "B L D"]:
    if "gate_up_proj" in layer:  # one matmul (`fuse_projections`)
        gate, up = (
            _adapted(y, x, layer, name, config)
            for y, name in zip(
                jnp.split(_project(x, layer["gate_up_proj"], layer.get("gate_up_proj" + SCALE)), 2, axis=-1),
                ("gate_proj", "up_proj"),
            )
        )
    else:
        gate, up = _linear(x, layer, "gate_proj", config), _linear(x, layer, "up_proj", config)
    return _linear(jax.nn.silu(gate) * up, layer, "down_proj", config)


_Statistics = TypeVar("_Statistics")


def _decoder_layer(
    layer: dict[str, Array],
    x: Float[Array, "B L D"],
    positions: Int[Array, "B L"],
    config: ModelConfig,
    inv_freq: Float[Array, " hd//2"],
    attention: Callable[[Array, Array, Array], tuple[Array, _Statistics]],
) -> tuple[Float[Array, "B L D"], _Statistics]:
    """One pre-norm block; `attention(q, k, v)` returns (out, final-layer statistics)."""
    batch, length, _ = x.shape
    q, k, v = _qkv(layer, rms_norm(x, layer["attn_norm"], config.rms_norm_eps), positions, config, inv_freq)
    attn, statistics = attention(q, k, v)
    x = x + _linear(attn.reshape(batch, length, -1), layer, "o_proj", config)
    x = x + _mlp(layer, rms_norm(x, layer["mlp_norm"], config.rms_norm_eps), config)
    return x, statistics


FUSED_PROJECTIONS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def fuse_projections(layers: dict) -> dict:
    """`layers` (stacked [N, D, E] or one layer's [D, E]) with q/k/v joined into `qkv_proj` and
    gate/up into `gate_up_proj` along the output axis: one matmul each instead of three and two
    (8-bit weights' per-output-channel scales joined the same way)."""
    suffixes = ("", SCALE) if "q_proj" + SCALE in layers else ("",)
    parts = {name + suffix for names in FUSED_PROJECTIONS.values() for name in names for suffix in suffixes}
    fused = {
        fused + suffix: jnp.concatenate([layers[name + suffix] for name in names], axis=-1)
        for fused, names in FUSED_PROJECTIONS.items()
        for suffix in suffixes
    }
    return {name: w for name, w in layers.items() if name not in parts} | fused


def layers_unrolled() -> bool:
    """Whether `scan_layers` unrolls the layers: on CPU (the platform being compiled for)."""
    return sharding.context_platform() == "cpu"


_Carry = TypeVar("_Carry")
_Output = TypeVar("_Output")


def scan_layers(
    step: Callable[[_Carry, Any], tuple[_Carry, _Output]], carry: _Carry, layers: dict, *per_layer: Array
) -> tuple[_Carry, _Output]:
    """`jax.lax.scan(step, carry, (layers, *per_layer))` over the stacked decoder layers.

    On an accelerator, a scan: one compiled layer (compile time flat in depth), the weights as
    stored and sharded. On CPU, unrolled, with fused projections (`fuse_projections`): a scanned
    layer's weights are copied out of the stack, and its gradients into one, at every layer
    (docs/benchmarks.md, "A GRPO step against tunix")."""
    if layers_unrolled():
        return jax.lax.scan(step, carry, (fuse_projections(layers), *per_layer), unroll=True)
    return jax.lax.scan(step, carry, (layers, *per_layer))


def lm_logits(params: dict, config: ModelConfig, final_hidden: Float[Array, "B L D"]) -> Float[Array, "B L V"]:
    """float32 logits [B, L, V] from the final-norm hidden states (tied or separate head; an 8-bit
    head times its per-vocabulary-row scales)."""
    name = "embed" if config.tie_word_embeddings else "lm_head"
    head = params["embed"].T if config.tie_word_embeddings else params["lm_head"]
    logits = jnp.einsum(
        "bld,dv->blv", final_hidden, head.astype(final_hidden.dtype), preferred_element_type=jnp.float32
    )
    scale = params.get(name + SCALE)
    return logits if scale is None else logits * scale


def _hidden_slots(config: ModelConfig, hidden_layers: tuple[int, ...]) -> np.ndarray:
    """For scan step j (whose output is HF hidden state j + 1), the output slot or a trash slot."""
    slots = np.full((config.num_layers,), len(hidden_layers), np.int32)
    for slot, index in enumerate(hidden_layers):
        if 1 <= index < config.num_layers:
            slots[index - 1] = slot
    return slots


def _check_forward_inputs(
    config: ModelConfig,
    tokens: Int[Array, "B L"],
    attention_mask: Bool[Array, "B L"],
    window_start: Int[Array, " B"] | Int[Array, "B L"] | None,
    hidden_layers: tuple[int, ...],
    segment_ids: Int[Array, "B L"] | None,
    positions: Int[Array, "B L"] | None,
) -> None:
    if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise ValueError(f"tokens must be int [B, L], got {tokens.dtype} {tokens.shape}")
    if attention_mask.shape != tokens.shape or attention_mask.dtype != jnp.bool_:
        raise ValueError(
            f"attention_mask must be bool {tokens.shape}, got {attention_mask.dtype} {attention_mask.shape}"
        )
    if window_start is not None and window_start.shape not in (tokens.shape[:1], tokens.shape):
        raise ValueError(
            f"window_start must be int [B] = [{tokens.shape[0]}] or [B, L] = {list(tokens.shape)}, "
            f"got shape {window_start.shape}"
        )
    for name, array in (("segment_ids", segment_ids), ("positions", positions)):
        if array is not None and array.shape != tokens.shape:
            raise ValueError(f"{name} must be int [B, L] = {list(tokens.shape)}, got shape {array.shape}")
    bad = [i for i in hidden_layers if not 0 <= i <= config.num_layers]
    if bad:
        raise ValueError(f"hidden_layers {bad} out of range [0, {config.num_layers}] (HF hidden_states indexing)")


@functools.partial(
    jax.jit,
    static_argnames=(
        "config",
        "hidden_layers",
        "concentration_backend",
        "return_final_attention",
        "compute_logits",
        "concentration_statistics",
        "sink_tokens",
    ),
)
def forward(
    params: dict,
    config: ModelConfig,
    tokens: Int[Array, "B L"],
    attention_mask: Bool[Array, "B L"],
    window_start: Int[Array, " B"] | Int[Array, "B L"] | None = None,
    *,
    hidden_layers: tuple[int, ...] | None = None,
    concentration_backend: str | None = None,
    return_final_attention: bool = False,
    compute_logits: bool = True,
    concentration_statistics: tuple[str, ...] = (),
    sink_tokens: int = pallas_kernels.DEFAULT_SINK_TOKENS,
    segment_ids: Int[Array, "B L"] | None = None,
    positions: Int[Array, "B L"] | None = None,
) -> ForwardOutput:
    """Teacher-forced forward pass.

    tokens [B, L] int; attention_mask [B, L] bool (True = real token); window_start [B] int
    or None: first key position of the concentration window (prompt length P for the
    "response" window, 0 for "full"); None computes no concentration. `hidden_layers` picks
    HF-indexed hidden states (0 = embeddings, i = output of block i, num_layers = after the
    final norm); None returns all num_layers + 1. Only the final layer runs the
    concentration attention (`pallas_kernels.attention_with_concentration`); the others
    use fused attention. Concentration is a detached statistic: it carries no gradient.
    `return_final_attention=True` (needs window_start) also returns the final layer's
    detached q, k and per-head LSE (`FinalAttention`), which the TAC critic's top-K routing
    reads. `compute_logits=False` returns logits=None (ask for hidden layer num_layers instead).
    `concentration_statistics` (needs window_start): more statistics of the same final-layer
    window distribution from the same kernel pass (`pallas_kernels.STATISTICS`; `sink_tokens`
    for "sink_herfindahl"), returned in `out.statistics`.
    Packed rows (comppo_jax.models.packing): `segment_ids` [B, L] keeps every layer's attention within
    each token's own sequence, `positions` [B, L] are the RoPE positions in it, and window_start is
    per query [B, L] (at or after the query's sequence start).
    """
    if (return_final_attention or concentration_statistics) and window_start is None:
        raise ValueError(
            "return_final_attention and concentration_statistics need window_start (the final layer's kernel "
            "computes them)"
        )
    hidden_layers = tuple(range(config.num_layers + 1)) if hidden_layers is None else tuple(hidden_layers)
    _check_forward_inputs(config, tokens, attention_mask, window_start, hidden_layers, segment_ids, positions)
    batch, length = tokens.shape
    dtype = jnp.dtype(config.dtype)
    inv_freq = jnp.asarray(rope_inv_freq(config))
    if positions is None:  # Positions count real tokens, so left-padded rows get the same positions as unpadded ones.
        positions = jnp.maximum(jnp.cumsum(attention_mask, axis=1) - 1, 0)
    embedded = embed_tokens(params, tokens, dtype)

    def concentrated(q: Array, k: Array, v: Array) -> tuple[Array, dict[str, Any]]:
        # Per batch shard with all heads: H_t is a statistic of the head-averaged attention.
        attend = functools.partial(
            pallas_kernels.attention_with_concentration,
            backend=concentration_backend,
            return_lse=return_final_attention,
            statistics=concentration_statistics,
            sink_tokens=sink_tokens,
        )
        kernel = sharding.per_shard(
            lambda q, k, v, mask, start, segments: attend(q, k, v, mask, start, segment_ids=segments),
            in_specs=P(sharding.BATCH),
            out_specs=P(sharding.BATCH),
        )
        # Only called with a window_start (mypy does not narrow it inside this closure).
        out, herfindahl, window_size, *rest = kernel(
            q,
            k,
            v,
            attention_mask,
            window_start.astype(jnp.int32),  # type: ignore[union-attr]
            segment_ids,
        )
        statistics = {"herfindahl": herfindahl, "window_size": window_size}
        if return_final_attention:
            statistics["final_attention"] = FinalAttention(q, k, rest.pop(0))
        if concentration_statistics:
            statistics["statistics"] = rest.pop(0)
        return out, jax.lax.stop_gradient(statistics)

    def no_statistics(q: Array, k: Array, v: Array) -> dict[str, Any]:  # zeros shaped like the final layer's statistics
        return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(concentrated, q, k, v)[1])

    def causal(q: Array, k: Array, v: Array) -> Array:
        return training_attention(q, k, v, attention_mask, implementation=config.attention, segment_ids=segment_ids)

    def plain(q: Array, k: Array, v: Array) -> tuple[Array, dict[str, Any]]:
        return causal(q, k, v), no_statistics(q, k, v)

    def step(
        carry: tuple[Array, Array | None, dict[str, Any]], scanned: tuple[dict[str, Array], Array, Array]
    ) -> tuple[tuple[Array, Array | None, dict[str, Any]], None]:
        x, captured, statistics = carry
        layer, index, slot = scanned
        attention: Callable[[Array, Array, Array], tuple[Array, dict[str, Any]]]
        attention = lambda q, k, v: (causal(q, k, v), {})
        if window_start is not None:
            attention = lambda q, k, v: jax.lax.cond(index == config.num_layers - 1, concentrated, plain, q, k, v)
        x, layer_statistics = _decoder_layer(layer, x, positions, config, inv_freq, attention)
        # Only the final layer's statistics are non-zero, so summing over layers selects them.
        if captured is not None:
            captured = jax.lax.dynamic_update_index_in_dim(captured, x, slot, 0)
        return (x, captured, jax.tree.map(jnp.add, statistics, layer_statistics)), None

    # Requested layers inside the stack go to their slot of a carried buffer, the others to one
    # spare slot; with none inside, no buffer is carried (nor saved for the backward pass).
    captured_shape = (len(hidden_layers) + 1, batch, length, config.hidden_size)
    captured = jnp.zeros(captured_shape, dtype) if any(1 <= i < config.num_layers for i in hidden_layers) else None
    per_layer = (jnp.arange(config.num_layers), jnp.asarray(_hidden_slots(config, hidden_layers)))
    statistics = {}
    if window_start is not None:
        first_layer = lambda: jax.tree.map(lambda x: x[0], params["layers"])  # shapes only, nothing computed
        statistics = no_statistics(*jax.eval_shape(lambda: _qkv(first_layer(), embedded, positions, config, inv_freq)))
    policy = REMAT_POLICIES[config.remat]
    if policy is not None:
        # A scan keeps the recomputation apart from the forward; unrolled layers need the barrier.
        step = jax.checkpoint(step, policy=policy, prevent_cse=layers_unrolled())
    (x, captured, statistics), _ = scan_layers(step, (embedded, captured, statistics), params["layers"], *per_layer)
    if captured is None:
        captured = jnp.zeros(captured_shape, dtype)

    final = rms_norm(x, params["final_norm"], config.rms_norm_eps)
    captured = captured.at[jnp.asarray([i for i, h in enumerate(hidden_layers) if h == 0], jnp.int32)].set(embedded)
    captured = captured.at[
        jnp.asarray([i for i, h in enumerate(hidden_layers) if h == config.num_layers], jnp.int32)
    ].set(final)
    logits = lm_logits(params, config, final) if compute_logits else None
    return ForwardOutput(
        logits,
        captured[:-1],
        statistics.get("herfindahl"),
        statistics.get("window_size"),
        statistics.get("final_attention"),
        statistics.get("statistics"),
    )
