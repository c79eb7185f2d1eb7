"""The rollout engine behind `generate`: paged KV cache, one prefill per prompt, continuous batching.

1. Prefill: each prompt runs once, not once per sample. Its keys and values fill the prompt's
   own pages, read-only from then on, and the logits at its last token seed all its samples.
2. Admission: a free decode slot takes the next waiting row (rows in order; a prompt's
   `num_samples` rows are consecutive). The row shares its prompt's full pages; a partly filled
   last prompt page is copied to a fresh page first (copy-on-write).
3. Decode step: every live slot samples a token with the row's own key
   `fold_in(fold_in(rng, row), t)`, so a row's tokens never depend on the slot or step it ran in.
   Unless the row just ended, the token's keys and values go to the row's pages (a fresh page at
   each page boundary) and its next logits are computed. An ended row hands its private pages
   back to the free stack and its slot to the next waiting row.
Rows end at their first EOS (kept) or at `max_new_tokens`; the loop ends when every row has. In a
conversation (`Turns`, comppo_jax.rollout.turns) a row that samples a call token pauses, holding its
slot and pages, and the loop also ends when every row still running waits and no slot can take
another row; `resume` writes the environment's replies as those rows' next tokens.

Shards: under a mesh, the prompts are split into `shards` = data x fsdp contiguous blocks, each
with its own slots, page pool and free stack (every engine array has a leading shard axis, split
over the batch axes; kv heads over `tensor`, each repeated `sharding.kv_head_repeat` times where
`tensor` exceeds them), so no page is ever read across devices. The
per-shard steps are written for one shard and `vmap`ped; the loop and the XLA path's page count
are global. The pool holds each shard's prompt pages plus, per slot, the most pages a row can
need, so a page is always free at a page boundary; `decode_slots` < rows is what bounds memory.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from comppo_jax import sharding
from comppo_jax.models import paged_cache
from comppo_jax.models.attention import training_attention
from comppo_jax.models.config import ModelConfig
from comppo_jax.models.transformer import (
    _decoder_layer,
    embed_tokens,
    fuse_projections,
    layers_unrolled,
    lm_logits,
    rms_norm,
    rope_inv_freq,
    scan_layers,
)

TRASH_PAGE = 0  # idle slots write here; nothing reads it
TPU_ROWS = 8  # sublanes of a TPU tile: a decode step feeds at least this many rows per shard
# The planner's cost model (comppo_jax.costs.hlo_cost) finds the decode loop and the admission by these names.
DECODE_SCOPE, ADMIT_SCOPE = "decode", "admit"


class Layout(NamedTuple):
    """Static sizes of one engine call; per shard unless said otherwise."""

    num_prompts: int  # B, all shards
    shards: int  # D
    shard_rows: int  # ceil(R / D): shard d decodes rows [d * shard_rows, (d + 1) * shard_rows)
    prompts: int  # prompts a shard prefills: those of its rows
    samples: int  # rows per prompt
    slots: int  # decode slots per shard
    prompt_width: int  # P, padded prompt length
    max_new_tokens: int  # T
    page_size: int
    prompt_pages: int  # pages per prompt, ceil(P / page_size)
    table_width: int  # pages a row can span, ceil((P + T) / page_size)
    private_pages: int  # pages a row can own, ceil(T / page_size) + 1

    @property
    def rows(self) -> int:
        """R, all shards, without padding."""
        return self.num_prompts * self.samples

    @property
    def decode_steps(self) -> int:
        """Iterations of the decode loop when every row runs to `max_new_tokens`: each slot decodes
        its rows one after another, one token per iteration."""
        return -(-self.shard_rows // self.slots) * self.max_new_tokens

    @property
    def pages_per_layer(self) -> int:
        return 1 + self.prompts * self.prompt_pages + self.slots * self.private_pages

    def first_prompts(self) -> np.ndarray:
        """[D] the first prompt of each shard's rows (rows past R, padding, repeat the last prompt)."""
        return np.minimum(np.arange(self.shards) * self.shard_rows // self.samples, self.num_prompts - 1)

    def shard_prompts(self) -> np.ndarray:
        """[D, prompts] the prompts each shard prefills (indices into the batch; the last repeats)."""
        return np.minimum(self.first_prompts()[:, None] + np.arange(self.prompts)[None], self.num_prompts - 1)


def make_layout(
    num_prompts: int,
    prompt_width: int,
    *,
    num_samples: int,
    max_new_tokens: int,
    page_size: int,
    decode_slots: int | None,
    shards: int = 1,
) -> Layout:
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    if decode_slots is not None and decode_slots < 1:
        raise ValueError(f"decode_slots must be >= 1 (or None for one per row), got {decode_slots}")
    rows = num_prompts * num_samples
    shard_rows = -(-rows // shards)
    first_rows = np.arange(shards) * shard_rows
    last_rows = np.minimum(first_rows + shard_rows, rows) - 1
    prompts = int(np.max(np.maximum(last_rows // num_samples - first_rows // num_samples, 0))) + 1
    slots = shard_rows if decode_slots is None else min(-(-decode_slots // shards), shard_rows)
    return Layout(
        num_prompts,
        shards,
        shard_rows,
        prompts,
        num_samples,
        slots,
        prompt_width,
        max_new_tokens,
        page_size,
        -(-prompt_width // page_size),
        -(-(prompt_width + max_new_tokens) // page_size),
        -(-max_new_tokens // page_size) + 1,
    )


def pool_kv_heads(config: ModelConfig) -> int:
    """The kv heads the page pool keeps under the context mesh (`sharding.kv_head_repeat`)."""
    return config.num_kv_heads * sharding.kv_head_repeat(config.num_heads, config.num_kv_heads)


def pool_bytes(config: ModelConfig, layout: Layout, kv_dtype: str = "auto") -> int:
    """Bytes of one shard's page pool (all layers, keys and values; 8-bit pages with their float32
    scales) under the context mesh."""
    return config.num_layers * layout.pages_per_layer * layout.page_size * token_bytes(config, kv_dtype)


def token_bytes(config: ModelConfig, kv_dtype: str = "auto") -> int:
    """Bytes one token's keys and values take in one layer of the page pool (`rollout.kv_dtype`)."""
    name = paged_cache.kv_dtype(kv_dtype, config.dtype)
    scales = 4 if name in paged_cache.LARGEST else 0
    return 2 * pool_kv_heads(config) * (config.head_dim * jnp.dtype(name).itemsize + scales)


def rows_in_flight(layout: Layout, pool_bytes: float, budget: float) -> int:
    """The engine's capacity: the decode slots per shard whose pages fit in `budget` bytes, for a
    pool of `pool_bytes` in `layout` (the prompts' pages fixed, `private_pages` more per slot);
    more than the shard's rows where memory is not what bounds them. 8-bit pages
    (`rollout.kv_dtype`) nearly halve a page, so about twice the rows fit."""
    page = pool_bytes / layout.pages_per_layer
    fixed = 1 + layout.prompts * layout.prompt_pages
    return int(max(0, (budget / page - fixed) // layout.private_pages))


class _State(NamedTuple):
    """One shard's engine state (the engine stacks shards on a leading axis)."""

    row: jax.Array  # [S] local row decoded in each slot, -1 when free
    step: jax.Array  # [S] tokens generated so far
    length: jax.Array  # [S] tokens in the slot's cache
    pages: jax.Array  # [S] table entries in use
    shared: jax.Array  # [S] leading entries that are the prompt's (never freed)
    tables: jax.Array  # [S, table_width] logical pages
    logits: jax.Array  # [S, V] float32, logits of the slot's next token
    pool: paged_cache.PagePool
    free_pages: jax.Array  # [F] stack of free logical pages; the first free_count are valid
    free_count: jax.Array
    next_row: jax.Array  # first local row not yet admitted
    rows_done: jax.Array
    response: jax.Array  # [R_shard, T] int32
    log_probs: jax.Array  # [R_shard, T] float32
    response_length: jax.Array  # [R_shard] int32
    turn: Turns | None = None  # multi-turn conversations only (comppo_jax.rollout.turns)


class Turns(NamedTuple):
    """One shard's conversation state: a row pauses after its tool call (a `calls` token) until the
    host appends the environment's reply (`resume`), whose tokens the row then feeds, not samples."""

    paused: jax.Array  # [S] the slot's row waits for the environment
    forced_until: jax.Array  # [S] the row's steps from its last pause up to this are the environment's tokens
    calls: jax.Array  # [S] tool calls the row has made
    env_mask: jax.Array  # [R_shard, T] bool: the environment's tokens


def top_p_filter(logits: Float[Array, "*B V"], top_p: float) -> Float[Array, "*B V"]:
    """Masks (to -inf) the tokens outside the smallest set whose probability reaches top_p.

    The most likely token always stays, so a tiny top_p is greedy.
    """
    sorted_logits = jnp.sort(logits, axis=-1)[..., ::-1]
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    kept = (jnp.cumsum(probs, axis=-1) - probs) < top_p
    threshold = jnp.min(jnp.where(kept, sorted_logits, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(logits >= threshold, logits, -jnp.inf)


def first_argmax(logits: Float[Array, "*B V"]) -> Int[Array, "*B"]:
    """`jnp.argmax` over the last axis (the first maximal index) as two plain reductions, which XLA
    on CPU runs ~4x faster than its index-carrying reduce."""
    vocab = logits.shape[-1]
    peak = logits.max(axis=-1, keepdims=True)
    return jnp.min(jnp.where(logits == peak, jnp.arange(vocab, dtype=jnp.int32), vocab), axis=-1)


def sample_token(rng: PRNGKeyArray, logits: Float[Array, "B V"], temperature: float, top_p: float) -> Int[Array, " B"]:
    """A token per row [B] from logits [B, V]: greedy when temperature == 0, else nucleus sampling."""
    if temperature == 0.0:
        return first_argmax(logits)
    scaled = logits / temperature
    if top_p < 1.0:
        scaled = top_p_filter(scaled, top_p)
    return jax.random.categorical(rng, scaled, axis=-1).astype(jnp.int32)


def right_align_prompts(
    tokens: Int[Array, "B P"], mask: Bool[Array, "B P"], pad_token_id: int
) -> tuple[Int[Array, "B P"], Bool[Array, "B P"]]:
    """Moves each row's real tokens to the front (stable), whatever its padding side."""
    order = jnp.argsort(~mask, axis=1, stable=True)
    aligned_mask = jnp.take_along_axis(mask, order, 1)
    return jnp.where(aligned_mask, jnp.take_along_axis(tokens, order, 1), pad_token_id), aligned_mask


def prefill_prompts(
    params: dict, config: ModelConfig, tokens: Int[Array, "DB P"], mask: Bool[Array, "DB P"], layout: Layout
) -> tuple[Float[Array, "D B V"], Float[Array, "D N BP page_size Hkv hd"], Float[Array, "D N BP page_size Hkv hd"]]:
    """Runs each shard's right-padded prompts, tokens [D * prompts, P], once. Returns (logits at
    each one's last token [D, prompts, V], its keys and values as pages [D, N, prompts *
    prompt_pages, page_size, Hkv, hd] each)."""
    dtype = jnp.dtype(config.dtype)
    inv_freq = jnp.asarray(rope_inv_freq(config))
    positions = jnp.maximum(jnp.cumsum(mask, axis=1) - 1, 0)

    def layer_step(x: Array, scanned: tuple[dict[str, Array]]) -> tuple[Array, tuple[Array, Array]]:
        attention = lambda q, k, v: (training_attention(q, k, v, mask, implementation=config.attention), (k, v))
        return _decoder_layer(scanned[0], x, positions, config, inv_freq, attention)

    x, (keys, values) = scan_layers(layer_step, embed_tokens(params, tokens, dtype), params["layers"])
    padded = layout.prompt_pages * layout.page_size

    def as_pages(a: Array) -> Array:  # [N, D * B, P, Hkv, hd] -> [D, N, B * prompt_pages, page_size, Hkv, hd]
        a = jnp.pad(a, ((0, 0), (0, 0), (0, padded - a.shape[2]), (0, 0), (0, 0)))
        a = a.reshape(a.shape[0], layout.shards, layout.prompts * layout.prompt_pages, layout.page_size, *a.shape[3:])
        return jnp.swapaxes(a, 0, 1)

    last = jnp.maximum(mask.sum(axis=1) - 1, 0)
    final = jnp.take_along_axis(x, last[:, None, None], axis=1)  # [D * B, 1, D_model]
    logits = lm_logits(params, config, rms_norm(final, params["final_norm"], config.rms_norm_eps))[:, 0]
    return logits.reshape(layout.shards, layout.prompts, -1), as_pages(keys), as_pages(values)


# --- one shard's steps (vmapped over shards) -------------------------------------------------


def _take_pages(state: _State, wanted: Bool[Array, " S"]) -> tuple[Int[Array, " S"], _State]:
    """Pops one free page for each True in `wanted` [S]; returns (pages [S], state)."""
    rank = jnp.cumsum(wanted) - 1
    pages = state.free_pages[jnp.clip(state.free_count - 1 - rank, 0)]
    return jnp.where(wanted, pages, TRASH_PAGE), state._replace(free_count=state.free_count - wanted.sum())


def _return_pages(state: _State, ending: Bool[Array, " S"]) -> _State:
    """Pushes the private pages (table entries shared..pages) of the `ending` slots back on the stack."""
    entry = jnp.arange(state.tables.shape[1])[None]
    private = (ending[:, None] & (entry >= state.shared[:, None]) & (entry < state.pages[:, None])).reshape(-1)
    where = jnp.where(
        private, state.free_count + jnp.cumsum(private) - 1, state.free_pages.shape[0]
    )  # out of range: dropped
    return state._replace(
        free_pages=state.free_pages.at[where].set(state.tables.reshape(-1), mode="drop"),
        free_count=state.free_count + private.sum(),
    )


def _initial_state(
    pool: paged_cache.PagePool, layout: Layout, vocab_size: int, pad: int, multi_turn: bool = False
) -> _State:
    slots, first_private = layout.slots, 1 + layout.prompts * layout.prompt_pages
    zeros = jnp.zeros((slots,), jnp.int32)
    turn = Turns(zeros.astype(bool), zeros, zeros, jnp.zeros((layout.shard_rows, layout.max_new_tokens), bool))
    return _State(
        row=zeros - 1,
        step=zeros,
        length=zeros,
        pages=zeros,
        shared=zeros,
        tables=jnp.full((slots, layout.table_width), TRASH_PAGE, jnp.int32),
        logits=jnp.zeros((slots, vocab_size), jnp.float32),
        pool=pool,
        free_pages=jnp.arange(layout.pages_per_layer - 1, first_private - 1, -1, dtype=jnp.int32),
        free_count=jnp.int32(layout.pages_per_layer - first_private),
        next_row=jnp.int32(0),
        rows_done=jnp.int32(0),
        response=jnp.full((layout.shard_rows, layout.max_new_tokens), pad, jnp.int32),
        log_probs=jnp.zeros((layout.shard_rows, layout.max_new_tokens), jnp.float32),
        response_length=jnp.zeros((layout.shard_rows,), jnp.int32),
        turn=turn if multi_turn else None,
    )


def _admit(
    state: _State,
    shard: Int[Array, ""],
    first_prompt: Int[Array, ""],
    layout: Layout,
    prompt_lengths: Int[Array, " prompts"],
    prompt_logits: Float[Array, "prompts V"],
) -> _State:
    """Free slots take the next waiting rows; a partly filled last prompt page is copied to a private page."""
    free = state.row < 0
    row = state.next_row + jnp.cumsum(free) - 1
    admit = free & (row < layout.shard_rows)
    global_prompt = jnp.minimum((shard * layout.shard_rows + row) // layout.samples, layout.num_prompts - 1)
    prompt = jnp.where(admit, global_prompt - first_prompt, 0)
    length = prompt_lengths[prompt]
    shared = length // layout.page_size
    first_prompt_page = 1 + prompt * layout.prompt_pages
    entry = jnp.arange(layout.table_width)[None]
    prompt_table = jnp.where(entry < shared[:, None], first_prompt_page[:, None] + entry, TRASH_PAGE)
    copied = admit & (length % layout.page_size != 0)
    page, state = _take_pages(state, copied)
    pool = paged_cache.copy_pages(state.pool, jnp.where(copied, first_prompt_page + shared, TRASH_PAGE), page)
    prompt_table = jnp.where(copied[:, None] & (entry == shared[:, None]), page[:, None], prompt_table)
    pick = lambda new, old: jnp.where(admit.reshape(admit.shape + (1,) * (old.ndim - 1)), new, old)
    if state.turn is not None:
        turn = state.turn
        state = state._replace(
            turn=turn._replace(
                paused=pick(False, turn.paused), forced_until=pick(0, turn.forced_until), calls=pick(0, turn.calls)
            )
        )
    return state._replace(
        row=pick(row, state.row),
        step=pick(0, state.step),
        length=pick(length, state.length),
        pages=pick(shared + copied, state.pages),
        shared=pick(shared, state.shared),
        tables=pick(prompt_table, state.tables),
        logits=pick(prompt_logits[prompt], state.logits),
        pool=pool,
        next_row=state.next_row + admit.sum(),
    )


def _sample_and_allocate(
    state: _State,
    shard: Int[Array, ""],
    layout: Layout,
    rng: PRNGKeyArray,
    eos: Int[Array, " E"],
    temperature: float,
    top_p: float,
    calls: Int[Array, " C"] | None = None,
    max_turns: int = 1,
) -> tuple[_State, Int[Array, " S"], Int[Array, " S"], Bool[Array, " S"], Bool[Array, " S"], Bool[Array, " S"]]:
    """Samples each running slot's token (or takes the environment's, in a conversation), records
    it, and gives a fresh page to rows starting one. A sampled `calls` token pauses its row after
    it is fed, or ends it when the row has made `max_turns - 1` calls. Returns (state, tokens [S],
    the page each token's keys and values go to [S], feeds [S], ends [S], pauses [S])."""
    live = state.row >= 0
    turn = state.turn
    running = live if turn is None else live & ~turn.paused
    global_row = shard * layout.shard_rows + jnp.maximum(state.row, 0)
    keys = jax.vmap(lambda r, t: jax.random.fold_in(jax.random.fold_in(rng, r), t))(global_row, state.step)
    tokens = jax.vmap(lambda key, logits: sample_token(key, logits[None], temperature, top_p)[0])(keys, state.logits)
    forced = jnp.zeros_like(live)
    if turn is not None:
        forced = running & (state.step < turn.forced_until)
        written = state.response[jnp.maximum(state.row, 0), jnp.minimum(state.step, layout.max_new_tokens - 1)]
        tokens = jnp.where(forced, written, tokens)
    log_prob_temperature = temperature if temperature > 0 else 1.0  # greedy reports the policy's own log-probs
    scaled = state.logits / log_prob_temperature
    log_probs = jnp.take_along_axis(scaled, tokens[:, None], 1)[:, 0] - jax.nn.logsumexp(scaled, axis=-1)
    sampled = running & ~forced
    ends = (sampled & jnp.isin(tokens, eos)) | (running & (state.step + 1 >= layout.max_new_tokens))
    pauses = jnp.zeros_like(live)
    if turn is not None and calls is not None:
        calling = sampled & jnp.isin(tokens, calls) & ~ends
        ends = ends | (calling & (turn.calls + 1 >= max_turns))
        pauses = calling & ~ends
    feeds = running & ~ends
    record, ended = (
        jnp.where(running, state.row, layout.shard_rows),
        jnp.where(ends, state.row, layout.shard_rows),
    )  # off the end: dropped
    state = state._replace(
        response=state.response.at[record, state.step].set(tokens, mode="drop"),
        log_probs=state.log_probs.at[record, state.step].set(jnp.where(forced, 0.0, log_probs), mode="drop"),
        response_length=state.response_length.at[ended].set(state.step + 1, mode="drop"),
    )
    if turn is not None:
        env_mask = turn.env_mask.at[record, state.step].set(forced, mode="drop")
        state = state._replace(turn=turn._replace(env_mask=env_mask))
    needs_page = feeds & (state.length == state.pages * layout.page_size)
    page, state = _take_pages(state, needs_page)
    slot = jnp.arange(layout.slots)
    tables = state.tables.at[slot, jnp.where(needs_page, state.pages, layout.table_width)].set(page, mode="drop")
    entry = jnp.minimum(state.length // layout.page_size, layout.table_width - 1)
    write_page = jnp.where(feeds, tables[slot, entry], TRASH_PAGE)
    return state._replace(tables=tables, pages=state.pages + needs_page), tokens, write_page, feeds, ends, pauses


def _finish_step(
    state: _State,
    pool: paged_cache.PagePool,
    logits: Float[Array, "S V"],
    feeds: Bool[Array, " S"],
    ends: Bool[Array, " S"],
    pauses: Bool[Array, " S"],
) -> _State:
    running = state.row >= 0
    turn = state.turn
    if turn is not None:  # a waiting row keeps the logits after its call: an empty reply samples from them
        logits = jnp.where(turn.paused[:, None], state.logits, logits)
        running = running & ~turn.paused
        state = state._replace(turn=turn._replace(paused=turn.paused | pauses, calls=turn.calls + pauses))
    state = _return_pages(state._replace(pool=pool), ends)
    return state._replace(
        row=jnp.where(ends, -1, state.row),
        step=state.step + running,
        length=state.length + feeds,
        logits=logits,
        rows_done=state.rows_done + ends.sum(),  # a slot that did not feed is idle: admission sets its logits
    )


def _resume(
    state: _State,
    layout: Layout,
    replies: Int[Array, "S Q"],
    reply_lengths: Int[Array, " S"],
    end: Bool[Array, " S"],
) -> _State:
    """The host's answer to one shard's waiting rows: each either ends (`end`: its response stops
    after the call) or gets `replies[:reply_lengths]` written as its next tokens (cut at
    `max_new_tokens`), which it feeds before it samples again."""
    turn = state.turn
    assert turn is not None, "resume needs a multi-turn engine state"
    ending = turn.paused & end
    answering = turn.paused & ~end
    count = jnp.minimum(reply_lengths, layout.max_new_tokens - state.step)
    column = state.step[:, None] + jnp.arange(replies.shape[1])[None]
    written = answering[:, None] & (jnp.arange(replies.shape[1])[None] < count[:, None])
    target = jnp.where(written, state.row[:, None], layout.shard_rows)  # off the end: dropped
    state = _return_pages(state, ending)
    return state._replace(
        row=jnp.where(ending, -1, state.row),
        response=state.response.at[target, column].set(replies, mode="drop"),
        response_length=state.response_length.at[jnp.where(ending, state.row, layout.shard_rows)].set(
            state.step, mode="drop"
        ),
        rows_done=state.rows_done + ending.sum(),
        turn=turn._replace(
            paused=jnp.zeros_like(turn.paused),
            forced_until=jnp.where(answering, state.step + count, turn.forced_until),
        ),
    )


# --- all shards at once ----------------------------------------------------------------------


def layer_weights(params: dict, unrolled: bool) -> dict[str, Array] | tuple[dict[str, Array], ...]:
    """The decoder layers as `decode_layers` takes them: stacked [N, ...] (scanned), or a tuple of
    per-layer dicts with fused projections (unrolled, `fuse_projections`). On CPU a scanned
    layer's weights are copied out of the stack at every step (its matmuls need them contiguous):
    split once before decoding, they are read in place."""
    stacked = params["layers"]
    if not unrolled:
        return stacked
    fused = fuse_projections(stacked)
    return tuple(jax.tree.map(lambda w: w[i], fused) for i in range(stacked["q_proj"].shape[0]))


def decode_layers(
    params: dict,
    layers: dict[str, Array] | tuple[dict[str, Array], ...],
    config: ModelConfig,
    tokens: Int[Array, "D S"],
    pool: paged_cache.PagePool,
    tables: Int[Array, "D S W"],
    length: Int[Array, "D S"],
    write_page: Int[Array, "D S"],
    backend: str,
    num_pages: int | Int[Array, ""] | None = None,
) -> tuple[Float[Array, "D S V"], paged_cache.PagePool]:
    """Feeds one token per slot, tokens [D, S] at positions `length` [D, S], its keys and values
    going to `write_page` [D, S]; attends over each slot's pages `tables` [D, S, W] in its shard's
    pool. `layers` comes from `layer_weights`. The XLA path reads the first `num_pages` (traced)
    pages of every table; the kernels read each row's own. Returns (next logits
    [D, S, V], pool)."""
    dtype = jnp.dtype(config.dtype)
    inv_freq = jnp.asarray(rope_inv_freq(config))
    shards, slots = tokens.shape
    # Fewer rows than a TPU tile's sublanes turn each layer's matmul into float32 copies of its
    # weights: idle rows (position 0, writing to the trash page) fill the tile.
    padding = max(TPU_ROWS - slots, 0) if sharding.context_platform() == "tpu" else 0
    if padding:
        pad = lambda a: jnp.pad(a, ((0, 0), (0, padding)) + ((0, 0),) * (a.ndim - 2), constant_values=TRASH_PAGE)
        tokens, tables, length, write_page = pad(tokens), pad(tables), pad(length), pad(write_page)
        slots += padding
    offset = length % pool.page_size
    per_shard = lambda a: a.reshape((shards, slots) + a.shape[1:])

    def layer_step(
        carry: tuple[Array, paged_cache.PagePool], scanned: tuple[dict[str, Array], int | Array]
    ) -> tuple[tuple[Array, paged_cache.PagePool], None]:
        x, pool = carry
        layer, index = scanned

        def attention(q: Array, k: Array, v: Array) -> tuple[Array, paged_cache.PagePool]:
            write = lambda pool, *rows: paged_cache.write_tokens(pool, index, *rows)
            pool_now = jax.vmap(write)(pool, write_page, offset, per_shard(k[:, 0]), per_shard(v[:, 0]))
            out = paged_cache.sharded_decode_attention(
                per_shard(q[:, 0]), pool_now, index, tables, length + 1, backend=backend, num_pages=num_pages
            )
            return out.reshape(q.shape), pool_now

        return _decoder_layer(layer, x, length.reshape(-1, 1), config, inv_freq, attention), None

    x = embed_tokens(params, tokens.reshape(-1), dtype)[:, None]
    if isinstance(layers, tuple):
        for index, layer in enumerate(layers):
            (x, pool), _ = layer_step((x, pool), (layer, index))
    else:
        (x, pool), _ = jax.lax.scan(layer_step, (x, pool), (layers, jnp.arange(config.num_layers)))
    logits = lm_logits(params, config, rms_norm(x, params["final_norm"], config.rms_norm_eps))[:, 0]
    return per_shard(logits)[:, : slots - padding], pool


class Prefilled(NamedTuple):
    """The prompts as the engine keeps them between decode calls."""

    tokens: Int[Array, "B P"]  # right-padded prompts
    lengths: Int[Array, " B"]
    shard_lengths: Int[Array, "D prompts"]  # each shard's prompts' lengths
    logits: Float[Array, "D prompts V"]  # at each one's last token


def _place_pool(state: _State, config: ModelConfig) -> _State:
    pool = state.pool
    return state._replace(
        pool=pool.with_arrays(
            *sharding.constrain(pool.arrays, paged_cache.pool_specs(pool, config.num_heads)),
            scales=sharding.constrain(pool.scales, paged_cache.scale_specs(pool, config.num_heads)),
        )
    )


def start_engine(
    params: dict,
    config: ModelConfig,
    prompt_tokens: Int[Array, "B P"],
    prompt_mask: Bool[Array, "B P"],
    layout: Layout,
    *,
    pad: int,
    backend: str,
    kv_dtype: str = "auto",
    multi_turn: bool = False,
) -> tuple[Prefilled, _State]:
    """Prefills every prompt into its shard's page pool; returns (the prompts, the engine state
    with no row admitted yet)."""
    tokens, mask = right_align_prompts(prompt_tokens.astype(jnp.int32), prompt_mask.astype(bool), pad)
    shard_prompts = layout.shard_prompts().reshape(-1)
    prompt_logits, keys, values = prefill_prompts(params, config, tokens[shard_prompts], mask[shard_prompts], layout)
    lengths = mask.sum(axis=1).astype(jnp.int32)

    def shard_init(keys: Array, values: Array) -> _State:
        pool = paged_cache.empty_pool(
            config.num_layers,
            layout.pages_per_layer,
            layout.page_size,
            pool_kv_heads(config),
            config.head_dim,
            paged_cache.kv_dtype(kv_dtype, config.dtype),
            backend,
        )
        pool = paged_cache.write_pages(pool, 1, keys, values)
        return _initial_state(pool, layout, prompt_logits.shape[-1], pad, multi_turn)

    state = _place_pool(jax.vmap(shard_init)(keys, values), config)
    prefilled = Prefilled(tokens, lengths, lengths[shard_prompts].reshape(layout.shards, layout.prompts), prompt_logits)
    return prefilled, state


def decode(
    params: dict,
    config: ModelConfig,
    prefilled: Prefilled,
    state: _State,
    layout: Layout,
    rng: PRNGKeyArray,
    *,
    temperature: float,
    top_p: float,
    eos: Int[Array, " E"],
    backend: str,
    calls: Int[Array, " C"] | None = None,
    max_turns: int = 1,
) -> _State:
    """Runs the decode loop until every row has ended, or (a conversation) until every row still
    running waits for its environment and no slot can take another row."""
    layers = layer_weights(params, unrolled=layers_unrolled())
    shard_ids, first_prompts = jnp.arange(layout.shards), jnp.asarray(layout.first_prompts())

    def body(state: _State) -> _State:
        waiting = jnp.any((state.row < 0) & (state.next_row < layout.shard_rows)[:, None])
        # (mypy cannot match a *tuple of unknown length followed by more positional arguments)
        admit = jax.vmap(lambda s, *shard: _admit(s, *shard[:2], layout, *shard[2:]))  # type: ignore[call-arg]
        with jax.named_scope(ADMIT_SCOPE):
            state = jax.lax.cond(
                waiting,
                lambda s: admit(s, shard_ids, first_prompts, prefilled.shard_lengths, prefilled.logits),
                lambda s: s,
                state,
            )
        state, tokens, write_page, feeds, ends, pauses = jax.vmap(
            lambda s, shard: _sample_and_allocate(s, shard, layout, rng, eos, temperature, top_p, calls, max_turns)
        )(state, shard_ids)
        # The XLA path reads only the pages the longest live row needs.
        needed = jnp.max(jnp.where(feeds, state.length // layout.page_size + 1, 1))
        logits, pool = decode_layers(
            params, layers, config, tokens, state.pool, state.tables, state.length, write_page, backend, needed
        )
        return _place_pool(jax.vmap(_finish_step)(state, pool, logits, feeds, ends, pauses), config)

    def more(state: _State) -> Bool[Array, ""]:
        if state.turn is None:
            return jnp.sum(state.rows_done) < layout.shards * layout.shard_rows
        running = (state.row >= 0) & ~state.turn.paused
        admissible = (state.row < 0) & (state.next_row < layout.shard_rows)[:, None]
        return jnp.any(running | admissible)

    with jax.named_scope(DECODE_SCOPE):
        return jax.lax.while_loop(more, body, state)


def resume(
    state: _State,
    layout: Layout,
    replies: Int[Array, "D S Q"],
    reply_lengths: Int[Array, "D S"],
    end: Bool[Array, "D S"],
) -> _State:
    """`_resume` on every shard: the host's answers to the rows waiting for their environment."""
    return jax.vmap(lambda s, *answer: _resume(s, layout, *answer))(state, replies, reply_lengths, end)


def engine_outputs(
    prefilled: Prefilled, state: _State, layout: Layout
) -> tuple[Int[Array, "B P"], Int[Array, " B"], Int[Array, "R T"], Float[Array, "R T"], Int[Array, " R"]]:
    """(right-padded prompts [B, P], their lengths [B], response [R, T], log-probs [R, T], response
    lengths [R])."""
    flat = lambda a: a.reshape((-1,) + a.shape[2:])[: layout.rows]
    return (
        prefilled.tokens,
        prefilled.lengths,
        flat(state.response),
        flat(state.log_probs),
        flat(state.response_length),
    )


def run_engine(
    params: dict,
    config: ModelConfig,
    prompt_tokens: Int[Array, "B P"],
    prompt_mask: Bool[Array, "B P"],
    rng: PRNGKeyArray,
    *,
    num_samples: int,
    max_new_tokens: int,
    page_size: int,
    decode_slots: int | None,
    temperature: float,
    top_p: float,
    eos: Int[Array, " E"],
    pad: int,
    backend: str,
    kv_dtype: str = "auto",
) -> tuple[Int[Array, "B P"], Int[Array, " B"], Int[Array, "R T"], Float[Array, "R T"], Int[Array, " R"]]:
    """Generates every row. Returns (right-padded prompts [B, P], their lengths [B], response [R, T],
    log-probs [R, T], response lengths [R]). `kv_dtype`: the pages' (`paged_cache.KV_DTYPES`).
    Traced inside `generate`'s jit."""
    layout = make_layout(
        prompt_tokens.shape[0],
        prompt_tokens.shape[1],
        num_samples=num_samples,
        max_new_tokens=max_new_tokens,
        page_size=page_size,
        decode_slots=decode_slots,
        shards=sharding.context_batch_shards(),
    )
    prefilled, state = start_engine(
        params, config, prompt_tokens, prompt_mask, layout, pad=pad, backend=backend, kv_dtype=kv_dtype
    )
    state = decode(
        params, config, prefilled, state, layout, rng, temperature=temperature, top_p=top_p, eos=eos, backend=backend
    )
    return engine_outputs(prefilled, state, layout)
