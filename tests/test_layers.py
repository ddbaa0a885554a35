"""The layers of the code base, as a test: each folder imports only what sits below it.

    app/       (weightsync.app)      may import everything but torch.distributed: it composes,
                                     never trains (the Training API's HTTP front end included)
    agents/    (weightsync.agents)   library + models, never the trainer or the app
    trainer/   (weightsync.trainer)  library + models, never the agents or the app; the one
                                     training engine (engine.py) and the commands that drive it
                                     on every rank (commands.py)
    models/    (weightsync.models)   library only
    weightsync/ (the library)        itself only, and never torch.distributed

"Where do I change training?" has one answer: forward/backward, clipping and the optimizer step
are called in trainer/engine.py only (AdamW is made in trainer/optim.py), DCP only in trainer/,
and app/training/ holds only the HTTP front end (a fixed list of modules).

Beside them, tests/ and bench/ share only harness/ (never each other, never through sys.path).

Imports are read from the source (every `import` and `from ... import`, lazy ones inside
functions too), so a forbidden import cannot hide behind a code path the tests never run.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
UPPER = ("weightsync.agents", "weightsync.trainer", "weightsync.app", "weightsync.models")
FORBIDDEN = {
    "weightsync": UPPER,
    "models": ("weightsync.agents", "weightsync.trainer", "weightsync.app"),
    "agents": ("weightsync.trainer", "weightsync.app"),
    "trainer": ("weightsync.agents", "weightsync.app"),
}


def imported_modules(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
    return found


@pytest.mark.parametrize("folder", sorted(FORBIDDEN))
def test_folder_imports_only_the_layers_below_it(folder):
    files = sorted((REPO / folder).rglob("*.py"))
    assert files, f"{folder}/ has no Python files: the layout changed, update this test"
    crossings = []
    for path in files:
        for line, module in imported_modules(path):
            # Bare "agents"/"trainer" would be another project's package of that name.
            if any(module == top or module.startswith(top + ".") for top in FORBIDDEN[folder]) or module.split(".")[
                0
            ] in ("agents", "trainer", "app", "models", "bench", "tests", "harness"):
                crossings.append(f"{path.relative_to(REPO)}:{line} imports {module}")
    assert not crossings, f"{folder}/ must not import these:\n" + "\n".join(crossings)


def test_the_check_sees_a_crossing(tmp_path):
    """The parser finds lazy imports inside functions: the rule cannot pass vacuously."""
    source = tmp_path / "lazy.py"
    source.write_text("def f():\n    from weightsync.agents.sync import SyncAgent\n    import weightsync.app.cli\n")
    modules = {module for _, module in imported_modules(source)}
    assert "weightsync.agents.sync" in modules and "weightsync.app.cli" in modules


# ------------------------------------------------------------------------------ one training engine

# Collectives and DCP are the trainer's: the app composes and the library moves bytes.
NO_DISTRIBUTED = ("app", "weightsync")
SOURCE_FOLDERS = ("weightsync", "models", "agents", "trainer", "app")
APP_TRAINING_FRONT_END = {
    "__init__",
    "errors",
    "executor",
    "futures",
    "http",
    "ordering",
    "profiles",
    "runs",
    "sampler_weights",
    "sampling",
    "serve",
    "service",
    "sessions",
    "vllm_sampling",
    "wire",
}
ENGINE_DEFINITIONS = {
    "TrainingEngine": "trainer/engine.py",
    "save_checkpoint": "trainer/checkpoint.py",
    "load_checkpoint": "trainer/checkpoint.py",
    "Worker": "trainer/commands.py",
    "Commander": "trainer/commands.py",
    "follow": "trainer/commands.py",
}


def distributed_imports(path: Path) -> list[str]:
    return [
        f"{line}: {module}"
        for line, module in imported_modules(path)
        if module == "torch.distributed" or module.startswith("torch.distributed.")
    ]


@pytest.mark.parametrize("folder", NO_DISTRIBUTED)
def test_folder_never_imports_torch_distributed(folder):
    files = sorted((REPO / folder).rglob("*.py"))
    assert files, f"{folder}/ has no Python files: the layout changed, update this test"
    found = [f"{path.relative_to(REPO)}:{hit}" for path in files for hit in distributed_imports(path)]
    assert not found, f"{folder}/ must leave collectives and DCP to trainer/:\n" + "\n".join(found)


def test_the_distributed_check_sees_every_spelling(tmp_path):
    """Lazy, aliased and from-imports of torch.distributed and DCP are all found: the rule cannot
    pass vacuously."""
    source = tmp_path / "sneaky.py"
    source.write_text(
        "import torch\n\ndef f():\n    import torch.distributed as dist\n"
        "    from torch import distributed\n    import torch.distributed.checkpoint as dcp\n"
        "    from torch.distributed.checkpoint.state_dict import get_state_dict\n"
    )
    assert [hit.split(":")[0] for hit in distributed_imports(source)] == ["4", "5", "6", "7", "7"]
    assert distributed_imports(REPO / "trainer" / "checkpoint.py"), "the trainer's DCP imports are not seen"


def training_calls(path: Path) -> list[tuple[int, str]]:
    """Calls that train: backward, gradient clipping or zeroing, an optimizer's step, making a
    torch.optim optimizer."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        owner, name = ast.unparse(node.func.value), node.func.attr
        if (
            name in ("backward", "zero_grad", "clip_grad_norm_")
            or (name == "step" and "optim" in owner)
            or owner in ("torch.optim", "optim")
        ):
            found.append((node.lineno, f"{owner}.{name}"))
    return found


def test_training_happens_in_the_engine_only():
    """One answer to "where do I change training?": the engine calls backward, clipping and the
    optimizer step; the optimizer is made in optim.py; nothing else in the product trains."""
    calls: dict[str, set[str]] = {}
    for folder in SOURCE_FOLDERS:
        for path in sorted((REPO / folder).rglob("*.py")):
            names = {what for _, what in training_calls(path)}
            if names:
                calls[str(path.relative_to(REPO))] = names
    assert set(calls) == {"trainer/engine.py", "trainer/optim.py"}, calls
    assert {"backward", "clip_grad_norm_", "zero_grad", "step"} <= {
        n.rsplit(".", 1)[1] for n in calls["trainer/engine.py"]
    }
    assert calls["trainer/optim.py"] == {"torch.optim.AdamW"}


def test_the_training_check_sees_training(tmp_path):
    source = tmp_path / "loop.py"
    source.write_text(
        "def step(model, opt, loss):\n    loss.backward()\n    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)\n"
        "    self.optimizer.step()\n    opt.zero_grad()\n    return torch.optim.SGD(model.parameters())\n"
    )
    assert [line for line, _ in training_calls(source)] == [2, 3, 4, 5, 6]


def test_the_engine_and_its_commands_live_in_the_trainer():
    """Each is defined once, in trainer/; app/training/ keeps only the HTTP front end."""
    where: dict[str, list[str]] = {name: [] for name in ENGINE_DEFINITIONS}
    for folder in SOURCE_FOLDERS:
        for path in sorted((REPO / folder).rglob("*.py")):
            for node in ast.parse(path.read_text(), filename=str(path)).body:
                if isinstance(node, (ast.ClassDef, ast.FunctionDef)) and node.name in where:
                    where[node.name].append(str(path.relative_to(REPO)))
    assert where == {name: [path] for name, path in ENGINE_DEFINITIONS.items()}
    modules = {p.stem for p in (REPO / "app" / "training").glob("*.py")}
    assert modules == APP_TRAINING_FRONT_END, f"app/training/ is the HTTP front end only; found {sorted(modules)}"


def engines_module(module: str) -> str | None:
    """The agents/engines/ module an import names: its stem, "" for the registry (the package or a
    name from it), None for anything outside agents/engines/."""
    package = "weightsync.agents.engines"
    if module == package:
        return ""
    if not module.startswith(package + "."):
        return None
    first = module[len(package) + 1 :].split(".")[0]
    return first if (REPO / "agents" / "engines" / f"{first}.py").exists() else ""


def test_the_agent_and_the_engines_are_apart():
    """agents/ holds the agent, agents/engines/ the engines behind their registry. The agent reaches
    an engine only through the registry, the protocol (base) and the swap policy, so adding an
    engine touches no agent module; no engine imports the agent."""
    problems = []
    for path in sorted((REPO / "agents").rglob("*.py")):
        in_engines = path.parent.name == "engines"
        for line, module in imported_modules(path):
            if not module.startswith("weightsync.agents."):
                continue
            target = engines_module(module)
            if in_engines and target is None:
                problems.append(f"{path.relative_to(REPO)}:{line}: an engine imports the agent's {module}")
            if not in_engines and target not in (None, "", "base", "swap_policy"):
                problems.append(f"{path.relative_to(REPO)}:{line}: the agent imports the engine {module}")
    assert not problems, "\n".join(problems)
    assert engines_module("weightsync.agents.engines.vllm.VllmEngine") == "vllm"
    assert engines_module("weightsync.agents.engines.open_engine") == ""


# ------------------------------------------------------------------------------ tests, bench, harness

# tests/ and bench/ stand on harness/ (servers, proxies, fakes, machine description), never on each
# other: a test runs a benchmark through its command line (python -m bench.X), and nothing reaches
# the other's modules by putting its folder on sys.path.
HARNESS_USERS = {"tests": ("bench",), "bench": ("tests",), "harness": ("tests", "bench")}


def top_level_modules(folder: str) -> set[str]:
    """The names a folder's modules import as when their directory is on sys.path (pytest puts each
    test file's directory there): the modules of every directory that is not a package, and the
    packages at its top."""
    root = REPO / folder
    plain_dirs = [root] + [
        d for d in root.rglob("*") if d.is_dir() and not (d / "__init__.py").exists() and ".npm" not in d.parts
    ]
    return (
        {folder}
        | {p.stem for d in plain_dirs for p in d.glob("*.py") if p.stem != "__init__"}
        | {p.name for p in root.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    )


def sys_path_edits(path: Path) -> list[int]:
    """Lines that change sys.path: sys.path.insert/append/extend(...), or sys.path assigned to."""

    def is_sys_path(node: ast.AST) -> bool:
        return (
            isinstance(node, ast.Attribute)
            and node.attr == "path"
            and isinstance(node.value, ast.Name)
            and node.value.id == "sys"
        )

    lines = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and is_sys_path(node.func.value)
            and node.func.attr in ("insert", "append", "extend")
        ):
            lines.append(node.lineno)
        elif isinstance(node, (ast.Assign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(is_sys_path(t) or (isinstance(t, ast.Subscript) and is_sys_path(t.value)) for t in targets):
                lines.append(node.lineno)
    return lines


@pytest.mark.parametrize("folder", sorted(HARNESS_USERS))
def test_tests_and_bench_share_only_the_harness(folder):
    files = sorted((REPO / folder).rglob("*.py"))
    assert files, f"{folder}/ has no Python files: the layout changed, update this test"
    forbidden = set().union(*(top_level_modules(other) for other in HARNESS_USERS[folder]))
    own = top_level_modules(folder) - {folder}
    problems = []
    for path in files:
        for line, module in imported_modules(path):
            top = module.split(".")[0]
            if top in forbidden and top not in own:  # tests/ may import its own test_agents, bench/ its own
                problems.append(f"{path.relative_to(REPO)}:{line} imports {module}")
        problems += [f"{path.relative_to(REPO)}:{line} changes sys.path" for line in sys_path_edits(path)]
    assert not problems, f"{folder}/ must use harness/, not these:\n" + "\n".join(problems)


def test_the_sharing_check_sees_a_crossing(tmp_path):
    """A sys.path edit and an import of a test module are both found: the rule cannot pass vacuously."""
    source = tmp_path / "sneaky.py"
    source.write_text(
        "import sys\n\ndef f():\n    sys.path.insert(0, 'tests')\n    from fault_proxy import X\n"
        "    sys.path += ['bench']\n"
    )
    assert sorted(sys_path_edits(source)) == [4, 6]
    assert "fault_proxy" in {module for _, module in imported_modules(source)}
    assert {"bench", "chaos", "selftest"} <= top_level_modules("bench") and "test_agents" in top_level_modules("tests")
