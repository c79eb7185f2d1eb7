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


# Rows the tests share, each sampler configuration compiled once (a compile costs seconds, a run milliseconds).
@pytest.fixture(scope="module")
def greedy(params):
    """Greedy rows, 6 tokens: no EOS in CONFIG, so every row runs to the end."""
    return generate(params, CONFIG, PROMPTS, PROMPT_MASK, jax.random.PRNGKey(1), max_new_tokens=6, temperature=0.0)


SAMPLING = dict(max_new_tokens=7, temperature=1.0, top_p=0.7, num_samples=2)


def sample(params, seed):
    return generate(params, CONFIG, PROMPTS, PROMPT_MASK, jax.random.PRNGKey(seed), **SAMPLING)


def rescore(params, out):
    """Both policies' scoring pass at the sampler's temperature (one compiled program for two tests)."""
    return score_rollout(params, params, CONFIG, out, temperature=SAMPLING["temperature"], top_k=4, backend="reference")


def real_prompt(row):
    return [int(t) for t, m in zip(PROMPTS[row], PROMPT_MASK[row]) if m]


def teacher_forced_logits(params, tokens, mask, prompt_lengths):
    """forward's logits [B, L, V] on right-padded rows (the scoring tests' forward, compiled once)."""
    return forward(params, CONFIG, tokens, mask, prompt_lengths).logits


def test_greedy_decode_equals_step_by_step_argmax_of_forward(params, greedy):
    """Each greedy token is the argmax of the teacher-forced logits at the position before it (causal:
    the logits of the prefix it was decoded from)."""
    out, steps = greedy, 6
    logits = teacher_forced_logits(params, out.tokens, out.attention_mask, out.prompt_lengths)
    for row in range(PROMPTS.shape[0]):
        prompt = real_prompt(row)
        sequence = prompt + [int(t) for t in out.response_tokens[row]]
        length = len(sequence)
        np.testing.assert_array_equal(out.tokens[row, :length], sequence)
        argmax = [int(jnp.argmax(logits[row, len(prompt) - 1 + t])) for t in range(steps)]
        assert sequence[len(prompt) :] == argmax
        assert bool(out.attention_mask[row, :length].all()) and not bool(out.attention_mask[row, length:].any())
        assert int(out.prompt_lengths[row]) == len(prompt)


def test_kv_cache_logits_equal_full_forward_logits(params):
    continuation = jnp.asarray([[3, 4, 5, 6], [7, 8, 9, 10], [11, 12, 13, 14]], jnp.int32)
    tokens, mask = left_align(PROMPTS, PROMPT_MASK, 0)
    # Jitted, as the dense sampler runs them: two programs instead of each op compiled eagerly.
    step = jax.jit(decode_step, static_argnums=1)
    logits, cache = jax.jit(prefill, static_argnums=(1, 4))(
        params, CONFIG, tokens, mask, tokens.shape[1] + continuation.shape[1]
    )
    # Each row's prompt + continuation, right-padded to the greedy rows' width (one forward for every prefix).
    width = PROMPTS.shape[1] + 6
    rows = [real_prompt(row) + [int(t) for t in continuation[row]] for row in range(PROMPTS.shape[0])]
    full_tokens = jnp.asarray([r + [0] * (width - len(r)) for r in rows], jnp.int32)
    full_mask = jnp.arange(width)[None] < jnp.asarray([len(r) for r in rows])[:, None]
    prompt_lengths = jnp.asarray([len(real_prompt(row)) for row in range(PROMPTS.shape[0])], jnp.int32)
    full = teacher_forced_logits(params, full_tokens, full_mask, prompt_lengths)
    for t in range(continuation.shape[1]):
        for row in range(PROMPTS.shape[0]):
            np.testing.assert_allclose(logits[row], full[row, len(real_prompt(row)) - 1 + t], atol=1e-4)
        logits, cache = step(params, CONFIG, continuation[:, t], cache, tokens.shape[1] + t)


def test_eos_stops_rows_and_pads_after_it(params, greedy):
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


def test_sampling_log_probs_equal_the_scoring_pass(params):
    """Nucleus sampling (the log-probs are before its truncation); another temperature, with rows waiting
    for slots: tests/rollout/test_engine.py; top_p 1: tests/rollout/test_conversations.py."""
    out = sample(params, 2)
    scored = rescore(params, out)
    np.testing.assert_allclose(scored.log_probs, out.log_probs, atol=1e-5)
    np.testing.assert_allclose(scored.ref_log_probs, out.log_probs, atol=1e-5)


def test_sampler_log_probs_skip_the_behaviour_pass_only_where_nothing_else_needs_it(params):
    out = sample(params, 7)
    rescored = rescore(params, out)  # at temperature 1, as the passes below
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


def test_tiny_top_p_keeps_the_argmax_and_sampling_is_deterministic(params, greedy):
    nucleus = generate(
        params, CONFIG, PROMPTS, PROMPT_MASK, jax.random.PRNGKey(3), max_new_tokens=6, temperature=1.0, top_p=1e-6
    )
    np.testing.assert_array_equal(nucleus.tokens, greedy.tokens)
    first, again, other = sample(params, 4), sample(params, 4), sample(params, 5)
    np.testing.assert_array_equal(first.tokens, again.tokens)
    assert not np.array_equal(first.tokens, other.tokens)
    assert first.tokens.shape[0] == 6
    np.testing.assert_array_equal(first.prompt_lengths, np.repeat([5, 3, 3], 2))  # groups are consecutive rows


def test_scoring_pass_reads_the_state_before_each_token(params, greedy):
    out = greedy  # the pass reads the rows, whichever way they were sampled
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


STATISTICS = ("entropy", "sink_herfindahl", "max_weight")


@pytest.fixture(scope="module")
def full_window_statistics(params, greedy):
    """forward's materialized final-layer statistics of the greedy rows over the full window (2 sink
    tokens), every statistic from one pass."""
    start = jnp.zeros_like(greedy.prompt_lengths)
    return forward(
        params,
        CONFIG,
        greedy.tokens,
        greedy.attention_mask,
        start,
        concentration_backend="reference",
        concentration_statistics=STATISTICS,
        sink_tokens=2,
    )


def full_window_gate(params, out, statistic):
    options = dict(window="full", gate_statistic=statistic, sink_tokens=2)
    return score_rollout(params, None, CONFIG, out, top_k=None, backend="interpret", **options), options


@pytest.mark.parametrize("statistic", STATISTICS)
def test_the_gate_reads_the_configured_statistic(params, greedy, full_window_statistics, statistic):
    """kappa from each statistic's c (full window, 2 sink tokens), from the materialized final-layer
    attention."""
    out, full = greedy, full_window_statistics
    scored, _ = full_window_gate(params, out, statistic)
    valid = np.asarray(out.response_mask)
    start = jnp.zeros_like(out.prompt_lengths)
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


def test_the_gate_alone_matches_the_scoring_pass(params, greedy):
    """`policy_gate` (gate_refresh's pass) gives the scoring pass's kappa without logits or features. With
    sink_herfindahl, whose window and sink tokens it must pass on as well; the statistic itself reaches
    both through the same `response_gate`, checked for each statistic above."""
    out = greedy
    scored, options = full_window_gate(params, out, "sink_herfindahl")
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


def test_bad_prompt_shapes_are_named(params, greedy):
    with pytest.raises(ValueError, match=r"prompt_tokens and prompt_mask must both be \[B, P\]"):
        generate(params, CONFIG, PROMPTS, PROMPT_MASK[:, :3], jax.random.PRNGKey(0), max_new_tokens=2)
    with pytest.raises(ValueError, match=r"window must be one of"):
        score_rollout(params, None, CONFIG, greedy, window="prompt")
