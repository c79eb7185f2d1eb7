"""`entropy_top_mask` against the rule of Wang et al. 2025's code in NumPy: of the n valid tokens, the
k = max(1, int(rho n + 0.9999)) of highest entropy (torch.topk over the flattened valid tokens); equal
entropies ranked by position, padding never kept."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from comppo_jax.credit.losses import entropy_top_mask


def authors_rule(entropy: np.ndarray, mask: np.ndarray, fraction: float) -> tuple[np.ndarray, float]:
    """(keep, tau) of their get_global_entropy_top_mask, ties by position (a stable descending sort)."""
    flat = np.flatnonzero(mask)
    if flat.size == 0:
        return np.zeros(mask.shape, bool), 0.0
    k = max(1, int(flat.size * fraction + 0.9999))
    top = flat[np.argsort(-entropy.ravel()[flat], kind="stable")[:k]]
    keep = np.zeros(mask.size, bool)
    keep[top] = True
    return keep.reshape(mask.shape), float(entropy.ravel()[top[-1]])


def ragged(rng, rows=5, width=9):
    """Exponential entropies (most small, a few large, as a policy's) and right-padded rows of 1..width tokens."""
    entropy = rng.exponential(0.5, (rows, width)).astype(np.float32)
    mask = np.arange(width)[None] < rng.integers(1, width + 1, rows)[:, None]
    return entropy, mask


@pytest.mark.parametrize("fraction", [0.2, 0.35, 0.5, 0.9, 1.0])
def test_the_mask_keeps_the_top_fraction_of_the_valid_tokens_by_entropy(fraction):
    rng = np.random.default_rng(0)
    for _ in range(3):
        entropy, mask = ragged(rng)
        keep, tau = entropy_top_mask(jnp.asarray(entropy), jnp.asarray(mask), fraction)
        want, want_tau = authors_rule(entropy, mask, fraction)
        np.testing.assert_array_equal(keep, want)
        assert float(tau) == want_tau
        assert np.all(entropy[mask & ~want] <= want_tau) and np.all(entropy[want] >= want_tau)


def test_fraction_one_keeps_every_valid_token_and_padding_is_never_kept():
    rng = np.random.default_rng(1)
    entropy, mask = ragged(rng)
    # Padding with the largest entropies, and garbage: still never selected.
    padded = np.where(mask, entropy, np.float32(50.0))
    padded[0, -1], padded[1, -1] = np.inf, np.nan
    mask[0, -1] = mask[1, -1] = False
    keep, tau = entropy_top_mask(jnp.asarray(padded), jnp.asarray(mask), 1.0)
    np.testing.assert_array_equal(keep, mask)
    assert float(tau) == entropy[mask].min()
    for fraction in (0.05, 0.2, 0.5):
        keep, tau = entropy_top_mask(jnp.asarray(padded), jnp.asarray(mask), fraction)
        assert not np.any(np.asarray(keep) & ~mask) and np.isfinite(float(tau))
        np.testing.assert_array_equal(keep, authors_rule(np.where(mask, padded, 0.0), mask, fraction)[0])


def test_ties_at_the_threshold_keep_exactly_k_tokens_the_first_in_position_order():
    """The authors' top-k keeps exactly k: of the tokens tied at tau, only as many as fill k, where the paper's
    indicator I[H >= tau] would keep them all. Here 10 valid tokens, k = 2 at 0.2; three tie at the top."""
    entropy = np.array([[0.1, 0.7, 0.2, 0.7, 0.0, 9.0], [0.7, 0.3, 0.3, 0.3, 0.1, 9.0]], np.float32)
    mask = np.array([[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 0]], bool)
    keep, tau = entropy_top_mask(jnp.asarray(entropy), jnp.asarray(mask), 0.2)
    np.testing.assert_array_equal(keep, [[0, 1, 0, 1, 0, 0], [0, 0, 0, 0, 0, 0]])
    assert float(tau) == pytest.approx(0.7)
    # k = 4: every 0.7 kept, then one of the three tied 0.3s, the first.
    keep = entropy_top_mask(jnp.asarray(entropy), jnp.asarray(mask), 0.4)[0]
    np.testing.assert_array_equal(keep, [[0, 1, 0, 1, 0, 0], [1, 1, 0, 0, 0, 0]])
    np.testing.assert_array_equal(keep, authors_rule(entropy, mask, 0.4)[0])
    # All equal (a policy certain everywhere, entropy 0): still exactly k, not every token.
    keep = entropy_top_mask(jnp.zeros(mask.shape), jnp.asarray(mask), 0.2)[0]
    assert int(np.sum(keep)) == 2


def test_k_is_the_authors_ceiling_for_every_token_count():
    """k = max(1, int(rho n + 0.9999)) for n = 0..599 valid tokens (none kept at n = 0), in one vmapped call."""
    width = 600
    masks = np.arange(width)[None, None, :] < np.arange(width)[:, None, None]  # [n, 1, width]: n valid tokens
    entropy = jnp.asarray(np.random.default_rng(2).exponential(size=(1, width)), jnp.float32)
    for fraction in (0.2, 0.1, 0.15, 0.25, 0.3, 0.33, 0.05, 0.8):
        keep, _ = jax.vmap(entropy_top_mask, in_axes=(None, 0, None))(entropy, jnp.asarray(masks), fraction)
        want = [max(1, int(n * fraction + 0.9999)) if n else 0 for n in range(width)]
        np.testing.assert_array_equal(np.asarray(keep).sum(axis=(1, 2)), want, err_msg=str(fraction))
    # A minibatch of a million tokens: ceil(0.3 n) exactly, no float rounding.
    keep = entropy_top_mask(jnp.ones((1024, 1024)), jnp.ones((1024, 1024), bool), 0.3)[0]
    assert int(np.sum(keep)) == 314573  # 0.3 * 2 ** 20 = 314572.8


def test_an_empty_mask_keeps_nothing_and_bad_fractions_are_refused():
    keep, tau = entropy_top_mask(jnp.ones((2, 3)), jnp.zeros((2, 3), bool), 0.2)
    assert not np.any(keep) and float(tau) == 0.0
    for fraction in (0.0, -0.1, 1.5):
        with pytest.raises(ValueError, match="fraction must be in"):
            entropy_top_mask(jnp.ones((2, 3)), jnp.ones((2, 3), bool), fraction)
    with pytest.raises(ValueError, match="mask has shape"):
        entropy_top_mask(jnp.ones((2, 3)), jnp.ones((2, 4), bool), 0.2)
