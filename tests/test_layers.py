"""The layers of the code base, as a test: each folder imports only what sits below it.

    app/       (weightsync.app)      may import everything
    agents/    (weightsync.agents)   library + models, never the trainer or the app
    trainer/   (weightsync.trainer)  library + models, never the agents or the app
    models/    (weightsync.models)   library only
    weightsync/ (the library)        itself only

Imports are read from the source (every `import` and `from ... import`, lazy ones inside
functions too), so a forbidden import cannot hide behind a code path the tests never run.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
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
            if any(module == top or module.startswith(top + ".") for top in FORBIDDEN[folder]) \
                    or module.split(".")[0] in ("agents", "trainer", "app", "models", "bench", "tests", "harness"):
                crossings.append(f"{path.relative_to(REPO)}:{line} imports {module}")
    assert not crossings, f"{folder}/ must not import these:\n" + "\n".join(crossings)


def test_the_check_sees_a_crossing(tmp_path):
    """The parser finds lazy imports inside functions: the rule cannot pass vacuously."""
    source = tmp_path / "lazy.py"
    source.write_text("def f():\n    from weightsync.agents.sync import SyncAgent\n    import weightsync.app.cli\n")
    modules = {module for _, module in imported_modules(source)}
    assert "weightsync.agents.sync" in modules and "weightsync.app.cli" in modules
