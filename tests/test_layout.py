"""The package's shape: folders follow the data flow and nothing imports upward.

Every import of the source (module level, inside functions and under ``TYPE_CHECKING`` alike) is
read with :mod:`ast`. The packages of ``minijax_serve`` are ranked from the bottom (shared types)
to the top (the front doors); a module may import its own package and the packages ranked below
it, never one above (an import that climbs the data flow); no chain of imports between modules
may lead back to where it started; only the attention registry's package imports a kernel
module; and no source file is over 300 lines.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# bottom to top: a package imports only itself and those before it
RANKS = ["core", "config", "attention", "models", "memory", "scheduler", "executor",
         "simulate", "speculative", "frontend", "engine", "server", "bench", "cli",
         ""]  # "": the package root (the API)  # "": the package root (the API)
MAX_LINES = 300


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """The modules ``path`` imports (for ``from pkg import name``, ``pkg.name`` when that is a
    module of the source, else ``pkg``)."""
    tree = ast.parse(path.read_text(), str(path))
    package = _module_name(path) if path.name == "__init__.py" else _module_name(path).rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1]
                                + ([base] if base else []))
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in SOURCES else base)
    return {name for name in found if name.split(".")[0] in ("minijax_serve", "pallas_kernels")}


SOURCES = {_module_name(p): p for top in ("minijax_serve", "pallas_kernels")
           for p in sorted((ROOT / top).rglob("*.py"))}
GRAPH = {name: _imports(path) for name, path in SOURCES.items()}


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and SOURCES[module].name == "__init__.py") else ""


def _rank(module: str) -> int:
    return RANKS.index(_package(module))


def test_every_package_is_ranked():
    packages = {_package(m) for m in SOURCES if m.startswith("minijax_serve")}
    assert packages <= set(RANKS), f"rank these packages in RANKS: {packages - set(RANKS)}"


def test_no_import_climbs_the_data_flow():
    climbs = [f"{SOURCES[m].relative_to(ROOT)} imports {t} ({_package(t) or 'the package root'}"
              f" is above {_package(m) or 'the package root'})"
              for m, targets in GRAPH.items() if m.startswith("minijax_serve")
              for t in sorted(targets)
              if t.startswith("minijax_serve") and t in SOURCES and _rank(t) > _rank(m)]
    assert not climbs, "\n".join(climbs)


def test_only_the_attention_package_imports_kernels():
    wrong = [f"{SOURCES[m].relative_to(ROOT)} imports {t}" for m, targets in GRAPH.items()
             for t in sorted(targets) if t.startswith("pallas_kernels")
             and not (m.startswith("pallas_kernels") or m.startswith("minijax_serve.attention"))]
    wrong += [f"{SOURCES[m].relative_to(ROOT)} imports {t}" for m, targets in GRAPH.items()
              if m.startswith("pallas_kernels") for t in targets if t.startswith("minijax_serve")]
    assert not wrong, "\n".join(wrong)


def _cycle() -> list[str] | None:
    """One import circle among the source's modules, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        path.append(module)
        for target in sorted(GRAPH[module]):
            if target not in SOURCES:
                continue
            if state.get(target) == 1:
                return path[path.index(target):] + [target]
            if target not in state and (found := visit(target)):
                return found
        path.pop()
        state[module] = 2
        return None

    for module in SOURCES:
        if module not in state and (found := visit(module)):
            return found
    return None


def test_no_import_circle():
    cycle = _cycle()
    assert cycle is None, "import circle: " + " -> ".join(
        str(SOURCES[m].relative_to(ROOT)) for m in cycle)


@pytest.mark.parametrize("top", ["minijax_serve", "pallas_kernels", "tests", "benchmarks", "examples"])
def test_no_source_file_is_over_300_lines(top):
    long = [f"{p.relative_to(ROOT)}: {n} lines" for p in sorted((ROOT / top).rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > MAX_LINES]
    assert not long, "\n".join(long)


LAZY_API = """
import importlib, sys
import minijax_serve as m
from minijax_serve import EngineConfig, SamplingParams
assert not {"jax", "flax"} & set(sys.modules), "the configuration imported JAX"
for name in m.__all__:  # each public name is its defining module's object
    assert getattr(m, name) is getattr(importlib.import_module(m._EXPORTS[name]), name), name
assert m.engine.Engine is m.Engine  # subpackages read as attributes, as before
try:
    m.no_such_name
except AttributeError as e:
    assert "no_such_name" in str(e)
else:
    raise AssertionError("no AttributeError")
"""


def test_the_public_names_load_on_first_use():
    """``import minijax_serve`` (and the configuration types) imports no JAX: the package's
    public names are imported when first read (``minijax-serve --help`` 2.76 -> 1.56 s,
    RESULTS "The package imports on first use")."""
    res = subprocess.run([sys.executable, "-c", LAZY_API], capture_output=True, text=True,
                         cwd=ROOT, timeout=120)
    assert res.returncode == 0, res.stderr
