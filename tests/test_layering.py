"""The package's shape, read from its code: train/ holds no planning, never imports the planner and
reads the cost model through one function; the whole config is read where it is resolved, validated,
recorded and compared on resume, never by a stage or anything under it; no function on the data path
takes more than eight parameters; no import climbs from a lower package to a higher one, and no
modules import each other in a circle."""

from __future__ import annotations

import ast
import pathlib

from conftest import REPO

ROOT = pathlib.Path(REPO) / "comppo_jax"
TRAIN = ROOT / "train"

# Where a function may take the whole config (`cfg`): its validation, its record and the resume's
# comparison, its resolution into specs, the run's entry and start (which resolve it).
WHOLE_CONFIG = {"validation.py", "schema.py", "specs.py", "loop.py", "start.py"}
# The data path: rollout -> score -> credit -> update, and what records it.
DATA_PATH = [
    ROOT / "rollout" / "experience.py",
    ROOT / "credit" / "registry.py",
    *(TRAIN / f"{name}.py" for name in ("rollout_stage", "staleness", "learner", "update", "recorder", "samples")),
]
# Lower packages first: a module may import from its own package and those before it.
LAYERS = ["errors", "storage", "sharding", "hub", "workers", "models", "credit", "critic", "data", "environments"]
LAYERS += ["rollout", "runs", "train"]
LAYERS += ["planning", "eval"]
# The one climb: the decode layout's auto choice reads the planner's decode floor (`decode_candidates`).
CLIMBS = {"train/decode_layout.py imports comppo_jax.costs.decode_floor"}


def imports(path: pathlib.Path) -> list[tuple[str, list[str]]]:
    """(module, names) of every `from comppo_jax... import ...` and `import comppo_jax...` in `path`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("comppo_jax"):
            found.append((node.module, [alias.name for alias in node.names]))
        elif isinstance(node, ast.Import):
            found += [(alias.name, []) for alias in node.names if alias.name.startswith("comppo_jax")]
    return found


def functions(path: pathlib.Path):
    return [node for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.FunctionDef)]


def parameters(function: ast.FunctionDef) -> list[str]:
    arguments = function.args
    names = [a.arg for a in (*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs)]
    return [name for name in names if name not in ("self", "cls")]


def test_train_holds_no_planning_and_reads_the_cost_model_through_one_function():
    reads = {
        (path.name, module, name)
        for path in TRAIN.glob("*.py")
        for module, names in imports(path)
        if module.startswith(("comppo_jax.planning", "comppo_jax.costs"))
        for name in names or ["*"]
    }
    assert reads == {("decode_layout.py", "comppo_jax.costs.decode_floor", "decode_candidates")}
    # At most a quarter of the package: the loop's stages, their specs and the config's schema.
    lines = lambda paths: sum(len(path.read_text().splitlines()) for path in paths)
    assert lines(TRAIN.glob("*.py")) <= lines(ROOT.rglob("*.py")) / 4


def test_only_the_config_s_resolution_validation_record_and_the_run_s_entry_take_the_whole_config():
    takers = sorted(
        f"{path.relative_to(ROOT)}:{function.name}"
        for path in [*TRAIN.glob("*.py"), *(ROOT / "rollout").glob("*.py"), *(ROOT / "credit").glob("*.py")]
        if path.name not in WHOLE_CONFIG
        for function in functions(path)
        if "cfg" in parameters(function)
    )
    # The decode layout's check runs with the validation, before anything loads.
    assert takers == ["train/decode_layout.py:check_config"]


def test_no_function_on_the_data_path_takes_more_than_eight_parameters():
    crowded = [
        f"{path.relative_to(ROOT)}:{function.name} ({len(parameters(function))})"
        for path in DATA_PATH
        for function in functions(path)
        if len(parameters(function)) > 8
    ]
    assert crowded == []


def test_no_import_climbs_to_a_higher_package():
    rank = {name: index for index, name in enumerate(LAYERS)}
    climbing = []
    for path in ROOT.rglob("*.py"):
        package = path.relative_to(ROOT).parts[0].removesuffix(".py")
        if package not in rank:
            continue
        for module, _ in imports(path):
            target = module.split(".")[1] if "." in module else ""
            if target in rank and rank[target] > rank[package]:
                climbing.append(f"{path.relative_to(ROOT)} imports {module}")
    assert climbing == []


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_no_modules_import_each_other_in_a_circle():
    """Every import counts, deferred and TYPE_CHECKING ones too: a circle is two modules that each
    need the other, whenever Python happens to run the import."""
    modules = {module_name(path): path for path in ROOT.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        # `from package import name` reads the module package.name when there is one, else the package.
        targets = {
            f"{module}.{imported}" if f"{module}.{imported}" in modules else module
            for module, names in imports(path)
            for imported in names or [""]
        }
        graph[name] = {target.removesuffix(".") for target in targets} & modules.keys() - {name}
    circles = [component for component in strongly_connected(graph) if len(component) > 1]
    assert circles == []


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of `graph` (node -> successors), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    components = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for successor in graph[node]:
            if successor not in index:
                visit(successor)
                low[node] = min(low[node], low[successor])
            elif successor in stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            component = []
            while not component or component[-1] != node:
                component.append(stack.pop())
            components.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return components
