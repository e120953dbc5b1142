"""The architecture as a checked contract (docs/ARCHITECTURE.md, issue 22).

- `lint-imports` keeps the layers contracts of pyproject.toml: cli above merge above the diagnostics' drivers above
  the engine above capture and storage above models; a new upward import fails here, in CI.
- No import circle among the project's modules, counting module-level and function-level imports file to file, and
  no import of the project's own modules hidden inside a function.
- The package installs under one namespace: `submerge.diagnostics`, `submerge.merge`, `submerge.cli`; no generic
  top-level `diagnostics`, `merge` or `cli` package is importable outside the repository.
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("diagnostics", "merge", "cli")


def _modules() -> dict[str, Path]:
    modules = {}
    for folder in FOLDERS:
        for path in (ROOT / folder).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules["submerge." + ".".join(parts)] = path
    return modules


def _imports(modules: dict[str, Path]) -> dict[str, dict[str, str]]:
    """module → {imported project module: "top" or "function"}, every import statement of the file."""
    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for module, path in modules.items():
        tree = ast.parse(path.read_text())
        top = {id(node) for node in tree.body}
        edges: dict[str, str] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("submerge"):
                targets = [resolve(f"{node.module}.{alias.name}") for alias in node.names]
            elif isinstance(node, ast.Import):
                targets = [resolve(alias.name) for alias in node.names if alias.name.startswith("submerge")]
            else:
                continue
            for target in targets:
                if target and target != module:
                    edges[target] = "top" if id(node) in top or edges.get(target) == "top" else "function"
        graph[module] = edges
    return graph


def test_no_import_circle_and_no_hidden_internal_import():
    graph = _imports(_modules())
    hidden = [f"{module} → {target}" for module, edges in graph.items() for target, kind in edges.items()
              if kind == "function"]
    assert hidden == []
    # a circle: a module that reaches itself (package __init__ re-exports count as edges too)
    def reachable(start: str) -> set[str]:
        seen, stack = set(), list(graph[start])
        while stack:
            module = stack.pop()
            if module not in seen:
                seen.add(module)
                stack.extend(graph[module])
        return seen

    circles = [module for module in graph if module in reachable(module)]
    assert circles == []


def test_layers_contract_holds(tmp_path):
    """`lint-imports` with pyproject.toml's contracts, on the package as it installs (submerge/diagnostics, ...)."""
    if shutil.which("lint-imports") is None:
        pytest.skip("import-linter is not installed (pip install -e '.[dev]')")
    package = tmp_path / "submerge"
    package.mkdir()
    for folder in FOLDERS:
        (package / folder).symlink_to(ROOT / folder, target_is_directory=True)
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    environment = {**os.environ, "PYTHONPATH": str(tmp_path)}
    result = subprocess.run(["lint-imports"], cwd=tmp_path, env=environment, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


def test_only_the_submerge_namespace_is_installed(tmp_path):
    """Outside the repository (no source folder on sys.path), `submerge.*` imports and the generic names do not."""
    code = ("import importlib.util as u; import submerge.diagnostics, submerge.merge, submerge.cli; "
            "print([n for n in ('diagnostics', 'merge', 'cli') if u.find_spec(n) is not None])")
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                            env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
