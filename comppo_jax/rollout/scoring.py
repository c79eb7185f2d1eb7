"""The behaviour-policy scoring pass: one teacher-forced forward over prompt + response.

Per response token y_t everything is read at the state before it, sequence position
p_t = P + t - 2 (0-based: P - 1 + (t - 1)), so per-token arrays are the slice [P-1, P+T-1) of
the sequence (docs/conventions.md, "Index conventions"). The pass yields the behaviour log-probs,
the final layer's concentration H_t -> c_t -> kappa_t (paper eqs. herfindahl, cnorm,
kappa_attention; the concentration kernel), the hidden states and top-K routing the TAC critic
reuses, the reference policy's log-probs and, for credit.estimator=attention_anchor, the future attention
influence of each response token (comppo_jax.credit.attention_credit). Everything is detached and stored
with the rollout: kappa is fixed for all update epochs of the batch (paper section 3).

`old_log_probs="sampler"` takes the behaviour log-probs the sampler recorded instead of
recomputing them (equal on CPU in float32, `tests/rollout`; on an accelerator they differ by the
decode path's bf16 rounding). A method that then reads neither the gate nor critic features
(GRPO) skips the behaviour forward altogether (`behaviour_pass=False`): the reference alone runs.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, Shaped

from comppo_jax import sharding
from comppo_jax.credit import GATE_STATISTICS, entropy_from_logits, retention_gate, statistic_concentration
from comppo_jax.credit.attention_credit import future_attention_influence
from comppo_jax.critic import Routing, window_topk
from comppo_jax.models import ModelConfig, forward
from comppo_jax.models.packing import Packing, gather_tokens, pack, unpack
from comppo_jax.models.transformer import ForwardOutput, lm_logits
from comppo_jax.rollout.sampler import Generation
from pallas_kernels import DEFAULT_SINK_TOKENS, window_sizes
from pallas_kernels.common import round_up

WINDOWS = ("response", "full")
OLD_LOG_PROBS = ("rescore", "sampler")


class Rollout(NamedTuple):
    """A scored batch. Per-token arrays are [B, T], aligned with y_1..y_T, 0 on padding."""

    tokens: Int[Array, "B L"]  # int32, prompt + response + right padding
    attention_mask: Bool[Array, "B L"]
    prompt_lengths: Int[Array, " B"]  # int32
    response_mask: Bool[Array, "B T"]
    log_probs: Float[Array, "B T"]  # behaviour log pi(y_t | h_t), teacher-forced (or the sampler's)
    ref_log_probs: Float[Array, "B T"] | None  # reference policy, or None without one
    # H_t of the final layer over the window (None: no behaviour pass), whatever gate_statistic
    herfindahl: Float[Array, "B T"] | None
    window_size: Int[Array, "B T"] | None  # int32 n_t
    kappa: Float[Array, "B T"] | None  # retention gate kappa_t (of the gate_statistic's c_t)
    hidden_states: Float[Array, "K B L D"]  # the critic's fused layers (sequence coordinates), K = len(hidden_layers)
    routing: Routing | None  # TAC's top-K native-attention routing [B, L, K], or None
    # FAI of each response token y_t, at its own position P + t - 1 (credit.attention_credit), or None
    influence: Float[Array, "B T"] | None = None


def response_positions(prompt_lengths: Int[Array, " B"], length: int) -> Int[Array, "B T"]:
    """[B, T] sequence positions p_t = P - 1 + (t - 1) of the states before y_1..y_T."""
    return prompt_lengths[:, None] - 1 + jnp.arange(length)[None]


def gather_response(
    x: Shaped[Array, "B L *rest"], prompt_lengths: Int[Array, " B"], length: int
) -> Shaped[Array, "B T *rest"]:
    """x [B, L, ...] -> [B, T, ...] at the positions before each response token."""
    positions = jnp.clip(response_positions(prompt_lengths, length), 0, x.shape[1] - 1)
    return jnp.take_along_axis(x, positions.reshape(positions.shape + (1,) * (x.ndim - 2)), axis=1)


def read_response(
    x: Shaped[Array, "R S *rest"], prompt_lengths: Int[Array, " B"], length: int, packing: Packing | None = None
) -> Shaped[Array, "B T *rest"]:
    """x at the positions before each response token, [B, T, ...]: `gather_response` on the sequence
    layout, or read from packed rows (comppo_jax.models.packing)."""
    if packing is None:
        return gather_response(x, prompt_lengths, length)
    return gather_tokens(x, packing, response_positions(prompt_lengths, length))


def model_rows(
    tokens: Int[Array, "B L"], attention_mask: Bool[Array, "B L"], packing: Packing | None
) -> tuple[Int[Array, "R S"], Bool[Array, "R S"], dict]:
    """(tokens, mask, `forward`'s packing keywords) of the rows the model runs on: the sequence layout's,
    or its packed rows (each token's segment and position)."""
    if packing is None:
        return tokens, attention_mask, {}
    return (
        pack(tokens, packing),
        jnp.asarray(packing.attention_mask),
        dict(segment_ids=packing.segment_ids, positions=packing.positions),
    )


def token_stats(
    params: dict,
    config: ModelConfig,
    hidden: Float[Array, "B N D"],
    targets: Int[Array, "B N"],
    temperature: float = 1.0,
) -> tuple[Float[Array, "B N"], Float[Array, "B N"]]:
    """(log pi(target | h), entropy) [B, N] float32 at final-norm hidden states [B, N, D].

    log-probs and the entropy are of softmax(logits / temperature), the distribution the sampler drew from (the
    80/20 token selection ranks tokens by it, as Wang et al.'s code and verl do). The
    vocabulary projection runs `config.logits_chunk` positions at a time (0: all), each chunk
    rematerialized in the backward pass, so no [B, N, V] float32 logits are ever held.
    """
    batch, length = targets.shape
    chunk = max(min(config.logits_chunk or length, length), 1)
    padded = round_up(length, chunk)
    pad = lambda x: jnp.pad(x, [(0, 0), (0, padded - length)] + [(0, 0)] * (x.ndim - 2))
    to_chunks = lambda x: jnp.moveaxis(pad(x).reshape((batch, padded // chunk, chunk) + x.shape[2:]), 1, 0)

    @jax.checkpoint
    def chunk_stats(inputs: tuple[Array, Array]) -> tuple[Array, Array]:
        hidden, tokens = inputs  # [B, C, D], [B, C]
        logits = lm_logits(params, config, hidden)
        scaled = logits / temperature
        taken = jnp.take_along_axis(scaled, tokens[..., None], axis=-1)[..., 0]
        return taken - jax.nn.logsumexp(scaled, axis=-1), entropy_from_logits(scaled)

    log_probs, entropy = jax.lax.map(chunk_stats, (to_chunks(hidden), to_chunks(targets)))
    from_chunks = lambda x: jnp.moveaxis(x, 0, 1).reshape(batch, padded)[:, :length]
    return from_chunks(log_probs), from_chunks(entropy)


def packed_targets(
    packing: Packing, prompt_lengths: Int[Array, " B"], response_tokens: Int[Array, "B T"]
) -> Int[Array, "R S"]:
    """Each packed slot's response token to score: y_t at the slot before it (sequence position
    P + t - 2), 0 at the prompt's other slots and where no token lies."""
    sequence = jnp.maximum(packing.segment_ids - 1, 0)
    t = packing.positions - prompt_lengths[sequence] + 1  # 0-based index of the response token it predicts
    length = response_tokens.shape[1]
    scored = (packing.segment_ids > 0) & (t >= 0) & (t < length)
    return jnp.where(scored, response_tokens[sequence, jnp.clip(t, 0, length - 1)], 0)


def response_token_stats(
    params: dict,
    config: ModelConfig,
    final_hidden: Float[Array, "B L D"],
    prompt_lengths: Int[Array, " B"],
    response_tokens: Int[Array, "B T"],
    temperature: float = 1.0,
    packing: Packing | None = None,
) -> tuple[Float[Array, "B T"], Float[Array, "B T"]]:
    """(log pi(y_t | h_t), entropy) [B, T] float32 from the final-norm hidden states (`token_stats`):
    of the sequence layout [B, L, D] at the positions before each response token, or of packed rows
    [R, S, D] (`packing`) at every slot, read back per response token: no padded position is scored."""
    length = response_tokens.shape[1]
    if packing is None:
        hidden = gather_response(final_hidden, prompt_lengths, length)
        return token_stats(params, config, hidden, response_tokens, temperature)
    targets = packed_targets(packing, prompt_lengths, response_tokens)
    log_probs, entropy = token_stats(params, config, final_hidden, targets, temperature)
    return (
        read_response(log_probs, prompt_lengths, length, packing),
        read_response(entropy, prompt_lengths, length, packing),
    )


def window_start_of(
    window: str, prompt_lengths: Int[Array, " B"], packing: Packing | None = None
) -> Int[Array, " B"] | Int[Array, "R S"]:
    """First key position of the concentration window: P for "response", 0 for "full"; per row [B],
    or per packed slot [R, S] (from its own sequence's first slot)."""
    if window not in WINDOWS:
        raise ValueError(f"window must be one of {WINDOWS}, got {window!r}")
    if packing is None:
        return prompt_lengths if window == "response" else jnp.zeros_like(prompt_lengths)
    first_slot = jnp.arange(packing.positions.shape[1], dtype=jnp.int32)[None] - packing.positions
    if window == "full":
        return first_slot
    return first_slot + prompt_lengths[jnp.maximum(packing.segment_ids - 1, 0)]


def extra_statistics(gate_statistic: str) -> tuple[str, ...]:
    """The kernel statistics a gate statistic needs beyond the always-computed Herfindahl index."""
    if gate_statistic not in GATE_STATISTICS:
        raise ValueError(f"gate_statistic must be one of {GATE_STATISTICS}, got {gate_statistic!r}")
    return () if gate_statistic == "herfindahl" else (gate_statistic,)


def response_gate(
    out: ForwardOutput,
    attention_mask: Bool[Array, "R S"],
    prompt_lengths: Int[Array, " B"],
    window_start: Int[Array, " B"] | Int[Array, "R S"],
    length: int,
    *,
    gate_statistic: str,
    sink_tokens: int,
    kappa_lo: float,
    kappa_hi: float,
    tau: float,
    packing: Packing | None = None,
) -> tuple[Float[Array, "B T"], Int[Array, "B T"], Float[Array, "B T"]]:
    """(H_t, n_t, kappa_t) [B, T] from a forward pass's final-layer statistics (paper eqs. herfindahl,
    cnorm, kappa_attention), kappa from the c_t of `gate_statistic` (`statistic_concentration`).
    `out` comes from a forward pass with a window_start, so its concentration fields are not None;
    with `packing` it ran on packed rows."""
    read = lambda x: read_response(x, prompt_lengths, length, packing)
    herfindahl = read(out.herfindahl)
    window_size = read(out.window_size)
    value, n = herfindahl, window_size
    if gate_statistic != "herfindahl":
        value = read(out.statistics[gate_statistic])  # type: ignore[index]
    if gate_statistic == "sink_herfindahl":  # its own window: without the first sink_tokens key positions
        n = read(window_sizes(attention_mask, window_start + sink_tokens))
    kappa = retention_gate(
        statistic_concentration(gate_statistic, value, n), kappa_lo=kappa_lo, kappa_hi=kappa_hi, tau=tau
    )
    return herfindahl, window_size, kappa


@functools.partial(
    jax.jit,
    static_argnames=(
        "config",
        "length",
        "window",
        "gate_statistic",
        "sink_tokens",
        "kappa_lo",
        "kappa_hi",
        "tau",
        "backend",
    ),
)
def policy_gate(
    params: dict,
    config: ModelConfig,
    tokens: Int[Array, "B L"],
    attention_mask: Bool[Array, "B L"],
    prompt_lengths: Int[Array, " B"],
    response_mask: Bool[Array, "B T"],
    *,
    length: int,
    window: str = "response",
    gate_statistic: str = "herfindahl",
    sink_tokens: int = DEFAULT_SINK_TOKENS,
    kappa_lo: float = 0.1,
    kappa_hi: float = 0.9,
    tau: float = 4.0,
    backend: str | None = None,
    packing: Packing | None = None,
) -> Float[Array, "B T"]:
    """kappa_t [B, T] of `params` on a scored batch (0 on padding), detached: the gate alone, as the
    behaviour pass computes it (no logits, no critic features), on packed rows with `packing`.
    `gate_refresh=epoch` calls it with the current actor at the start of each update epoch."""
    window_start = window_start_of(window, prompt_lengths, packing)
    rows, rows_mask, packed = model_rows(tokens, attention_mask, packing)
    out = forward(
        params,
        config,
        rows,
        rows_mask,
        window_start,
        hidden_layers=(),
        concentration_backend=backend,
        compute_logits=False,
        concentration_statistics=extra_statistics(gate_statistic),
        sink_tokens=sink_tokens,
        **packed,
    )
    _, _, kappa = response_gate(
        out,
        rows_mask,
        prompt_lengths,
        window_start,
        length,
        gate_statistic=gate_statistic,
        sink_tokens=sink_tokens,
        kappa_lo=kappa_lo,
        kappa_hi=kappa_hi,
        tau=tau,
        packing=packing,
    )
    return jax.lax.stop_gradient(jnp.where(response_mask, kappa, 0.0))


def policy_token_stats(
    params: dict,
    config: ModelConfig,
    tokens: Int[Array, "B L"],
    attention_mask: Bool[Array, "B L"],
    prompt_lengths: Int[Array, " B"],
    response_tokens: Int[Array, "B T"],
    temperature: float = 1.0,
    packing: Packing | None = None,
) -> tuple[Float[Array, "B T"], Float[Array, "B T"]]:
    """Teacher-forced (log-probs, entropies) [B, T] of y_1..y_T under `params` (`response_token_stats`),
    the model run on packed rows with `packing`."""
    rows, rows_mask, packed = model_rows(tokens, attention_mask, packing)
    out = forward(params, config, rows, rows_mask, hidden_layers=(config.num_layers,), compute_logits=False, **packed)
    return response_token_stats(
        params, config, out.hidden_states[0], prompt_lengths, response_tokens, temperature, packing
    )


@functools.partial(
    jax.jit,
    static_argnames=(
        "config",
        "window",
        "temperature",
        "hidden_layers",
        "top_k",
        "kappa_lo",
        "kappa_hi",
        "tau",
        "backend",
        "old_log_probs",
        "behaviour_pass",
        "gate_statistic",
        "sink_tokens",
        "influence_horizon",
    ),
)
def score_rollout(
    params: dict,
    ref_params: dict | None,
    config: ModelConfig,
    generation: Generation,
    *,
    window: str = "response",
    temperature: float = 1.0,
    hidden_layers: tuple[int, ...] = (),
    top_k: int | None = 64,
    kappa_lo: float = 0.1,
    kappa_hi: float = 0.9,
    tau: float = 4.0,
    backend: str | None = None,
    old_log_probs: str = "rescore",
    behaviour_pass: bool = True,
    gate_statistic: str = "herfindahl",
    sink_tokens: int = DEFAULT_SINK_TOKENS,
    packing: Packing | None = None,
    influence_horizon: tuple[int, int] | None = None,
) -> Rollout:
    """Scores a generation with the behaviour policy `params` (and `ref_params`, if given).

    window: "response" (the paper's: keys in [P, p_t]) or "full" (every real key in [0, p_t]).
    hidden_layers: HF hidden-state indices the critic fuses (`fused_hidden_layers`).
    top_k: TAC's routed positions per token, or None for no routing (standard critic).
    (kappa_lo, kappa_hi, tau): the gate envelope of eq. kappa_attention.
    gate_statistic: the concentration statistic kappa reads (`comppo_jax.credit.GATE_STATISTICS`;
    the paper's "herfindahl" by default; `sink_tokens` for "sink_herfindahl").
    old_log_probs: "rescore" (teacher-forced here) or "sampler" (`generation.log_probs`).
    behaviour_pass=False (needs old_log_probs="sampler", no hidden_layers, top_k=None): no
    behaviour forward; herfindahl, window_size and kappa are None.
    packing: the generation's sequences packed (comppo_jax.models.packing): both policies run on the
    packed rows; the Rollout is in the sequence layout all the same (hidden states and routing unpacked).
    influence_horizon: (H_lo, H_hi) for the future attention influence of each response token of the
    behaviour policy's final layer (`future_attention_influence`; credit.estimator=attention_anchor reads it),
    or None: influence is None.
    """
    window_start = window_start_of(window, generation.prompt_lengths, packing)
    if old_log_probs not in OLD_LOG_PROBS:
        raise ValueError(f"old_log_probs must be one of {OLD_LOG_PROBS}, got {old_log_probs!r}")
    if not behaviour_pass and (old_log_probs != "sampler" or hidden_layers or top_k is not None):
        raise ValueError(
            "behaviour_pass=False needs old_log_probs='sampler' and no critic features (hidden_layers=(), top_k=None), "
            f"got old_log_probs={old_log_probs!r}, hidden_layers={hidden_layers}, top_k={top_k}"
        )
    if not behaviour_pass and influence_horizon is not None:
        raise ValueError("influence_horizon reads the behaviour policy's attention: it needs behaviour_pass=True")
    mask = generation.attention_mask
    response_mask = generation.response_mask
    zero = lambda x: jnp.where(response_mask, x, jnp.zeros((), x.dtype))
    ref_log_probs: Array | None = None
    if ref_params is not None:
        ref_log_probs, _ = policy_token_stats(
            ref_params,
            config,
            generation.tokens,
            mask,
            generation.prompt_lengths,
            generation.response_tokens,
            temperature,
            packing,
        )
        ref_log_probs = zero(ref_log_probs)
    if not behaviour_pass:
        no_features = jnp.zeros((0,) + generation.tokens.shape + (config.hidden_size,), config.dtype)
        return jax.lax.stop_gradient(
            Rollout(
                generation.tokens,
                mask,
                generation.prompt_lengths,
                response_mask,
                zero(generation.log_probs),
                ref_log_probs,
                None,
                None,
                None,
                no_features,
                None,
            )
        )
    # The final-norm hidden states feed the chunked log-probs; the critic's layers ride along.
    with_final = hidden_layers if config.num_layers in hidden_layers else hidden_layers + (config.num_layers,)
    rows, rows_mask, packed = model_rows(generation.tokens, mask, packing)
    out = forward(
        params,
        config,
        rows,
        rows_mask,
        window_start,
        hidden_layers=with_final,
        concentration_backend=backend,
        return_final_attention=top_k is not None or influence_horizon is not None,
        compute_logits=False,
        concentration_statistics=extra_statistics(gate_statistic),
        sink_tokens=sink_tokens,
        **packed,
    )
    length = generation.response_tokens.shape[1]
    log_probs = generation.log_probs
    if old_log_probs == "rescore":
        final_hidden = out.hidden_states[with_final.index(config.num_layers)]
        log_probs, _ = response_token_stats(
            params, config, final_hidden, generation.prompt_lengths, generation.response_tokens, temperature, packing
        )
    herfindahl, window_size, kappa = response_gate(
        out,
        rows_mask,
        generation.prompt_lengths,
        window_start,
        length,
        gate_statistic=gate_statistic,
        sink_tokens=sink_tokens,
        kappa_lo=kappa_lo,
        kappa_hi=kappa_hi,
        tau=tau,
        packing=packing,
    )
    routing: Routing | None = None
    if top_k is not None:
        routing = window_topk(*out.final_attention, rows_mask, window_start, top_k=top_k)
    influence: Array | None = None
    if influence_horizon is not None:
        rows_influence = future_attention_influence(
            *out.final_attention,
            rows_mask,
            window_start_of("response", generation.prompt_lengths, packing),
            horizon=influence_horizon,
            segment_ids=None if packing is None else packing.segment_ids,
        )
        # Read at each token's own position P + t - 1: the key the later tokens attend to.
        influence = zero(read_response(rows_influence, generation.prompt_lengths + 1, length, packing))
    hidden_states = out.hidden_states[: len(hidden_layers)]
    if packing is not None:  # back to the sequence layout, the routed keys as positions in their sequences
        sequence_layout = lambda x: unpack(x, packing, generation.tokens.shape[1])
        hidden_states = jax.vmap(sequence_layout)(hidden_states)
        if routing is not None:
            in_sequence = jnp.take_along_axis(packing.positions[:, :, None], routing.indices, axis=1)
            routing = jax.tree.map(sequence_layout, routing._replace(indices=in_sequence))
    return jax.lax.stop_gradient(
        Rollout(
            generation.tokens,
            mask,
            generation.prompt_lengths,
            response_mask,
            zero(log_probs),
            ref_log_probs,
            zero(herfindahl),
            zero(window_size),
            zero(kappa),
            sharding.constrain_features(hidden_states),
            routing,
            influence,
        )
    )
