"""Markdown tables and PNG bar plots of an experiment, shaped like the paper's (section 7, appendix B).

Accuracies print as points (100 x fraction); intervals are two-sided 95% Student-t over seeds
(comppo_jax.eval.statistics). Each `*_report` takes the experiment config and its `Outcome` (its
arms' finished runs by seed, with held-out diagnostics) and returns (markdown, {png name:
figure-drawing function}).
"""

from __future__ import annotations

import numpy as np

from comppo_jax import storage
from comppo_jax.eval.experiment import Outcome, RunResult, grid_cells, parse_override
from comppo_jax.eval.statistics import (
    Interval,
    curve_endpoints,
    factorial_interaction,
    is_stable,
    paired_difference,
    t_interval,
)
from comppo_jax.runs.outputs import METRICS_FILE, read_metrics
from comppo_jax.train.diagnostics import OUTCOME_FIELDS, recent_mean

FACTORIAL_CELLS = (
    ("fixed_std", "Fixed gate + standard critic"),
    ("gate_std", "Comp-GAE + standard critic"),
    ("fixed_aligned", "Fixed gate + aligned critic"),
    ("full", "Full CompPO"),
)
SHORT_CELLS = ("Fixed+Std", "Gate+Std", "Fixed+TAC", "Full")


def pts(x: float | None) -> str:
    return "never" if x is None else f"{100 * x:.1f}"


def ci(interval: Interval) -> str:
    return f"{100 * interval.mean:.1f} [{100 * interval.low:.1f}, {100 * interval.high:.1f}]"


def signed_ci(interval: Interval) -> str:
    return f"{100 * interval.mean:+.1f} [{100 * interval.low:+.1f}, {100 * interval.high:+.1f}]"


def table(header, rows) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def endpoints(result: RunResult, exp) -> dict:
    return curve_endpoints(result.steps, result.accuracies, last=exp.last, target=exp.target)


def seeds_of(outcome: Outcome, arms) -> list[int]:
    """Seeds every one of `arms` finished (the seed-matched set)."""
    sets = [set(outcome.arms.get(arm, {})) for arm in arms]
    return sorted(set.intersection(*sets)) if sets else []


def arm_values(outcome: Outcome, exp, arm: str, key: str, seeds) -> list[float]:
    return [endpoints(outcome.arms[arm][s], exp)[key] for s in seeds]


def diagnostics_mean(outcome: Outcome, arm: str, seeds, key: str) -> str:
    """The mean over `seeds` of a held-out diagnostic ("--" where none was computed)."""
    values = [outcome.arms[arm][s].held_out.get(key) for s in seeds]
    values = [v for v in values if v is not None]
    return f"{np.mean(values):.2f}" if values else "--"


def save_bars(path: str, labels, heights, ylabel: str, title: str = "", errors=None, ylim=None) -> None:
    """A bar chart PNG; with `errors` ([2, n] below / above), error bars and each bar's value."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(1.6 + 1.3 * len(labels), 3.2))
    ax.bar(range(len(labels)), heights, yerr=errors, capsize=4, color="#4C72B0")
    if errors is not None:
        for x, height in enumerate(heights):
            ax.annotate(
                f"{height:.1f}", (x + 0.05, height), textcoords="offset points", xytext=(2, 3), ha="left", fontsize=8
            )  # beside the error bar
    ax.set_xticks(range(len(labels)), labels, fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    if ylim is not None:
        ax.set_ylim(*ylim)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def bar_plot(labels, intervals: list[Interval], ylabel: str, title: str):
    """A figure-drawing function: bars at the means (points) with 95% t-interval error bars."""
    means = [100 * i.mean for i in intervals]
    errors = np.array([[100 * (i.mean - i.low) for i in intervals], [100 * (i.high - i.mean) for i in intervals]])
    ylim = (max(0.0, 100 * min(i.low for i in intervals) - 10), min(100.0, 100 * max(i.high for i in intervals) + 5))
    return lambda path: save_bars(path, labels, means, ylabel, title, errors, ylim)


def contrast(outcome: Outcome, exp, seeds, a: str, b: str) -> list[str]:
    """The seed-matched differences a - b of Best and Final, with 95% t intervals (points)."""
    return [
        signed_ci(paired_difference(arm_values(outcome, exp, a, k, seeds), arm_values(outcome, exp, b, k, seeds)))
        for k in ("best", "final")
    ]


def summary_rows(outcome: Outcome, exp, arms, seeds, labels=None) -> list[list[str]]:
    """Variant | Best [CI] | Final [CI] | Last-N | AULC | Peak-final, means over `seeds`."""
    rows = []
    for arm in arms:
        values = {
            k: arm_values(outcome, exp, arm, k, seeds)
            for k in ("best", "final", f"last_{exp.last}", "aulc", "peak_to_final_drop")
        }
        rows.append(
            [
                (labels or {}).get(arm, arm),
                ci(t_interval(values["best"])),
                ci(t_interval(values["final"])),
                pts(np.mean(values[f"last_{exp.last}"])),
                pts(np.mean(values["aulc"])),
                pts(np.mean(values["peak_to_final_drop"])),
            ]
        )
    return rows


def per_seed_table(outcome: Outcome, exp, arms, seeds, labels=None) -> str:
    header = ["Seed"] + [f"{(labels or {}).get(a, a)} {k}" for a in arms for k in ("Best", "Final")]
    rows = [[s] + [pts(endpoints(outcome.arms[a][s], exp)[k]) for a in arms for k in ("best", "final")] for s in seeds]
    return table(header, rows)


def main_report(exp, outcome: Outcome):
    arms = [name for name, _ in exp.arms]
    parts = [
        f"Screen: one run per grid cell at seed {exp.screen_seed}; "
        "the selected cell (best Final, ties by Best) is bold."
    ]
    for arm in arms:
        cells = grid_cells(dict(exp.grids).get(arm, ()))
        keys = [parse_override(c)[0] for c in cells[0]] if cells else []
        rows = []
        for result in outcome.screen.get(arm, []):
            cell = tuple(o for o in result.run.overrides if parse_override(o)[0] in keys)
            mark = "**" if outcome.selected.get(arm) == cell else ""
            e = endpoints(result, exp)
            rows.append(
                [arm]
                + [parse_override(c)[1] for c in cell]
                + [f"{mark}{pts(e['best'])}{mark}", f"{mark}{pts(e['final'])}{mark}"]
            )
        if rows:
            parts.append(table(["Method"] + [k.split(".")[-1] for k in keys] + ["Best", "Final"], rows))
    seeds = seeds_of(outcome, arms)
    if not seeds:
        return "\n\n".join(parts + ["No seed finished every arm."]), {}
    parts.append(f"Selected configurations over seeds {seeds}:")
    parts.append(per_seed_table(outcome, exp, arms, seeds))
    parts.append(
        table(
            ["Method", "Best", "Final", f"Last-{exp.last}", "AULC", "Peak-final"],
            summary_rows(outcome, exp, arms, seeds),
        )
    )
    if len(arms) == 2:
        a, b = arms
        rows = [
            [endpoint, difference]
            for endpoint, difference in zip(("Best", "Final"), contrast(outcome, exp, seeds, a, b))
        ]
        parts.append(
            f"Seed-matched difference {a} - {b} (points, 95% t interval):\n\n" + table(["Endpoint", f"{a} - {b}"], rows)
        )
    finals = [t_interval(arm_values(outcome, exp, arm, "final", seeds)) for arm in arms]
    plots = {
        f"{exp.name}_final.png": bar_plot(
            arms, finals, "final dev accuracy (%)", f"{exp.name}: {len(seeds)} seeds, 95% t intervals"
        )
    }
    return "\n\n".join(parts), plots


def factorial_report(exp, outcome: Outcome):
    arms = [name for name, _ in FACTORIAL_CELLS]
    labels = dict(FACTORIAL_CELLS)
    seeds = seeds_of(outcome, arms)
    if not seeds:
        return "No seed finished all four cells.", {}
    target = "" if exp.target is None else f"Step to {pts(exp.target)}"
    rows = []
    for arm, label in FACTORIAL_CELLS:
        e = [endpoints(outcome.arms[arm][s], exp) for s in seeds]
        mean = lambda k: np.mean([x[k] for x in e])
        reached = [x["step_to_target"] for x in e if x.get("step_to_target") is not None]
        step_to = f"{np.mean(reached):.0f} ({len(reached)}/{len(e)} seeds)" if reached else "never"
        rows.append(
            [
                label,
                pts(mean("best")),
                pts(mean("final")),
                pts(mean(f"last_{exp.last}")),
                pts(mean("aulc")),
                pts(mean("peak_to_final_drop")),
            ]
            + [
                diagnostics_mean(outcome, arm, seeds, k)
                for k in (
                    "critic/explained_variance",
                    "critic/td_spearman",
                    "critic/value_mae",
                    "critic/clamp_saturation",
                )
            ]
            + ([step_to] if target else [])
        )
    header = [
        "Variant",
        "Best",
        "Final",
        f"Last-{exp.last}",
        "AULC",
        "Peak-final",
        "EV",
        "TD rho_s",
        "MAE",
        "Clamp sat.",
    ]
    parts = [
        f"Seeds {seeds}. Critic columns: held-out token sample at each run's final checkpoint "
        "(comppo_jax.eval.held_out).",
        table(header + ([target] if target else []), rows),
        "Best / Final with 95% t intervals:\n\n"
        + table(["Variant", "Best", "Final"], [r[:3] for r in summary_rows(outcome, exp, arms, seeds, labels)]),
        per_seed_table(outcome, exp, arms, seeds, dict(zip(arms, SHORT_CELLS))),
    ]
    values = {k: {arm: arm_values(outcome, exp, arm, k, seeds) for arm in arms} for k in ("best", "final")}
    interaction = {
        k: factorial_interaction(*(values[k][a] for a in ("full", "gate_std", "fixed_aligned", "fixed_std")))
        for k in values
    }
    rows = [
        [f"Full - ({labels[other]})", *contrast(outcome, exp, seeds, "full", other)]
        for other in ("gate_std", "fixed_aligned")
    ]
    rows.append(["Interaction I", signed_ci(interaction["best"]), signed_ci(interaction["final"])])
    parts.append(
        "Seed-matched differences and the interaction I = Full - (Gate+Std) - (Fixed+Aligned) + (Fixed+Std), "
        "points:\n\n" + table(["Contrast", "Best", "Final"], rows)
    )
    credit = outcome_table(outcome, arms, seeds, labels)
    if credit is not None:
        parts.append(credit)
    finals = [t_interval(values["final"][arm]) for arm in arms]
    plots = {
        f"{exp.name}_final.png": bar_plot(
            list(SHORT_CELLS),
            finals,
            "final dev accuracy (%)",
            f"2x2 factorial, {len(seeds)} seeds; I = {signed_ci(interaction['final'])}",
        )
    }
    return "\n\n".join(parts), plots


def mean_gate(outcome: Outcome, arm: str, seeds) -> str:
    """The mean over `seeds` of the runs' own mean gate (summary.json; "--" for a run without one)."""
    values = [outcome.arms[arm][s].summary.get("mean_gate") for s in seeds]
    values = [v for v in values if v is not None]
    return f"{np.mean(values):.3f}" if values else "--"


OUTCOME_WINDOW = 10  # the credit-against-the-outcome table's steps: each run's last ones that logged a field


def run_rows(result: RunResult) -> list[dict]:
    """The run's metrics.jsonl rows ([] for a record without the file)."""
    path = storage.path(result.directory) / METRICS_FILE
    return read_metrics(path) if path.exists() else []


CRITIC_FIELDS = ("critic/explained_variance", "critic/td_spearman", "critic/clamp_saturation")


def outcome_table(outcome: Outcome, arms, seeds, labels=None) -> str | None:
    """Each arm's credit against the outcome over its runs' last OUTCOME_WINDOW steps that logged each field (the
    mean over seeds of each run's mean; "--" where no run logged it: records older than the metric), beside the
    critic's own diagnostics (explained variance of its targets, TD Spearman, clamp saturation); None when no run
    logged any (docs/conventions.md)."""
    names = (*OUTCOME_FIELDS, *CRITIC_FIELDS)
    rows = []
    for arm in arms:
        runs = [run_rows(outcome.arms[arm][seed]) for seed in seeds]
        cells = []
        for name in names:
            means = [m for m in (recent_mean(run, name, OUTCOME_WINDOW) for run in runs) if m is not None]
            cells.append(f"{np.mean(means):.2f}" if means else "--")
        rows.append([(labels or {}).get(arm, arm), *cells])
    if all(cell == "--" for row in rows for cell in row[1 : len(OUTCOME_FIELDS) + 1]):
        return None
    header = ["Variant", "Outcome EV", "Spearman(V, R)", "Early sign agreement", "Trace horizon (tokens)"]
    return (
        f"Credit against the outcome, means of each run's last {OUTCOME_WINDOW} steps (docs/conventions.md, "
        '"Credit against the outcome"; 0.5 sign agreement is chance), beside the critic\'s own diagnostics over '
        "the same steps:\n\n" + table([*header, "Critic EV (own targets)", "TD rho_s", "Clamp sat."], rows)
    )


def comparison_report(exp, outcome: Outcome, title: str):
    """Every arm's endpoints and mean gate, and its seed-matched difference from the first arm. While
    some arm has not finished a seed, the arms that finished every seed of the first arm's."""
    arms = [name for name, _ in exp.arms]
    seeds = seeds_of(outcome, arms)
    partial = ""
    if not seeds:  # under way: a table of what has finished, the rest named
        seeds = sorted(outcome.arms.get(arms[0], {}))
        waiting = [arm for arm in arms if not set(seeds) <= set(outcome.arms.get(arm, {}))]
        if not seeds or len(waiting) == len(arms):
            return "No seed finished every arm.", {}
        arms = [arm for arm in arms if arm not in waiting]
        partial = f" Not finished at these seeds, so not in the tables: {', '.join(waiting)}."
    rows = [row + [mean_gate(outcome, arm, seeds)] for row, arm in zip(summary_rows(outcome, exp, arms, seeds), arms)]
    parts = [
        f"Seeds {seeds}.{partial}",
        table(["Variant", "Best", "Final", f"Last-{exp.last}", "AULC", "Peak-final", "Mean gate"], rows),
    ]
    reference = arms[0]
    rows = [[f"{reference} - {other}", *contrast(outcome, exp, seeds, reference, other)] for other in arms[1:]]
    parts.append("Seed-matched differences (points):\n\n" + table(["Contrast", "Best", "Final"], rows))
    credit = outcome_table(outcome, arms, seeds)
    if credit is not None:
        parts.append(credit)
    finals = [t_interval(arm_values(outcome, exp, arm, "final", seeds)) for arm in arms]
    return "\n\n".join(parts), {
        f"{exp.name}_final.png": bar_plot(arms, finals, "final dev accuracy (%)", f"{title}, {len(seeds)} seeds")
    }


PROBE_WINDOW = 5  # a critic's reading on the warm-started policy: the last this many of its warm-up steps


def warm_up_reading(rows: list[dict], name: str) -> float | None:
    """The mean of `name` over a run's (metrics `rows`) last PROBE_WINDOW critic warm-up steps (no actor update
    yet, so the policy is the warm start's); None with fewer logged."""
    warm_up = [row for row in rows if row.get("actor_updates") == 0 and isinstance(row.get(name), (int, float))]
    return recent_mean(warm_up, name, PROBE_WINDOW) if len(warm_up) >= PROBE_WINDOW else None


def regime_report(exp, outcome: Outcome):
    """Whether a testbed is in the regime where a critic can carry credit: what each arm's critic knows of the
    outcome after its warm-up on the warm-started policy (arms whose warm-up logged PROBE_WINDOW steps), and how
    far each arm that trains the actor (more than one update) ends above its warm start, seed-matched."""
    waiting = [name for name, _ in exp.arms if name not in outcome.arms]
    arms = [name for name, _ in exp.arms if name in outcome.arms]
    seeds = seeds_of(outcome, arms)
    if not seeds:
        return "No seed finished every arm.", {}
    fields = (
        ("credit/outcome_explained_variance", "Outcome EV"),
        ("credit/outcome_spearman", "Spearman(V, R)"),
        ("critic/explained_variance", "Critic EV (own targets)"),
    )
    probe_rows, learner_rows, per_seed = [], [], {}
    for arm in arms:
        results = [outcome.arms[arm][s] for s in seeds]
        rows = [run_rows(r) for r in results]  # each run's metrics read once for every field
        readings = {name: [warm_up_reading(run, name) for run in rows] for name, _ in fields}
        if all(v is not None for v in readings[fields[0][0]]):
            known = [[v for v in readings[name] if v is not None] for name, _ in fields]
            intervals = [t_interval(values) if values else None for values in known]
            cells = [f"{i.mean:.2f} [{i.low:.2f}, {i.high:.2f}]" if i else "--" for i in intervals]
            probe_rows.append([arm, *cells, mean_gate(outcome, arm, seeds)])
            per_seed[arm] = readings[fields[0][0]]
        if all(int(r.summary.get("actor_updates", 0)) > 1 for r in results):
            base = [r.base for r in results]
            final = arm_values(outcome, exp, arm, "final", seeds)
            best = arm_values(outcome, exp, arm, "best", seeds)
            learner_rows.append(
                [
                    arm,
                    ci(t_interval(base)),
                    ci(t_interval(final)),
                    signed_ci(paired_difference(final, base)),
                    signed_ci(paired_difference(best, base)),
                ]
            )
    parts = [f"Seeds {seeds}." + (f" Not finished yet: {', '.join(waiting)}." if waiting else "")]
    if probe_rows:
        parts.append(
            f"What each critic knows of the outcome on the warm-started policy: means of its last {PROBE_WINDOW} "
            "critic-only warm-up steps (each step's values before that step's critic update), 95% t intervals over "
            "seeds; beside them the mean attention gate of the run's rollouts (measured in every run, used by "
            "CompPO's):\n\n" + table(["Arm", *(label for _, label in fields), "Mean gate"], probe_rows)
        )
        parts.append(
            table(
                ["Seed", *(f"{arm} outcome EV" for arm in per_seed)],
                [[s, *(f"{per_seed[arm][i]:.2f}" for arm in per_seed)] for i, s in enumerate(seeds)],
            )
        )
    if learner_rows:
        parts.append(
            "Dev accuracy against the warm start, points; differences seed-matched:\n\n"
            + table(["Arm", "Warm start", "Final", "Final - warm start", "Best - warm start"], learner_rows)
        )
    return "\n\n".join(parts), {}


def controls_report(exp, outcome: Outcome):
    """`comparison_report` against the full method, with its realized gate on held-out prompts."""
    markdown, plots = comparison_report(exp, outcome, "gate controls")
    arms = [name for name, _ in exp.arms]
    seeds = seeds_of(outcome, arms)
    if not seeds or arms[0] != "full":
        return markdown, plots
    stat = lambda k: diagnostics_mean(outcome, "full", seeds, k)
    markdown += (
        "\n\nRealized gate of the full method's final checkpoints (held-out prompts, mean over seeds):\n\n"
        + table(
            ["Statistic", "Value", "Statistic", "Value"],
            [
                ["Mean / median", f"{stat('gate/mean')} / {stat('gate/median')}", "IQR", stat("gate/iqr")],
                [
                    "Early / middle / late",
                    " / ".join(stat(f"gate/{t}_third") for t in ("first", "middle", "last")),
                    "Correct / incorrect",
                    f"{stat('gate/correct')} / {stat('gate/incorrect')}",
                ],
            ],
        )
    )
    return markdown, plots


def stress_report(exp, outcome: Outcome):
    rows, totals = [], {}
    for arm, _ in exp.arms:
        cells = [name for name in outcome.arms if name == arm or name.startswith(arm + "[")]
        for name in cells:
            results = list(outcome.arms[name].values())
            e = [endpoints(r, exp) for r in results]
            stable = [is_stable(r.accuracies, r.base, max_drop=exp.max_drop, run_below=exp.run_below) for r in results]
            totals.setdefault(arm, []).extend(zip(stable, e))
            rows.append(
                [
                    name,
                    pts(np.mean([x["best"] for x in e])),
                    pts(np.mean([x["final"] for x in e])),
                    f"{sum(stable)}/{len(stable)}",
                ]
            )
    if not rows:
        return "No stress-grid run finished.", {}
    parts = [
        f"Stable: final >= the run's base (warm-start) accuracy, peak-to-final drop < {pts(exp.max_drop)} points, "
        f"and no {exp.run_below} consecutive post-peak evaluations below base.",
        table(["Cell", "Best", "Final", "Stable seeds"], rows),
    ]
    summary = [
        [
            arm,
            f"{sum(s for s, _ in v)}/{len(v)}",
            pts(np.mean([e["best"] for _, e in v])),
            pts(np.mean([e["final"] for _, e in v])),
            pts(np.mean([e["peak_to_final_drop"] for _, e in v])),
        ]
        for arm, v in totals.items()
    ]
    parts.append(table(["Method", "Stable runs", "Mean best", "Mean final", "Mean drop"], summary))

    draw = lambda path: save_bars(
        path,
        list(totals),
        [sum(s for s, _ in v) for v in totals.values()],
        f"stable runs (of {max(len(v) for v in totals.values())})",
    )
    return "\n\n".join(parts), {f"{exp.name}_stable.png": draw}


def group_report(exp, outcome: Outcome):
    rows = []
    for arm, _overrides in exp.arms:
        for seed, result in sorted(outcome.arms.get(arm, {}).items()):
            e = endpoints(result, exp)
            settings = dict(parse_override(o) for o in result.run.overrides)
            size = int(settings.get("rollout.prompts_per_step", 0) or 0) * int(
                settings.get("rollout.samples_per_prompt", 0) or 0
            )
            rows.append([arm, seed, size or "config default", pts(e["best"]), pts(e["final"])])
    if not rows:
        return "No run finished.", {}
    return (
        "Single runs (point estimates, no training-seed intervals); frozen macro: launch/eval.py on each run's "
        "final checkpoint.\n\n" + table(["Method", "Seed", "Trajectories/update", "ID Best", "ID Final"], rows)
    ), {}


REPORTS = {
    "main": main_report,
    "factorial": factorial_report,
    "controls": controls_report,
    "stress": stress_report,
    "group": group_report,
    "statistics": lambda exp, outcome: comparison_report(exp, outcome, "gate statistics and controls"),
    "variants": lambda exp, outcome: comparison_report(exp, outcome, "policy-loss variants"),
    "lora": lambda exp, outcome: comparison_report(exp, outcome, "LoRA and full fine-tuning"),
    "baselines": lambda exp, outcome: comparison_report(exp, outcome, "token-credit baselines"),
    "regime": regime_report,
}
