"""Per-step diagnostics of the gate and the critic (host-side NumPy, over valid response tokens).

Gate: mean, median and interquartile range of kappa, its mean over the first / middle / last third of
each response (t / T_i), and its mean on correct versus incorrect responses.
Critic: explained variance of the returns G_t by V_t, the Spearman rank correlation of V_t with
its one-step TD target r_t + kappa_t V_{t+1} m_{t+1} (eq. comp_td), the mean absolute error
|V_t - G_t|, and the fraction of values saturated at the [-1, 1] clamp (eq. value_mix).
Credit against the outcome (docs/conventions.md, "Credit against the outcome"): what the critic
knows of each response's Monte-Carlo return, whether the advantages of a response's first half
carry the outcome's sign, and how far back the estimator's transport carries a final reward.
The critic's own EV above is measured against its own bootstrapped targets, so a critic that
knows nothing of the outcome can score well there; these cannot be fooled that way.
"""

from __future__ import annotations

import numpy as np

from comppo_jax.runs.outputs import AGAINST_THE_OUTCOME

CLAMP_SATURATION = 0.99  # |V| at or above this fraction of the clamp counts as saturated
# Targets whose standard deviation is at most this fraction of their largest magnitude are equal up to float32
# rounding: an explained variance over their variance is no measurement (it once logged -1e13 for a batch
# with no correct response under lambda 1).
EQUAL_UP_TO_ROUNDING = 1e-5


def gate_statistics(kappa, mask, correct) -> dict[str, float]:
    """kappa, mask [B, T]; correct [B] bool. Keys with no tokens behind them are left out."""
    kappa, mask, correct = np.asarray(kappa, np.float64), np.asarray(mask, bool), np.asarray(correct, bool)
    if not mask.any():
        return {}
    valid = kappa[mask]
    q25, q75 = np.percentile(valid, [25, 75])
    lengths = mask.sum(axis=1, keepdims=True)
    third = np.minimum((3 * np.arange(mask.shape[1])[None, :]) // np.maximum(lengths, 1), 2)
    out = {"gate/mean": float(valid.mean()), "gate/median": float(np.median(valid)), "gate/iqr": float(q75 - q25)}
    groups = {f"gate/{name}_third": mask & (third == i) for i, name in enumerate(("first", "middle", "last"))}
    groups.update({"gate/correct": mask & correct[:, None], "gate/incorrect": mask & ~correct[:, None]})
    out.update({name: float(kappa[where].mean()) for name, where in groups.items() if where.any()})
    return out


def average_ranks(x: np.ndarray) -> np.ndarray:
    """1-based ranks of `x`, ties sharing the mean of the ranks they span."""
    _, inverse, counts = np.unique(x, return_inverse=True, return_counts=True)
    last = np.cumsum(counts)
    return (last - (counts - 1) / 2.0)[inverse]


def spearman(x: np.ndarray, y: np.ndarray) -> float:
    """Spearman's rank correlation (the Pearson correlation of the average ranks), as
    scipy.stats.spearmanr computes it; here in NumPy, since scipy.stats costs every launch a second to import."""
    return float(np.corrcoef(average_ranks(x), average_ranks(y))[0, 1])


def explained_variance(target: np.ndarray, prediction: np.ndarray) -> float | None:
    """1 - Var(target - prediction) / Var(target); None when the targets are equal up to rounding."""
    if target.std() <= EQUAL_UP_TO_ROUNDING * np.abs(target).max():
        return None
    return float(1.0 - (target - prediction).var() / target.var())


def critic_diagnostics(values, returns, rewards, kappa, mask, clamp: float = 1.0) -> dict[str, float]:
    """values V_t, returns G_t, per-token rewards r_t, kappa [B, T] and the mask [B, T].

    Explained variance and the Spearman correlation are left out when undefined (constant
    returns, or constant values such as the zero-initialized critic's).
    """
    values, returns, rewards, kappa = (np.asarray(x, np.float64) for x in (values, returns, rewards, kappa))
    mask = np.asarray(mask, bool)
    if not mask.any():
        return {}
    next_values = np.concatenate([values[:, 1:] * mask[:, 1:], np.zeros_like(values[:, :1])], axis=1)
    td_target = rewards + kappa * next_values
    v, g, y = values[mask], returns[mask], td_target[mask]
    out = {
        "critic/value_mae": float(np.abs(v - g).mean()),
        "critic/clamp_saturation": float(np.mean(np.abs(v) >= CLAMP_SATURATION * clamp)),
    }
    ev = explained_variance(g, v)
    if ev is not None:
        out["critic/explained_variance"] = ev
    if np.ptp(v) > 0 and np.ptp(y) > 0:  # ptp: equal floats can have a std that rounds above 0
        out["critic/td_spearman"] = spearman(v, y)
    return out


def monte_carlo_returns(rewards: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """R_t = sum_{t' >= t} r_{t'} m_{t'} (gamma 1) [B, T]; with the paper's terminal reward, each response's
    outcome at every one of its tokens."""
    rewards = np.where(mask, rewards, 0.0)
    return np.cumsum(rewards[:, ::-1], axis=1)[:, ::-1]


def trace_horizon(transport: np.ndarray, mask: np.ndarray) -> float:
    """docs/conventions.md eq. (trace_horizon): the mean over responses of how many tokens keep at least
    1/e of a reward at the response's last token, under the estimator's realized transport c_t
    (A_t = delta_t + c_t A_{t+1}: lam kappa_t for Comp-GAE, gamma lam for GAE, 1 for a broadcast).
    Token t of a response ending at T keeps prod_{j=t}^{T-1} c_j of it."""
    lengths = mask.sum(axis=1)
    counts = []
    for row, length in zip(np.where(mask, transport, 0.0), lengths):
        if length == 0:
            continue
        with np.errstate(divide="ignore"):
            log_c = np.log(row[: length - 1])  # c_t for t < T: what A_t keeps of A_{t+1}
        kept = np.concatenate([np.cumsum(log_c[::-1])[::-1], [0.0]])  # log of what token t keeps of r_T
        counts.append(np.sum(kept >= -1.0))
    return float(np.mean(counts))


def outcome_diagnostics(advantages, values, rewards, transport, mask, one_outcome: bool = False) -> dict[str, float]:
    """The credit's health against the outcome (docs/conventions.md, "Credit against the outcome").

    advantages A_t (as the actor uses them), per-token rewards r_t, the estimator's transport c_t and
    the mask [B, T]; values V_t [B, T], or None for a method without a critic (its two fields left out).
    Fields left out where undefined: no first-half token with an advantage whose outcome differs from the batch
    mean, or outcomes equal up to rounding. `one_outcome` (every response had the same verdict and form,
    comppo_jax.runs.outputs.one_outcome): outcomes differ by the reward's shaping alone, so only the trace horizon
    is kept. Each row's valid tokens are a prefix, as the rollout lays responses out.
    """
    advantages, rewards, transport = (np.asarray(x, np.float64) for x in (advantages, rewards, transport))
    mask = np.asarray(mask, bool)
    if not mask.any():
        return {}
    returns = monte_carlo_returns(rewards, mask)
    outcome = returns[:, 0]  # R_i: the whole response's return
    lengths = mask.sum(axis=1, keepdims=True)
    first_half = mask & (2 * np.arange(mask.shape[1])[None, :] < lengths)
    relative = np.broadcast_to((outcome - outcome[lengths[:, 0] > 0].mean())[:, None], mask.shape)
    # A token with no advantage (GRPO's, in a group whose rewards are all equal) gets no credit to sign.
    signed = first_half & (relative != 0) & (advantages != 0)
    out = {"credit/trace_horizon": trace_horizon(transport, mask)}
    if one_outcome:
        return out
    if signed.any():
        out["credit/early_sign_agreement"] = float(np.mean(np.sign(advantages[signed]) == np.sign(relative[signed])))
    if values is not None:
        v, r = np.asarray(values, np.float64)[mask], returns[mask]
        ev = explained_variance(r, v)
        if ev is not None:
            out["credit/outcome_explained_variance"] = ev
            # Constant values (a zero-initialized critic's) rank nothing: no correlation, as their EV of 0 says.
            out["credit/outcome_spearman"] = spearman(v, r) if np.ptp(v) > 0 else 0.0
    return out


OUTCOME_FIELDS = (*AGAINST_THE_OUTCOME, "credit/trace_horizon")
READ_OVER_STEPS = 5  # the reading's window: the last steps that logged the credit against the outcome
KNOWS_NOTHING_BELOW = 0.05  # an outcome explained variance under this: the critic predicts none of the outcome
CHANCE_BAND = 0.1  # an early sign agreement within this of 0.5: chance
NOTICE_AFTER_STEPS = 10  # the notice's window: the means of this many steps in a row, each of a noisy batch


def recent_mean(rows: list[dict], name: str, last: int) -> float | None:
    """The mean of metrics `rows`' last `last` numeric values of `name`; None where no row holds one."""
    values = [row[name] for row in rows if isinstance(row.get(name), (int, float))][-last:]
    return float(np.mean(values)) if values else None


def outcome_reading(rows: list[dict], last: int = READ_OVER_STEPS) -> str | None:
    """One sentence on the credit against the outcome, from the means of metrics `rows`' last `last` values of each
    credit/* field (None before any step logged one)."""
    ev, rho, sign, horizon = (recent_mean(rows, name, last) for name in OUTCOME_FIELDS)
    if sign is None and horizon is None:
        return None
    parts = []
    if ev is not None:
        ranks = "" if rho is None else f", Spearman {rho:.2f}"
        knows = "predicts none of the outcome" if ev < KNOWS_NOTHING_BELOW else f"explains {ev:.0%} of the outcome"
        parts.append(f"the critic {knows} (explained variance {ev:.2f}{ranks})")
    if sign is not None:
        parts.append(f"credit reaches the first half of a response with the outcome's sign {sign:.0%} of the time")
    if horizon is not None:
        parts.append(f"a final reward keeps 1/e of itself over its response's last {horizon:.1f} tokens")
    steps = len([row for row in rows if any(name in row for name in OUTCOME_FIELDS)][-last:])
    return f"Over the last {steps} steps {'; '.join(parts)}."


def blind_credit(rows: list[dict]) -> bool:
    """Whether, over the last NOTICE_AFTER_STEPS rows with a critic's outcome diagnostics, the critic predicted
    none of the outcome and early credit was at chance, on average (one step's batch is too small to say:
    a run at chance swings 0.2-0.8 from step to step)."""
    ev, _, sign, _ = OUTCOME_FIELDS
    recent = [row for row in rows if ev in row and sign in row][-NOTICE_AFTER_STEPS:]
    if len(recent) < NOTICE_AFTER_STEPS:
        return False
    ev_mean, sign_mean = (recent_mean(recent, name, NOTICE_AFTER_STEPS) for name in (ev, sign))
    return ev_mean < KNOWS_NOTHING_BELOW and abs(sign_mean - 0.5) < CHANCE_BAND
