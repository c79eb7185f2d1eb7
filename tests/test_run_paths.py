"""No file under a run directory, and no path a user passes, is touched with `open()`, `os.path`,
`os.makedirs`, `shutil` or `glob`: they know only a local disk, and a run directory may be a gs://
bucket. Everything goes through comppo_jax.storage. This test reads the code of every module that
handles such paths and names each call that is not on the short list below, with its reason."""

from __future__ import annotations

import ast
import os
import pathlib

import pytest
from conftest import REPO, launch_quick

ROOT = pathlib.Path(REPO)
MODULES = sorted(
    [
        *ROOT.glob("comppo_jax/train/*.py"),
        *ROOT.glob("comppo_jax/runs/*.py"),
        *ROOT.glob("comppo_jax/planning/*.py"),
        *ROOT.glob("comppo_jax/costs/*.py"),
        *ROOT.glob("comppo_jax/eval/*.py"),
        ROOT / "comppo_jax/credit/schedule.py",
        *(ROOT / f"launch/{name}.py" for name in ("train", "eval", "export", "report", "experiment", "plan", "score")),
    ]
)
OS_ONLY = ("os.makedirs", "os.listdir", "os.replace", "os.rename", "os.remove", "os.unlink", "os.walk", "os.scandir")

# (module, function, call): why the call is not on a run path.
ALLOWED = {
    ("comppo_jax/runs/run_dir.py", "_process_stat", "open"): "/proc/<pid>/stat: this host's process table",
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


# (launcher, its arguments, the refused flag): each path flag given something neither local nor gs://BUCKET/...
REFUSED_FLAGS = [
    ("launch/export.py", ["--run=s3://bucket/run", "--out=exported"], "--run=s3://bucket/run"),
    ("launch/export.py", ["--run=runs/tiny", "--out=gs:/bucket/exported"], "--out=gs:/bucket/exported"),
    ("launch/report.py", ["--run=gcs://bucket/run"], "--run=gcs://bucket/run"),
    ("launch/report.py", ["--run=runs/tiny", "--out=gs://Bucket/report.html"], "--out=gs://Bucket/report.html"),
    ("launch/eval.py", ["--checkpoint=s3://bucket/run"], "--checkpoint=s3://bucket/run"),
    ("launch/eval.py", ["--checkpoint=runs/tiny", "--output=http://host/eval"], "--output=http://host/eval"),
    (
        "launch/experiment.py",
        [f"--experiment={REPO}/configs/experiments_tiny.py:main", "--root=gs://"],
        "--root=gs://",
    ),
    *(
        (
            "launch/plan.py",
            [f"--config={REPO}/configs/tiny.py", f"--{flag}=s3://bucket/plan.md"],
            f"--{flag}=s3://bucket/plan.md",
        )
        for flag in ("markdown", "time_markdown", "summary_markdown")
    ),
]


@pytest.mark.parametrize(("script", "arguments", "refused"), REFUSED_FLAGS, ids=[r[2] for r in REFUSED_FLAGS])
def test_a_launcher_path_flag_that_is_not_local_or_gs_is_refused_before_main(tmp_path, script, arguments, refused):
    result = launch_quick(os.path.join(REPO, script), *arguments, cwd=tmp_path)
    first = result.stderr.splitlines()[0]
    assert result.returncode == 1 and first.startswith(f"error: IllegalFlagValueError: flag {refused}: "), first
    assert "write gs://BUCKET/..." in first or "write a local path or gs://BUCKET/..." in first
    assert os.listdir(tmp_path) == []  # no ./s3: folder


def test_a_benchmark_path_that_is_not_local_or_gs_is_refused_before_any_restore(tmp_path):
    benchmark = "math500=s3://bucket/math500.jsonl"
    result = launch_quick(
        os.path.join(REPO, "launch/eval.py"),
        f"--config={REPO}/configs/tiny.py",
        "--checkpoint=runs/tiny",
        f"--config.eval.benchmarks={benchmark}",
        cwd=tmp_path,
    )
    assert result.returncode == 1 and result.stderr.startswith(
        "error: ValueError: config.eval.benchmarks math500='s3://bucket/math500.jsonl': neither a local path nor gs://"
    ), result.stderr
    assert os.listdir(tmp_path) == []
