"""The notebooks in examples/ run top to bottom on the tiny config, in a fresh kernel each, with their
`parameters` cell overridden (launch/notebooks.py's `execute`); a cell that raises fails the test. The
stored notebooks carry the outputs of a whole run (launch/notebooks.py), so their plots show when browsing."""

from __future__ import annotations

import os

import nbformat
import pytest
from conftest import CPU_ONLY_ENV, HANG_S, small_train_config

from launch import notebooks

EXAMPLES, NOTEBOOKS = notebooks.EXAMPLES, notebooks.NOTEBOOKS


def execute(name: str, **parameters) -> nbformat.NotebookNode:
    # CPU only: the TPU ahead-of-time tests may hold libtpu's lock.
    return notebooks.execute(name, timeout_s=HANG_S, env=CPU_ONLY_ENV, **parameters)


def outputs(notebook, kind: str) -> list:
    return [
        data[kind]
        for cell in notebook.cells
        if cell.cell_type == "code"
        for out in cell.outputs
        if kind in (data := out.get("data", {}))
    ]


def streamed(notebook) -> str:
    return "".join(
        out.text
        for cell in notebook.cells
        if cell.cell_type == "code"
        for out in cell.outputs
        if out.output_type == "stream"
    )


def test_notebooks_are_stored_with_the_outputs_of_one_whole_run():
    """Every code cell ran, in order, in one kernel, without an error, and the plots are there; each notebook
    has one parameters cell. Regenerate them with `python launch/notebooks.py`."""
    assert sorted(n for n in os.listdir(EXAMPLES) if n.endswith(".ipynb")) == sorted(NOTEBOOKS)
    for name in NOTEBOOKS:
        notebook = nbformat.read(os.path.join(EXAMPLES, name), as_version=4)
        nbformat.validate(notebook)
        code = [c for c in notebook.cells if c.cell_type == "code"]
        assert [c.execution_count for c in code] == list(range(1, len(code) + 1)), f"{name}: run launch/notebooks.py"
        errors = [out for c in code for out in c.outputs if out.output_type == "error"]
        assert not errors, f"{name} stored with an error: {errors[0].get('ename')}"
        assert sum("parameters" in c.metadata.get("tags", ()) for c in code) == 1, name
        assert outputs(notebook, "image/png"), f"{name} holds no plot"


@pytest.mark.slow
def test_credit_notebook():
    notebook = execute("credit.ipynb")
    text = streamed(notebook)
    assert "comp_gae(kappa=gamma) vs textbook GAE" in text and text.count("per loop") == 3  # the three %timeit lines
    assert len(outputs(notebook, "image/png")) == 2  # the kernels' heatmaps, the advantages per token


@pytest.mark.slow
def test_gate_on_text_notebook_warm_starts_without_a_run(tmp_path):
    """The branch a first-time user takes; the other branch's restore_policy runs in the evaluation notebook."""
    notebook = execute(
        "gate_on_text.ipynb", RUN=str(tmp_path / "no_run"), WARM_START_STEPS=5, NUM_PROBLEMS=2, OUTPUT_DIR=str(tmp_path)
    )
    assert "warm-started" in streamed(notebook)
    (page,) = outputs(notebook, "text/html")
    assert page.count('<span title="t=') >= 4 and "kappa=" in page and " H=" in page
    assert (tmp_path / "gate_on_text.png").stat().st_size > 10_000


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    """Two finished tiny CompPO runs (two seeds: the second reuses the first's compiled programs)."""
    from comppo_jax.train.loop import train

    root = tmp_path_factory.mktemp("runs")
    for seed in (0, 1):
        train(small_train_config(root / f"seed{seed}", seed=seed))
    return root / "seed0", root / "seed1"


@pytest.mark.slow
def test_evaluate_checkpoint_notebook(two_runs):
    notebook = execute("evaluate_checkpoint.ipynb", RUN_A=str(two_runs[0]), RUN_B=str(two_runs[1]))
    text = streamed(notebook)
    assert "greedy pass@1" in text and "comppo (seed0)" in text and "comppo (seed1)" in text
    assert len(outputs(notebook, "image/png")) == 2  # the curves, the gate profiles
