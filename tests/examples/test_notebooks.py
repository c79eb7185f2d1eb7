"""The notebooks in examples/ run top to bottom on the tiny config, in a fresh kernel each, with their
`parameters` cell overridden (papermill's convention: the cell tagged "parameters"); a cell that
raises fails the test. The stored notebooks carry no outputs."""

from __future__ import annotations

import os

import nbformat
import pytest
from conftest import CPU_ONLY_ENV, REPO, small_train_config

EXAMPLES = os.path.join(REPO, "examples")
NOTEBOOKS = ("credit.ipynb", "gate_on_text.ipynb", "evaluate_checkpoint.ipynb")


def execute(name: str, **parameters) -> nbformat.NotebookNode:
    """Runs examples/`name` in its own directory with `parameters` assigned after its parameters cell."""
    from nbclient import NotebookClient

    notebook = nbformat.read(os.path.join(EXAMPLES, name), as_version=4)
    cell = next(c for c in notebook.cells if "parameters" in c.metadata.get("tags", ()))
    cell.source += "".join(f"\n{key} = {value!r}" for key, value in parameters.items())
    client = NotebookClient(notebook, timeout=600, kernel_name="python3", resources={"metadata": {"path": EXAMPLES}})
    client.execute(env=CPU_ONLY_ENV)  # CPU only: the TPU ahead-of-time tests may hold libtpu's lock
    return notebook


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


def test_notebooks_are_stored_clean():
    """Outputs stay out of git (no images in the repo), and each notebook has a parameters cell."""
    assert sorted(n for n in os.listdir(EXAMPLES) if n.endswith(".ipynb")) == sorted(NOTEBOOKS)
    for name in NOTEBOOKS:
        notebook = nbformat.read(os.path.join(EXAMPLES, name), as_version=4)
        nbformat.validate(notebook)
        code = [c for c in notebook.cells if c.cell_type == "code"]
        assert all(c.outputs == [] and c.execution_count is None for c in code), f"{name} holds outputs: clear them"
        assert sum("parameters" in c.metadata.get("tags", ()) for c in code) == 1, name


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
