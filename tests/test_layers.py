"""The package's shape: imports point down the layers, with no cycle, and the CLI offers every command.

Layers, lowest first: `errors`; the engine (no I/O); the llama.cpp binding and model management;
chat templates; `session` (models to engine objects); the benchmark; the CLI and server on top.
A module may import from its own layer or a lower one. The graph is read with `ast` from the
sources, imports inside functions included, so a wrong-way import fails here however it is written.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from specllm.cli import app

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "specllm"

RANK = {  # module prefix -> layer
    "specllm.errors": 0,
    "specllm.filelock": 0,
    "specllm.engine": 1,
    "specllm.reasoning": 1,
    "specllm.backend": 2,
    "specllm.models": 2,
    "specllm.chat": 2,
    "specllm.costs_cache": 2,
    "specllm.session": 3,
    "specllm.bench": 4,
    "specllm.server": 5,
    "specllm.cli": 5,
    "specllm.__main__": 6,
}
TOP = 7  # the package's own __init__ (imports nothing) sits above everything
# Third-party modules that only one part of the package may import.
OWNERS = {"llama_cpp": ("specllm.backend",), "huggingface_hub": ("specllm.models.hub",), "typer": ("specllm.cli",),
          "rich": ("specllm.cli",), "uvicorn": ("specllm.server",), "starlette": ("specllm.server",)}  # fmt: skip


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path, known: frozenset[str] = frozenset(), root: Path = ROOT) -> set[str]:
    """Every module an import statement in the file names (absolute; relative ones resolved);
    `known`: the package's modules, so that importing a submodule by name counts as importing it."""
    name = module_name(path, root)
    names, package = set(), name.rsplit(".", 1)[0] if path.name != "__init__.py" else name
    for node in ast.walk(ast.parse(path.read_text("utf-8"))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            submodules = {f"{base}.{alias.name}" for alias in node.names} & known
            # `from specllm.models import hub` depends on the submodule, not on the package's __init__
            names |= submodules or {base}
    return names


def graph(root: Path = ROOT) -> dict[str, set[str]]:
    modules = {module_name(p, root): p for p in (root / "specllm").rglob("*.py")}
    known = frozenset(modules)
    return {name: {m for m in imports_of(path, known, root) if m in modules and m != name} for name, path in modules.items()}


def against_the_layers(edges: dict[str, set[str]]) -> list[tuple[str, str]]:
    return [(a, b) for a, targets in edges.items() for b in targets if rank(b) > rank(a)]


def rank(module: str) -> int:
    if module == "specllm":
        return TOP
    prefixes = [p for p in RANK if module == p or module.startswith(p + ".")]
    assert prefixes, f"{module} belongs to no layer: add it to RANK"
    return RANK[max(prefixes, key=len)]


def test_every_module_has_a_layer():
    for module in graph():
        assert rank(module) <= TOP


def test_imports_point_down_the_layers():
    wrong = against_the_layers(graph())
    assert not wrong, f"imports against the layers (importer, imported): {wrong}"


def test_the_engine_imports_only_itself_and_errors():
    for module, targets in graph().items():
        if module.startswith("specllm.engine"):
            assert all(t.startswith("specllm.engine") or t == "specllm.errors" for t in targets), (module, targets)


FILE_AND_PROCESS_IO = {"os", "io", "json", "pathlib", "tempfile", "shutil", "fcntl", "subprocess", "socket", "sys"}


def test_the_engine_does_no_io():
    """The lossless core reads no file, environment or stream (the cost cache lives in `costs_cache`)."""
    known = frozenset(module_name(p) for p in PACKAGE.rglob("*.py"))
    for path in (PACKAGE / "engine").glob("*.py"):
        used = {name.split(".")[0] for name in imports_of(path, known)}
        assert not used & FILE_AND_PROCESS_IO, (path.name, used & FILE_AND_PROCESS_IO)


def test_no_import_cycle():
    edges, state, path = graph(), {}, []

    def visit(node: str) -> None:
        state[node] = "open"
        path.append(node)
        for nxt in sorted(edges[node]):
            if state.get(nxt) == "open":
                raise AssertionError(f"import cycle: {' -> '.join(path[path.index(nxt):] + [nxt])}")
            if nxt not in state:
                visit(nxt)
        path.pop()
        state[node] = "done"

    for node in sorted(edges):
        if node not in state:
            visit(node)


@pytest.mark.parametrize("library", sorted(OWNERS))
def test_a_library_has_one_owner(library):
    users = {module_name(p) for p in PACKAGE.rglob("*.py") if any(m == library or m.startswith(library + ".") for m in imports_of(p))}
    assert users, f"nobody imports {library}: update OWNERS"
    strays = [u for u in users if not any(u == o or u.startswith(o + ".") for o in OWNERS[library])]
    assert not strays, f"{library} imported outside {OWNERS[library]}: {strays}"


def test_the_checker_sees_a_wrong_way_import(tmp_path):
    """The tests above can fail: an engine module importing the CLI inside a function is found."""
    for module, text in {"engine/decode.py": "def f():\n    from specllm.cli import common\n", "cli/common.py": "",
                         "engine/__init__.py": "", "cli/__init__.py": "", "__init__.py": ""}.items():  # fmt: skip
        (tmp_path / "specllm" / module).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "specllm" / module).write_text(text)
    assert against_the_layers(graph(tmp_path)) == [("specllm.engine.decode", "specllm.cli.common")]


def test_every_command_in_the_readme_is_in_the_help():
    readme = (ROOT / "README.md").read_text("utf-8")
    code = "\n".join(re.findall(r"```\w*\n(.*?)```", readme, flags=re.S) + re.findall(r"`([^`\n]+)`", readme))
    commands = set(re.findall(r"(?:^|[|&;]\s*|\s)specllm ([a-z]+)\b", code, flags=re.M))
    assert {"run", "chat", "bench", "models", "pull"} <= commands, commands  # the README still names them
    result = CliRunner().invoke(app, ["--help"], terminal_width=200)
    assert result.exit_code == 0, result.output
    listed = set(re.findall(r"^│ (\w+)\s", result.output, flags=re.M)) or set(re.findall(r"^  (\w+)\s", result.output, flags=re.M))
    assert commands <= listed, f"in the README but not in `specllm --help`: {sorted(commands - listed)}"


def test_version_names_specllm_and_the_llama_cpp_python_it_runs_on():
    """`specllm --version`: the version pyproject.toml declares and llama-cpp-python's (its llama.cpp
    chooses the kernels, so a report of a speed or a text needs both)."""
    from importlib import metadata

    import specllm

    declared = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text("utf-8"), flags=re.M).group(1)
    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 0, result.output
    assert result.output == f"specllm {declared} (llama-cpp-python {metadata.version('llama-cpp-python')})\n"
    assert specllm.__version__ == declared


def test_ci_runs_the_readme_test_command():
    """The quick start's test command is what `.ci/run` runs, in the same order."""
    readme = (ROOT / "README.md").read_text("utf-8")
    line = next(line for line in readme.splitlines() if line.startswith('pip install -e ".[test]" && '))
    readme_runs = [command.strip() for command in line.split(" && ")[1:]]
    ci = (ROOT / ".ci" / "run").read_text("utf-8")
    ci_runs = ["python -m pytest " + args.strip() for args in re.findall(r"^run_pytest (.+)$", ci, flags=re.M)]
    assert readme_runs and ci_runs == readme_runs, (ci_runs, readme_runs)
