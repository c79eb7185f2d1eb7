"""KV-cache sampler and scoring pass against teacher-forced `forward`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from comppo_jax.credit import gate_range, retention_gate, statistic_concentration
from comppo_jax.models import ModelConfig, forward, init_params
from comppo_jax.models.kv_cache import decode_step, prefill
from comppo_jax.rollout import generate
from comppo_jax.rollout.dense import left_align
from comppo_jax.rollout.scoring import gather_response, policy_gate, score_rollout
from pallas_kernels import window_sizes

CONFIG = ModelConfig(
    architecture="qwen3",
    vocab_size=50,
    hidden_size=32,
    intermediate_size=48,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    tie_word_embeddings=False,
    eos_token_ids=(),
    pad_token_id=0,
)
# Right-padded, left-padded and full prompt rows.
PROMPTS = jnp.asarray([[5, 6, 7, 8, 9], [11, 12, 13, 0, 0], [0, 0, 21, 22, 23]], jnp.int32)
PROMPT_MASK = jnp.asarray([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [0, 0, 1, 1, 1]], bool)


@pytest.fixture(scope="module")
def params():
    return init_params(CONFIG, jax.random.PRNGKey(0), init_std=0.3)


def real_prompt(row):
    return [int(t) for t, m in zip(PROMPTS[row], PROMPT_MASK[row]) if m]


def test_greedy_decode_equals_step_by_step_argmax_of_forward(params):
    steps = 6
    out = generate(params, CONFIG, PROMPTS, PROMPT_MASK, jax.random.PRNGKey(1), max_new_tokens=steps, temperature=0.0)
    for row in range(PROMPTS.shape[0]):
        sequence = real_prompt(row)
        for _ in range(steps):
            logits = forward(params, CONFIG, jnp.asarray([sequence]), jnp.ones((1, len(sequence)), bool)).logits
            sequence.append(int(jnp.argmax(logits[0, -1])))
        length = len(sequence)
        np.testing.assert_array_equal(out.tokens[row, :length], sequence)
        assert bool(out.attention_mask[row, :length].all()) and not bool(out.attention_mask[row, length:].any())
        assert int(out.prompt_lengths[row]) == len(real_prompt(row))


def test_kv_cache_logits_equal_full_forward_logits(params):
    continuation = jnp.asarray([[3, 4, 5, 6], [7, 8, 9, 10], [11, 12, 13, 14]], jnp.int32)
    tokens, mask = left_align(PROMPTS, PROMPT_MASK, 0)
    logits, cache = prefill(params, CONFIG, tokens, mask, tokens.shape[1] + continuation.shape[1])
    for step in range(continuation.shape[1]):
        for row in range(PROMPTS.shape[0]):
            sequence = real_prompt(row) + [int(t) for t in continuation[row, :step]]
            full = forward(params, CONFIG, jnp.asarray([sequence]), jnp.ones((1, len(sequence)), bool)).logits[0, -1]
            np.testing.assert_allclose(logits[row], full, atol=1e-4)
        logits, cache = decode_step(params, CONFIG, continuation[:, step], cache, tokens.shape[1] + step)


def test_eos_stops_rows_and_pads_after_it(params):
    greedy = generate(params, CONFIG, PROMPTS, PROMPT_MASK, jax.random.PRNGKey(1), max_new_tokens=6, temperature=0.0)
    eos = int(greedy.response_tokens[0, 2])  # row 0 emits it at step 3 (maybe earlier too)
    out = generate(
        params,
        CONFIG,
        PROMPTS,
        PROMPT_MASK,
        jax.random.PRNGKey(1),
        max_new_tokens=6,
        temperature=0.0,
        eos_token_ids=(eos,),
    )
    for row in range(PROMPTS.shape[0]):
        greedy_response = [int(t) for t in greedy.response_tokens[row]]
        expected = greedy_response[: greedy_response.index(eos) + 1] if eos in greedy_response else greedy_response
        length = len(expected)
        np.testing.assert_array_equal(out.response_tokens[row, :length], expected)
        assert int(out.response_mask[row].sum()) == length and bool((out.response_tokens[row, length:] == 0).all())
        assert float(jnp.abs(out.log_probs[row, length:]).sum()) == 0.0
        assert int(out.attention_mask[row].sum()) == int(out.prompt_lengths[row]) + length
    assert int(out.response_mask[0].sum()) <= 3


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 1.0), (1.0, 0.7)])
def test_sampling_log_probs_equal_the_scoring_pass(params, temperature, top_p):
    out = generate(
        params,
        CONFIG,
        PROMPTS,
        PROMPT_MASK,
        jax.random.PRNGKey(2),
        max_new_tokens=7,
        temperature=temperature,
        top_p=top_p,
        num_samples=2,
    )
    scored = score_rollout(params, params, CONFIG, out, temperature=temperature, top_k=4, backend="reference")
    np.testing.assert_allclose(scored.log_probs, out.log_probs, atol=1e-5)
    np.testing.assert_allclose(scored.ref_log_probs, out.log_probs, atol=1e-5)


def test_sampler_log_probs_skip_the_behaviour_pass_only_where_nothing_else_needs_it(params):
    out = generate(params, CONFIG, PROMPTS, PROMPT_MASK, jax.random.PRNGKey(7), max_new_tokens=6, num_samples=2)
    rescored = score_rollout(params, params, CONFIG, out, top_k=None, backend="reference")
    # The sampler's log-probs stand in for the rescored ones; the gate still comes from the pass.
    kept = score_rollout(params, params, CONFIG, out, top_k=None, backend="reference", old_log_probs="sampler")
    np.testing.assert_array_equal(kept.log_probs, out.log_probs)
    np.testing.assert_array_equal(kept.kappa, rescored.kappa)
    # No behaviour forward: the reference alone runs, and there is no gate to report.
    alone = score_rollout(
        params, params, CONFIG, out, top_k=None, backend="reference", old_log_probs="sampler", behaviour_pass=False
    )
    np.testing.assert_array_equal(alone.log_probs, out.log_probs)
    np.testing.assert_array_equal(alone.ref_log_probs, rescored.ref_log_probs)
    assert (
        alone.herfindahl is None
        and alone.window_size is None
        and alone.kappa is None
        and alone.hidden_states.shape[0] == 0
    )
    for wrong in (
        dict(),
        dict(old_log_probs="sampler", top_k=4),
        dict(old_log_probs="sampler", top_k=None, hidden_layers=(1,)),
    ):
        with pytest.raises(
            ValueError, match="behaviour_pass=False needs old_log_probs='sampler' and no critic features"
        ):
            score_rollout(
                params, None, CONFIG, out, backend="reference", behaviour_pass=False, **{"top_k": None, **wrong}
            )
    with pytest.raises(ValueError, match="old_log_probs must be one of"):
        score_rollout(params, None, CONFIG, out, top_k=None, backend="reference", old_log_probs="stored")


def test_tiny_top_p_keeps_the_argmax_and_sampling_is_deterministic(params):
    greedy = generate(params, CONFIG, PROMPTS, PROMPT_MASK, jax.random.PRNGKey(0), max_new_tokens=5, temperature=0.0)
    nucleus = generate(
        params, CONFIG, PROMPTS, PROMPT_MASK, jax.random.PRNGKey(3), max_new_tokens=5, temperature=1.0, top_p=1e-6
    )
    np.testing.assert_array_equal(nucleus.tokens, greedy.tokens)
    first = generate(params, CONFIG, PROMPTS, PROMPT_MASK, jax.random.PRNGKey(4), max_new_tokens=8, num_samples=3)
    again = generate(params, CONFIG, PROMPTS, PROMPT_MASK, jax.random.PRNGKey(4), max_new_tokens=8, num_samples=3)
    other = generate(params, CONFIG, PROMPTS, PROMPT_MASK, jax.random.PRNGKey(5), max_new_tokens=8, num_samples=3)
    np.testing.assert_array_equal(first.tokens, again.tokens)
    assert not np.array_equal(first.tokens, other.tokens)
    assert first.tokens.shape[0] == 9
    np.testing.assert_array_equal(first.prompt_lengths, np.repeat([5, 3, 3], 3))  # groups are consecutive rows


def test_scoring_pass_reads_the_state_before_each_token(params):
    out = generate(params, CONFIG, PROMPTS, PROMPT_MASK, jax.random.PRNGKey(6), max_new_tokens=6)
    scored = score_rollout(params, None, CONFIG, out, top_k=None, backend="interpret", hidden_layers=(1, 2))
    assert scored.ref_log_probs is None and scored.routing is None and scored.hidden_states.shape[0] == 2
    valid = np.asarray(out.response_mask)
    # Response window: the state before y_t sees n_t = t - 1 response keys.
    np.testing.assert_array_equal(
        np.asarray(scored.window_size)[valid], np.broadcast_to(np.arange(6), valid.shape)[valid]
    )
    low, high = gate_range()
    kappa = np.asarray(scored.kappa)
    assert ((kappa[valid] >= low - 1e-6) & (kappa[valid] <= high + 1e-6)).all() and (kappa[~valid] == 0).all()
    full = forward(params, CONFIG, out.tokens, out.attention_mask, out.prompt_lengths)
    np.testing.assert_allclose(
        np.asarray(scored.herfindahl)[valid],
        np.asarray(gather_response(full.herfindahl, out.prompt_lengths, 6))[valid],
        atol=1e-6,
    )


@pytest.mark.parametrize("statistic", ["entropy", "sink_herfindahl", "max_weight"])
def test_the_gate_reads_the_configured_statistic_and_the_gate_alone_matches_the_scoring_pass(params, statistic):
    """kappa from each statistic's c (full window, 2 sink tokens), from the materialized final-layer
    attention; `policy_gate` (gate_refresh's pass) gives the same kappa without logits or features."""
    out = generate(params, CONFIG, PROMPTS, PROMPT_MASK, jax.random.PRNGKey(6), max_new_tokens=6)
    options = dict(window="full", gate_statistic=statistic, sink_tokens=2)
    scored = score_rollout(params, None, CONFIG, out, top_k=None, backend="interpret", **options)
    valid = np.asarray(out.response_mask)
    start = jnp.zeros_like(out.prompt_lengths)
    full = forward(
        params,
        CONFIG,
        out.tokens,
        out.attention_mask,
        start,
        concentration_backend="reference",
        concentration_statistics=(statistic,),
        sink_tokens=2,
    )
    value = gather_response(full.statistics[statistic], out.prompt_lengths, 6)
    n = gather_response(
        window_sizes(out.attention_mask, start + 2) if statistic == "sink_herfindahl" else full.window_size,
        out.prompt_lengths,
        6,
    )
    expected = retention_gate(statistic_concentration(statistic, value, n))
    np.testing.assert_allclose(np.asarray(scored.kappa)[valid], np.asarray(expected)[valid], atol=1e-5)
    np.testing.assert_allclose(
        np.asarray(scored.herfindahl)[valid],
        np.asarray(gather_response(full.herfindahl, out.prompt_lengths, 6))[valid],
        atol=1e-6,
    )
    alone = policy_gate(
        params,
        CONFIG,
        out.tokens,
        out.attention_mask,
        out.prompt_lengths,
        out.response_mask,
        length=6,
        backend="interpret",
        **options,
    )
    np.testing.assert_allclose(np.asarray(alone), np.asarray(scored.kappa), atol=1e-6)


def test_bad_prompt_shapes_are_named(params):
    with pytest.raises(ValueError, match=r"prompt_tokens and prompt_mask must both be \[B, P\]"):
        generate(params, CONFIG, PROMPTS, PROMPT_MASK[:, :3], jax.random.PRNGKey(0), max_new_tokens=2)
    with pytest.raises(ValueError, match=r"window must be one of"):
        out = generate(params, CONFIG, PROMPTS, PROMPT_MASK, jax.random.PRNGKey(0), max_new_tokens=2)
        score_rollout(params, None, CONFIG, out, window="prompt")
