"""The kept experiment records (results/<testbed>/runs/: the light files of each finished run, no
checkpoint and no warm start) rebuild every table the docs quote, from a root anywhere: what
`launch/experiment.py --report_only` reads and writes."""

from __future__ import annotations

import importlib.util
import pathlib
import re
import shutil

import pytest
from conftest import REPO

from comppo_jax.eval.experiment import run_experiment
from comppo_jax.eval.report import REPORTS

# (testbed, experiment, the doc that quotes its report between <!-- NAME report --> and <!-- end NAME report -->,
# the folder of results/ that keeps its records)
KEPT = [("credit", name, "docs/results_credit.md", "credit") for name in ("discrimination", "baselines", "transport")]
KEPT += [("credit", name, "docs/results_credit.md", "credit") for name in ("factorial", "controls", "lora")]
KEPT += [("tools", "tools", "docs/tools.md", "tools")]
# Reruns of some credit runs' configs that log the credit against the outcome: kept apart from the records above.
KEPT += [("credit", "outcome", "docs/results_credit.md", "credit_outcome")]
KEPT += [
    ("decision", name, "docs/results_decision.md", "decision")
    for name in ("regime", "comparison", "factorial", "controls")
]
KEPT += [("credit", "probes", "docs/results_decision.md", "credit")]


def experiment_config(testbed: str, name: str):
    """configs/experiments_<testbed>.py:<name>, as launch/experiment.py's --experiment loads it."""
    path = pathlib.Path(REPO) / "configs" / f"experiments_{testbed}.py"
    spec = importlib.util.spec_from_file_location(f"experiments_{testbed}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(name)


def quoted_rows(doc: str, name: str) -> list[str]:
    text = (pathlib.Path(REPO) / doc).read_text()
    block = re.search(rf"<!-- {name} report -->\n(.*?)<!-- end {name} report -->", text, re.S)
    assert block, f"{doc} quotes no {name} report"
    return [line for line in block.group(1).splitlines() if line.startswith("|")]


@pytest.mark.parametrize(("testbed", "name", "doc", "records"), KEPT, ids=[f"{t}:{n}" for t, n, _, _ in KEPT])
def test_the_kept_records_rebuild_the_tables_the_docs_quote_from_any_root(tmp_path, testbed, name, doc, records):
    root = tmp_path / "elsewhere"
    shutil.copytree(pathlib.Path(REPO) / "results" / records / "runs", root / "runs")
    exp = experiment_config(testbed, name)
    outcome = run_experiment(exp, str(root), 1, train=False, log=lambda message: None)
    assert not outcome.unfinished and not outcome.not_started and not outcome.failures, (
        outcome.unfinished,
        outcome.not_started,
        outcome.failures,
    )
    body, _ = REPORTS[exp.kind](exp, outcome)
    rows = quoted_rows(doc, name)
    assert rows and [row for row in rows if row not in body.splitlines()] == []
