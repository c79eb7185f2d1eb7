"""No file under a run directory, and no path a user passes, is touched with `open()`, `os.path`,
`os.makedirs`, `shutil` or `glob`: they know only a local disk, and a run directory may be a gs://
bucket. Everything goes through comppo_jax.storage. This test reads the code of every module that
handles such paths and names each call that is not on the short list below, with its reason."""

from __future__ import annotations

import ast
import pathlib

from conftest import REPO

ROOT = pathlib.Path(REPO)
MODULES = sorted(
    [
        *ROOT.glob("comppo_jax/train/*.py"),
        *ROOT.glob("comppo_jax/runs/*.py"),
        *ROOT.glob("comppo_jax/planning/*.py"),
        *ROOT.glob("comppo_jax/eval/*.py"),
        ROOT / "comppo_jax/credit/schedule.py",
        *(ROOT / f"launch/{name}.py" for name in ("train", "eval", "export", "report", "experiment", "plan", "score")),
    ]
)
OS_ONLY = ("os.makedirs", "os.listdir", "os.replace", "os.rename", "os.remove", "os.unlink", "os.walk", "os.scandir")

# (module, function, call): why the call is not on a run path.
ALLOWED = {
    ("comppo_jax/runs/run_dir.py", "_start_time", "open"): "/proc/<pid>/stat: this host's process table",
    ("comppo_jax/eval/experiment.py", "command_log", "open"): "a local run's train.log, handed to a subprocess",
    ("comppo_jax/eval/experiment.py", "run_progress", "os.path.basename"): "the script name of a command line",
    ("comppo_jax/eval/experiment.py", "launch", "os.path.basename"): "the script name of a command line",
    ("comppo_jax/eval/export.py", "_as_named", "os.path.exists"): "whether model.path is a local directory",
    ("launch/experiment.py", "main", "os.path.relpath"): "the text of a link between two report pages",
    ("launch/plan.py", "main", "os.path.basename"): "the config file's name, for a table row",
}


def file_calls(source: str) -> list[tuple[str, str, int]]:
    """[(innermost enclosing function, call, line)] of every local-disk file call in `source`."""
    calls = []

    def visit(node, function: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Call):
                name = ast.unparse(child.func)
                if name == "open" or name.startswith(("os.path.", "shutil.", "glob.", "pathlib.")) or name in OS_ONLY:
                    calls.append((function, name, child.lineno))
            inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else function
            visit(child, inner)

    visit(ast.parse(source), "<module>")
    return calls


def test_the_scan_finds_a_local_file_call_on_a_run_path():
    source = "import os\ndef save(output_dir):\n    return open(os.path.join(output_dir, 'x'), 'w')\n"
    assert [(function, call) for function, call, _ in file_calls(source)] == [
        ("save", "open"),
        ("save", "os.path.join"),
    ]


def test_every_run_path_goes_through_the_storage_layer():
    found = []
    for module in MODULES:
        relative = str(module.relative_to(ROOT))
        for function, call, line in file_calls(module.read_text()):
            if (relative, function, call) not in ALLOWED:
                found.append(f"{relative}:{line} {call}() in {function}")
    assert not found, "local-disk file calls on run paths (use comppo_jax.storage): " + "; ".join(found)
