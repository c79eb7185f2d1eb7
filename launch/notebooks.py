"""Re-executes the example notebooks in place, so the stored copies show their outputs (plots included).

    python launch/notebooks.py                            # all three
    python launch/notebooks.py --notebooks=credit.ipynb   # one

Each notebook runs top to bottom in a fresh kernel, in examples/, with its own parameters cell, and is
written back with its outputs. gate_on_text.ipynb and evaluate_checkpoint.ipynb read the runs their
parameters name (runs/tiny and runs/tiny_grpo); a run without a summary.json is trained first with
launch/train.py on configs/tiny.py (CompPO and GRPO; minutes each on a CPU). Needs the `test` extra
(nbclient, ipykernel).
"""

from __future__ import annotations

import os
import subprocess
import sys

from absl import flags

from comppo_jax import cli

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(REPO, "examples")
NOTEBOOKS = ("credit.ipynb", "gate_on_text.ipynb", "evaluate_checkpoint.ipynb")
# The runs the notebooks' parameters name, and the flags that train them.
RUNS = {"runs/tiny": (), "runs/tiny_grpo": ("--config.method=grpo",)}

_NOTEBOOKS = flags.DEFINE_list("notebooks", list(NOTEBOOKS), "Notebooks in examples/ to re-execute.")


def execute(name: str, timeout_s: float, env: dict | None = None, **parameters):
    """Runs examples/`name` in a fresh kernel in examples/, with `parameters` assigned after its cell tagged
    "parameters" (papermill's convention); returns the executed notebook. A cell that raises raises here."""
    import nbformat
    from nbclient import NotebookClient

    notebook = nbformat.read(os.path.join(EXAMPLES, name), as_version=4)
    cell = next(c for c in notebook.cells if "parameters" in c.metadata.get("tags", ()))
    cell.source += "".join(f"\n{key} = {value!r}" for key, value in parameters.items())
    client = NotebookClient(
        notebook, timeout=timeout_s, kernel_name="python3", resources={"metadata": {"path": EXAMPLES}}
    )
    client.execute(env=env)
    return notebook


def main(argv):
    del argv
    import jax
    import nbformat

    unknown = sorted(set(_NOTEBOOKS.value) - set(NOTEBOOKS))
    if unknown:
        raise ValueError(f"--notebooks: no {unknown[0]} in examples/; the notebooks are {', '.join(NOTEBOOKS)}")
    if set(_NOTEBOOKS.value) - {"credit.ipynb"}:
        for run, run_flags in RUNS.items():
            if not os.path.exists(os.path.join(REPO, run, "summary.json")):
                command = [sys.executable, "launch/train.py", "--config=configs/tiny.py", f"--config.output_dir={run}"]
                print("$", " ".join(command[1:] + list(run_flags)), flush=True)
                subprocess.run(command + list(run_flags), cwd=REPO, check=True)
    env = dict(os.environ)
    if not env.get("JAX_PLATFORMS") and jax.config.jax_platforms:
        env["JAX_PLATFORMS"] = jax.config.jax_platforms  # cli.run chose the CPU (no accelerator): so do the kernels
    for name in _NOTEBOOKS.value:
        print(f"executing examples/{name}...", flush=True)
        notebook = execute(name, timeout_s=3600, env=env)
        nbformat.write(notebook, os.path.join(EXAMPLES, name))


if __name__ == "__main__":
    cli.run(main)
