"""One training run as a self-contained HTML page: where its credit went, token by token.

    python launch/report.py --run=runs/tiny            # writes runs/tiny/report.html
    write_run_report("runs/tiny")                       # the same from Python; returns the path

The page needs no network and no server (open it from disk). It shows the run's config and
summary, its curves (curves.png, or drawn from metrics.jsonl for a run still going), the phase
controller's timeline (each step's phase from metrics.jsonl), whether the critic knows the outcome
(the credit/* metrics' curves and a sentence reading them), the gate profile by position
(gate_profile.json), and a browser of the responses the run kept (comppo_jax.runs.samples): pick
a step and a response, and each token is coloured by its gate kappa_t or by its advantage A_t
(a toggle), with t, H_t, c_t, kappa_t, A_t and V_t on hover. Beside it the same tokens are coloured
by the other estimator's advantage from the same rewards and values: GAE (kappa_t = gamma = 1)
for a CompPO run, Comp-GAE with the policy's own gate for a PPO run, so the difference the gate
makes shows token by token; a plot below draws both advantages and kappa_t against t.

Colours: kappa_t on viridis over the gate's realized range [g(0), g(1)] (`gate_range`);
advantages on a red-white-blue scale symmetric about 0, scaled by the response's largest |A|
over both estimators. The page's script maps values through the lookup tables written into it
(`color_of` is the same map in Python).

A file the page cannot use is left out and named on the page and in one warning line, and the rest
is built: a torn summary.json or gate_profile.json, a kept step that does not parse or lacks a field
the page's script reads (`sample_problem`), a torn metrics.jsonl line. The text the run holds
(prompts, responses) is shown as text: the page's data is JSON that cannot end or change its
<script> block (`script_json`).
"""

from __future__ import annotations

import base64
import html
import importlib.resources
import json
import math
import re

from absl import logging

from comppo_jax import storage
from comppo_jax.credit import load_position_schedule
from comppo_jax.runs.outputs import METRICS_FILE, measured, plot_run
from comppo_jax.runs.samples import load_samples, sample_path
from comppo_jax.train.diagnostics import OUTCOME_FIELDS, outcome_reading
from comppo_jax.train.recorder import GATE_PROFILE_FILE
from comppo_jax.train.schema import CONFIG_FILE

REPORT_FILE = "report.html"
PAGE_TEMPLATE = "run_report.html"  # the page's markup, style and script, beside this module
LUT_SIZE = 256
KAPPA_COLORMAP, ADVANTAGE_COLORMAP = "viridis", "RdBu"
PHASE_COLORS = {"stable": "#4c9a2a", "warning": "#e3b505", "strong": "#e07b00", "hard_stop": "#c0392b"}
# The estimator whose advantage a run updated with -> the one shown beside it (None: no critic, no values).
COMPARED = {
    "comp_gae": "gae",
    "gae": "comp_gae",
    "vapo": "gae",
    "grpo": None,
    "ktae": None,
    "attention_anchor": None,
}
ESTIMATOR_NAMES = {
    "comp_gae": "Comp-GAE (eq. comp_gae)",
    "gae": "GAE, kappa = gamma = 1 (eq. stdgae)",
    "vapo": "VAPO (length-adaptive GAE, whitened)",
    "grpo": "GRPO (group-relative)",
    "ktae": "KTAE (group-relative + key-token values)",
    "attention_anchor": "attention-anchor credit (group-relative, amplified)",
}


def color_table(colormap: str) -> list[str]:
    """LUT_SIZE hex colours of a matplotlib colormap, from its low end to its high end."""
    import matplotlib

    cmap = matplotlib.colormaps[colormap]
    return [matplotlib.colors.to_hex(cmap(i / (LUT_SIZE - 1))) for i in range(LUT_SIZE)]


def color_of(table: list[str], value: float, low: float, high: float) -> str:
    """The colour `value` gets on a scale from `low` to `high` (the page's own `colorOf`)."""
    scaled = min(max((value - low) / max(high - low, 1e-12), 0.0), 1.0)
    return table[math.floor(scaled * (LUT_SIZE - 1) + 0.5)]


def _read_json(path) -> dict | None:
    """A JSON object file's contents; None without the file; ValueError naming it when it is not one."""
    path = storage.path(path)
    if not path.exists():
        return None
    try:
        value = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: not valid JSON ({error})") from error
    if not isinstance(value, dict):
        raise ValueError(f"{path}: not a JSON object")
    return value


def _tolerating(make, *args):
    """(make(*args), []), or (None, [the ValueError's line naming the damaged file]): a section the
    page leaves out."""
    try:
        return make(*args), []
    except ValueError as error:
        return None, [str(error)]


# Inside <script>, "<" can end the block ("</script>") or switch the HTML parser into a state where
# the block's own end no longer ends it ("<!--<script>"); ">" and "&" are escaped too, as Django's
# json_script and Go's html/template do, and U+2028/U+2029, which end a line in older JavaScript.
# Each becomes a JSON string escape, so JSON.parse reads the same value.
SCRIPT_ESCAPES = str.maketrans(
    {"<": "\\u003c", ">": "\\u003e", "&": "\\u0026", "\u2028": "\\u2028", "\u2029": "\\u2029"}
)


def script_json(value) -> str:
    """`value` as JSON text that can sit inside an HTML <script> block whatever strings it holds."""
    return json.dumps(value, separators=(",", ":"), allow_nan=False).translate(SCRIPT_ESCAPES)


def _is(value, kind) -> bool:
    """isinstance for JSON values: true/false are not numbers, NaN is not (JSON.parse rejects it)."""
    if isinstance(value, bool) or not isinstance(value, kind):
        return False
    return not isinstance(value, float) or math.isfinite(value)


NUMBER = (int, float)
# What the page's script reads of a kept step's record (comppo_jax.runs.samples) and each response.
RECORD_FIELDS = {"estimator": str, "kappa_range": list, "responses": list}
RESPONSE_FIELDS = {"row": int, "prompt": str, "verdict": str, "length": int, "t": list, "pieces": list, "tokens": dict}


def _field_problem(where: str, record, fields: dict) -> str | None:
    for name, kind in fields.items():
        if name not in record:
            return f"no `{where}{name}`"
        if not _is(record[name], kind):
            return f"`{where}{name}` is {json.dumps(record[name])[:40]}, not {kind.__name__}"
    return None


def sample_problem(record: dict) -> str | None:
    """What of a kept step's record the page's script could not read (a missing or mistyped field),
    or None: such a record would stop the whole browser with a TypeError."""
    problem = _field_problem("", record, RECORD_FIELDS)
    if problem:
        return problem
    if record["estimator"] not in COMPARED:
        return f"`estimator` is {record['estimator']!r}, not one of {', '.join(COMPARED)}"
    if len(record["kappa_range"]) != 2 or not all(_is(v, NUMBER) for v in record["kappa_range"]):
        return "`kappa_range` is not two numbers"
    if not record["responses"]:
        return "`responses` is empty"
    for i, response in enumerate(record["responses"]):
        where = f"responses[{i}]."
        if not isinstance(response, dict):
            return f"`responses[{i}]` is not an object"
        problem = _field_problem(where, response, RESPONSE_FIELDS)
        if problem:
            return problem
        if response.get("reward") is not None and not _is(response["reward"], NUMBER):
            return f"`{where}reward` is not a number"
        kept = len(response["t"])
        if not all(_is(t, int) for t in response["t"]):
            return f"`{where}t` holds a value that is not an integer"
        if len(response["pieces"]) != kept or not all(isinstance(p, str) for p in response["pieces"]):
            return f"`{where}pieces` is not {kept} strings, one per t"
        for name, values in response["tokens"].items():
            if (
                not isinstance(values, list)
                or len(values) != kept
                or not all(v is None or _is(v, NUMBER) for v in values)
            ):
                return f"`{where}tokens.{name}` is not {kept} numbers (or null), one per t"
    return None


def _left_out(problems: list[str]) -> str:
    """The page's note naming files left out, and why."""
    return "<p class='warn'>Left out: " + "; ".join(html.escape(line) for line in problems) + "</p>" if problems else ""


def _png_data_uri(path) -> str:
    return "data:image/png;base64," + base64.b64encode(storage.path(path).read_bytes()).decode()


def _curves(run_dir: str, rows: list[dict], finished: bool) -> str:
    """curves.png as a data URI, drawn from metrics.jsonl's `rows` when the run has not written it
    since its last step (still going, or resumed to go further)."""
    path, metrics = storage.path(run_dir) / "curves.png", storage.path(run_dir) / METRICS_FILE
    if path.exists() and (not metrics.exists() or path.stat().mtime >= metrics.stat().mtime):
        return _png_data_uri(path)
    if not rows:
        return ""
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        png, parsed = storage.path(folder) / "curves.png", storage.path(folder) / METRICS_FILE
        try:
            storage.write_text(parsed, "".join(json.dumps(row) + "\n" for row in rows))  # the rows that parse
            plot_run(parsed, png, title="" if finished else f"{storage.path(run_dir).name} (in progress)")
        except OSError as error:  # a write error names no file: name the folder
            raise OSError(
                f"the curves could not be drawn in the scratch folder {folder} ({error}): free space there "
                "or point TMPDIR elsewhere"
            ) from error
        return _png_data_uri(png)


def phase_timeline(rows: list[dict]) -> str:
    """One cell per step coloured by the controller's phase after it, and the list of changes."""
    phased = [(row["step"], row["phase"]) for row in rows if "phase" in row]
    if not phased:
        return "<p>No step has logged a phase yet.</p>"
    phased = [(html.escape(str(step)), html.escape(str(phase))) for step, phase in phased]  # text from a file
    cells = "".join(
        f'<span class="phase" data-step="{step}" data-phase="{phase}" '
        f'title="step {step}: {phase}" style="background:{PHASE_COLORS.get(phase, "#888")}"></span>'
        for step, phase in phased
    )
    changes = [
        f"step {step}: {before} &rarr; {phase}"
        for (_, before), (step, phase) in zip(phased, phased[1:])
        if phase != before
    ]
    legend = " ".join(
        f'<span class="swatch" style="background:{color}"></span>{name}' for name, color in PHASE_COLORS.items()
    )
    listed = "; ".join(changes) if changes else f"{phased[0][1]} throughout"
    return (
        f'<div id="phases" class="timeline">{cells}</div>'
        f'<div class="legend">steps {phased[0][0]}-{phased[-1][0]} &nbsp; {legend}</div><p>{listed}</p>'
    )


def gate_profile_svg(run_dir: str) -> str:
    """The run's mean gate per bin of t/T (gate_profile.json) as an inline SVG bar chart."""
    path = storage.path(run_dir) / GATE_PROFILE_FILE
    if not path.exists():
        return "<p>No gate profile: it is written when a run with a gate (CompPO, PPO) finishes.</p>"
    profile = load_position_schedule(path)  # ValueError naming the file and field of a damaged one
    means, edges, counts = profile.mean_gate.tolist(), profile.bin_edges.tolist(), profile.token_counts.tolist()
    width, height, pad = 520, 180, 30
    low = min(means) - 0.02
    high = max(means) + 0.02
    bars = []
    for i, mean in enumerate(means):
        x = pad + (width - 2 * pad) * edges[i]
        w = (width - 2 * pad) * (edges[i + 1] - edges[i]) - 1
        h = (height - 2 * pad) * (mean - low) / max(high - low, 1e-9)
        bars.append(
            f'<rect x="{x:.1f}" y="{height - pad - h:.1f}" width="{w:.1f}" height="{h:.1f}" fill="#4C72B0">'
            f"<title>t/T in [{edges[i]:.2f}, {edges[i + 1]:.2f}): mean kappa {mean:.4f} "
            f"({counts[i]} tokens)</title></rect>"
        )
    return (
        f'<svg id="gate-profile" width="{width}" height="{height}" role="img">{"".join(bars)}'
        f'<text x="{pad}" y="{height - 8}" font-size="11">t/T = 0</text>'
        f'<text x="{width - pad - 40}" y="{height - 8}" font-size="11">t/T = 1</text>'
        f'<text x="{pad}" y="14" font-size="11">mean kappa {low:.3f}-{high:.3f} over the run\'s rollouts</text></svg>'
    )


OUTCOME_CURVES = {  # the panel's curves: metric -> (label, colour)
    "credit/outcome_explained_variance": ("outcome explained variance", "#4C72B0"),
    "credit/outcome_spearman": ("Spearman(V, R)", "#55A868"),
    "credit/early_sign_agreement": ("early sign agreement (0.5: chance)", "#C44E52"),
}


def outcome_panel(rows: list[dict]) -> str:
    """ "Does the critic know the outcome?": the credit/* curves against the outcome by step as an inline SVG
    (values below -1 drawn at -1, their own value on hover), the trace horizon's, and a sentence reading the
    last steps (`outcome_reading`)."""
    reading = outcome_reading(rows)
    if reading is None:
        return "<p>No step has logged its credit against the outcome (a run older than those metrics).</p>"
    width, height, pad, low = 520, 200, 34, -1.0
    steps = [row["step"] for row in rows if any(name in row for name in OUTCOME_FIELDS)]
    first, last = min(steps), max(steps)
    x = lambda step: pad + (width - 2 * pad) * (step - first) / max(last - first, 1)
    y = lambda value: height - pad - (height - 2 * pad) * (max(value, low) - low) / (1.0 - low)
    marks = [
        f'<line x1="{pad}" x2="{width - pad}" y1="{y(level):.1f}" y2="{y(level):.1f}" stroke="#bbb" '
        f'stroke-dasharray="{dash}"/><text x="4" y="{y(level) + 4:.1f}" font-size="10">{level:g}</text>'
        for level, dash in ((1.0, "2"), (0.5, "4"), (0.0, "2"), (low, "2"))
    ]
    curves, legend = [], []
    for name, (label, color) in OUTCOME_CURVES.items():
        points = [(row["step"], row[name]) for row in rows if isinstance(row.get(name), (int, float))]
        if not points:
            continue
        path = " ".join(f"{x(step):.1f},{y(value):.1f}" for step, value in points)
        dots = "".join(
            f'<circle cx="{x(step):.1f}" cy="{y(value):.1f}" r="2.5" fill="{color}">'
            f"<title>step {step}: {label} {value:.3f}</title></circle>"
            for step, value in points
        )
        curves.append(
            f'<polyline class="outcome-curve" data-metric="{name}" points="{path}" fill="none" '
            f'stroke="{color}" stroke-width="1.5"/>{dots}'
        )
        legend.append(f'<span class="swatch" style="background:{color}"></span>{html.escape(label)}')
    horizons = [(row["step"], row[OUTCOME_FIELDS[3]]) for row in rows if OUTCOME_FIELDS[3] in row]
    horizon = (
        f"<p>Trace horizon (tokens that keep at least 1/e of a final reward), by step: "
        f"{', '.join(f'{step}: {value:.1f}' for step, value in horizons[-12:])}</p>"
        if horizons
        else ""
    )
    return (
        f'<p id="outcome-reading">{html.escape(reading)}</p>'
        f'<svg id="outcome-panel" width="{width}" height="{height}" role="img">{"".join(marks)}{"".join(curves)}'
        f'<text x="{pad}" y="{height - 8}" font-size="11">step {first}</text>'
        f'<text x="{width - pad - 50}" y="{height - 8}" font-size="11">step {last}</text></svg>'
        f'<div class="legend">{" &nbsp; ".join(legend)}</div>{horizon}'
        "<p>Measured against each response's Monte-Carlo return, not the critic's own targets (docs/conventions.md, "
        "Credit against the outcome): an outcome explained variance near 0 with early sign agreement near 0.5 "
        "means the advantages reaching a response's first half are noise.</p>"
    )


def _cell(value) -> str:
    """A table value as text: a float to 4 significant digits (a mean over a run's tokens has 16), a
    string as it is, the rest (ints, booleans, null) as JSON."""
    if isinstance(value, float):
        return f"{value:.4g}"
    return value if isinstance(value, str) else json.dumps(value)


def _table(values: dict, notes: dict[str, str] | None = None) -> str:
    """A two-column table of `values`, with `notes` ({key: text}) in small print beside their values."""
    notes = notes or {}
    rows = "".join(
        f"<tr><th>{html.escape(str(k))}</th><td>{html.escape(_cell(v))}"
        + (f" <small>({html.escape(notes[k])})</small>" if k in notes else "")
        + "</td></tr>"
        for k, v in values.items()
    )
    return f"<table>{rows}</table>"


def _warmup_notes(summary: dict | None, config: dict | None) -> tuple[dict[str, str], dict[str, str]]:
    """({key: note} for the summary's table, for the config's): the summary's `steps` counts the
    critic's warm-up steps (its `steps` less its `actor_updates`), which the config's `steps` leaves
    out unless train.critic_warmup_counts_toward_steps."""
    steps, updates = (summary or {}).get("steps"), (summary or {}).get("actor_updates")
    if not _is(steps, int) or not _is(updates, int) or steps <= updates:
        return {}, {}
    warmup = steps - updates
    config_notes = (
        {}
        if _field(config or {}, "train.critic_warmup_counts_toward_steps")
        else {"steps": f"actor updates; the critic's {warmup} warm-up steps (train.critic_warmup_steps) come first"}
    )
    return {"steps": f"includes the critic's {warmup} warm-up steps"}, config_notes


KEY_FIELDS = ("method", "gate", "critic.kind", "gate_statistic", "seed", "steps", "model.path", "data.kind")


def _field(config: dict, dotted: str):
    for part in dotted.split("."):
        if not isinstance(config, dict) or part not in config:
            return None
        config = config[part]
    return config


def metrics_rows(path: str) -> tuple[list[dict], int]:
    """(metrics.jsonl's rows (`measured`), how many lines do not parse: a line torn by a crash); ([], 0) without
    the file."""
    rows, torn = [], 0
    for line in storage.read_lines(path):
        try:
            rows.append(measured(json.loads(line)))
        except json.JSONDecodeError:
            torn += 1
    return rows, torn


def run_report_html(run_dir: str) -> str:
    """The page (module docstring) of the run in `run_dir`; raises FileNotFoundError when the
    directory holds no run (no config.json and no metrics.jsonl)."""
    config = _read_json(storage.path(run_dir) / CONFIG_FILE)
    metrics_path = storage.path(run_dir) / METRICS_FILE
    if config is None and not metrics_path.exists():
        raise FileNotFoundError(
            f"{run_dir} holds no training run (no {CONFIG_FILE}, no {METRICS_FILE}): pass a launch/train.py output_dir"
        )
    rows, torn = metrics_rows(metrics_path)
    summary_path = storage.path(run_dir) / "summary.json"
    finished = summary_path.exists()  # written when the run ends, so there even when it is torn
    summary, summary_problems = _tolerating(_read_json, summary_path)
    gate_profile, profile_problems = _tolerating(gate_profile_svg, run_dir)
    loaded, samples_problems = load_samples(run_dir)
    records = []
    for record in loaded:
        problem = sample_problem(record)
        if problem:
            samples_problems.append(f"{sample_path(run_dir, int(record['step']))}: {problem}")
        else:
            records.append(record)
    problems = summary_problems + profile_problems + samples_problems
    if problems:
        logging.warning("%s: left out of the report (fix or remove them): %s", run_dir, "; ".join(problems))
    name = storage.path(run_dir).name
    status = (
        "finished" if finished else (f"in progress or stopped after step {rows[-1]['step']}" if rows else "no step yet")
    )
    key_fields = {field: _field(config or {}, field) for field in KEY_FIELDS}
    data = {
        "steps": records,
        "compared": COMPARED,
        "names": ESTIMATOR_NAMES,
        "kappaColors": color_table(KAPPA_COLORMAP),
        "advantageColors": color_table(ADVANTAGE_COLORMAP),
    }
    curves = _curves(run_dir, rows, finished)
    summary_notes, config_notes = _warmup_notes(summary, config)
    if summary is not None:
        summary_section = _table(summary, summary_notes)
    else:
        summary_section = _left_out(summary_problems) or "<p>No summary.json yet: the run has not finished.</p>"
    torn_note = f"<p class='warn'>{torn} line(s) of {METRICS_FILE} do not parse (left out).</p>" if torn else ""
    body = f"""
<h1>{html.escape(name)}: {html.escape(str(key_fields["method"]))} run report</h1>
<p>{html.escape(str(storage.path(run_dir)))} &middot; {status} &middot; {len(rows)} steps logged &middot;
{len(records)} steps with kept responses</p>
<h2>Summary</h2>
{summary_section}
<h2>Config</h2>
{_table(key_fields, config_notes)}
<details><summary>the whole config.json</summary><pre>{html.escape(json.dumps(config, indent=2, sort_keys=True))}</pre>
</details>
<h2>Curves</h2>
{torn_note}
{f'<img id="curves" src="{curves}" alt="curves">' if curves else "<p>No metrics yet.</p>"}
<h2>Phase controller</h2>
{phase_timeline(rows)}
<h2>Does the critic know the outcome?</h2>
{outcome_panel(rows)}
<h2>Gate profile by position</h2>
{_left_out(profile_problems) or gate_profile}
<h2>Where the credit went</h2>
{_left_out(samples_problems)}
<div id="browser"></div>
"""
    parts = {
        "TITLE": html.escape(f"{name} report"),
        "BODY": body,
        "DATA": script_json(data),
    }
    page = importlib.resources.files("comppo_jax.eval").joinpath(PAGE_TEMPLATE).read_text()
    return re.sub(r"__(TITLE|BODY|DATA)__", lambda match: parts[match.group(1)], page)  # one pass over the template


def write_run_report(run_dir: str, out: str | None = None) -> str:
    """Writes run_report_html(run_dir) to `out` (default <run_dir>/report.html), whole or not at all;
    returns the path."""
    out = str(storage.path(out or storage.path(run_dir) / REPORT_FILE))
    page = run_report_html(run_dir)
    try:
        storage.write_text(out, page)
    except OSError as error:  # a full disk: the error names no file
        raise OSError(
            f"{out} could not be written ({error}): free space there or pass --out=<a path elsewhere>"
        ) from error
    return out
