"""The repository's layout, checked on the source (parsed with `ast`, never imported): the project's
modules import one another without a cycle, only down the stages, and stay small.

    infra  <-  config  <-  model, data, store  <-  dump, train  <-  evaluation  <-  bench, tools

The stage order and the absence of cycles hold for every import, lazy ones inside functions
included (a lazy import is still a dependency).
A module may pass 500 lines only when the first block of its docstring says why ("over 500 lines
because ...").
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from infra import REPO_ROOT

PACKAGES = ("infra", "config", "model", "data", "store", "dump", "train", "evaluation", "bench", "tools")
MAX_LINES = 500
EXCUSE = "over 500 lines because"
LOWER = {"model", "data", "store"}
# What the modules of each package must not import, inside functions and TYPE_CHECKING blocks too.
FORBIDDEN = {
    "infra": {"config", "model", "data", "store", "dump", "train", "evaluation", "bench", "tools"},
    "config": {"model", "data", "store", "dump", "train", "evaluation", "bench", "tools"},
    **{package: {"dump", "train", "evaluation", "bench", "tools"} for package in LOWER},
    "dump": {"train", "evaluation", "bench", "tools"},
    "train": {"dump", "evaluation", "bench", "tools", "vllm"},
    "evaluation": {"train", "bench", "tools"},   # a draft folder carries what evaluation needs
}


def project_modules(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every module of PACKAGES under root (a package's __init__.py
    is the package's own name)."""
    modules = {}
    for name in PACKAGES:
        if (root / f"{name}.py").is_file():
            modules[name] = root / f"{name}.py"
        for path in sorted((root / name).rglob("*.py")) if (root / name).is_dir() else []:
            parts = list(path.relative_to(root).with_suffix("").parts)
            if "__pycache__" in parts:
                continue
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def import_nodes(tree: ast.Module, import_time: bool) -> list[ast.Import | ast.ImportFrom]:
    """The module's import statements; with import_time, only those that run when it is imported
    (not inside a function, nor under `if TYPE_CHECKING:`)."""
    if not import_time:
        return [node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))]
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                found.append(node)
            elif isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                visit(node.orelse)
            elif not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for field in ("body", "orelse", "finalbody", "handlers"):
                    visit(getattr(node, field, []))

    visit(tree.body)
    return found


def imported_names(module: str, path: Path, known: set[str], import_time: bool = False) -> set[str]:
    """Every dotted name the module imports: `from a import b` is a.b when that is a module, else a."""
    is_package = path.name == "__init__.py"
    names = set()
    for node in import_nodes(ast.parse(path.read_text(), str(path)), import_time):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        else:
            base = node.module or ""
            if node.level:  # relative: from the module's package, one level up per extra dot
                package = module.split(".") if is_package else module.split(".")[:-1]
                anchor = package[:len(package) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                child = f"{base}.{alias.name}" if base else alias.name
                names.add(child if child in known or not base else base)
    return names


def owner(name: str, known: set[str]) -> str | None:
    """The project module a dotted name refers to (its longest known prefix), or None if external."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in known:
            return ".".join(parts[:end])
    return None


def import_graph(root: Path, import_time: bool = False) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(module -> project modules it imports, module -> every dotted name it imports)."""
    modules = project_modules(root)
    known = set(modules)
    names = {m: imported_names(m, path, known, import_time) for m, path in modules.items()}
    graph = {m: {o for n in imported if (o := owner(n, known)) is not None and o != m}
             for m, imported in names.items()}
    return graph, names


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        path.append(module)
        for target in sorted(graph.get(module, ())):
            if state.get(target) == 1:
                return path[path.index(target):] + [target]
            if target not in state and (cycle := visit(target)):
                return cycle
        path.pop()
        state[module] = 2
        return None

    for module in sorted(graph):
        if module not in state and (cycle := visit(module)):
            return cycle
    return None


def upward_imports(root: Path) -> list[str]:
    """`module imports name` for each import against the stage order."""
    _, names = import_graph(root)
    bad = []
    for module, imported in sorted(names.items()):
        forbidden = FORBIDDEN.get(module.split(".")[0], set())
        bad += [f"{module} imports {name}" for name in sorted(imported) if name.split(".")[0] in forbidden]
    return bad


def oversized(root: Path) -> list[str]:
    """Modules over MAX_LINES lines whose docstring's first block does not say why."""
    bad = []
    for module, path in sorted(project_modules(root).items()):
        text = path.read_text()
        lines = len(text.splitlines())
        first_block = (ast.get_docstring(ast.parse(text)) or "").split("\n\n")[0]
        if lines > MAX_LINES and EXCUSE not in first_block:
            bad.append(f"{path.relative_to(root)}: {lines} lines")
    return bad


def test_every_stage_is_found() -> None:
    modules = project_modules(REPO_ROOT)
    assert {m.split(".")[0] for m in modules} == set(PACKAGES)
    assert {"store.writer", "store.reader", "data.conversations", "evaluation.run", "tools.build_verifier"} <= set(modules)


def test_no_import_cycle() -> None:
    graph, _ = import_graph(REPO_ROOT)
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_stages_import_only_downward() -> None:
    assert upward_imports(REPO_ROOT) == []


def test_modules_stay_small() -> None:
    assert oversized(REPO_ROOT) == []


@pytest.mark.parametrize("relative, expected", [
    ("from . import a", "pkg.a"), ("from .a import b", "pkg.a.b"), ("from .. import c", "c"),
    ("from pkg import x", "pkg"), ("import pkg.a", "pkg.a"),
])
def test_imports_are_resolved(tmp_path: Path, relative: str, expected: str) -> None:
    path = tmp_path / "mod.py"
    path.write_text(relative + "\n")
    assert imported_names("pkg.mod", path, {"pkg", "pkg.a", "pkg.a.b", "pkg.mod"}) == {expected}


def test_checks_catch_what_they_are_for(tmp_path: Path) -> None:
    """The layout before the store was split: a 1,170-line dump/store.py, the verifier build in
    model/ importing dump's readers, and a cycle."""
    files = {
        "dump/__init__.py": "",
        "dump/store.py": '"""The shard contract."""\n' + "x = 1\n" * 1170,
        "dump/conversations.py": "from dump import store\n",
        "model/__init__.py": "",
        "model/verifier/build.py": "from dump.conversations import load_conversations\n",
        "train/__init__.py": "import vllm\n",
        "evaluation/run.py": '"""Long, and over 500 lines because it says so."""\n' + "y = 2\n" * 600,
        "data/a.py": "from data import b\n",
        "data/b.py": "import data.a\n",
        "store/x.py": "import store.y\n",
        "store/y.py": "def later():\n    import store.x\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert oversized(tmp_path) == ["dump/store.py: 1171 lines"]
    assert upward_imports(tmp_path) == ["model.verifier.build imports dump.conversations", "train imports vllm"]
    graph, _ = import_graph(tmp_path, import_time=True)
    assert find_cycle(graph) == ["data.a", "data.b", "data.a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None
