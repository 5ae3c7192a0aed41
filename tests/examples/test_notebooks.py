"""The notebooks under examples/: each one executes without error in a fresh kernel (their cells
assert what they show), and each is stored without outputs.

Every ``examples/*.ipynb`` is picked up. The kernel is ipykernel on this interpreter, i.e. the
project's environment (``make test``: .venv with the ``test`` extra), whatever kernelspecs are
installed elsewhere. It starts in a temporary directory with examples/ on its ``PYTHONPATH``
(a notebook imports its sibling modules as under Jupyter); the executed copy stays in memory and
examples/ must be left as it was. The kernel inherits the suite's environment (conftest.py: the
JAX compilation cache ``.jax_cache``, or JAX_COMPILATION_CACHE_DIR when set, so a rerun loads its
programs instead of compiling them; the run's MINIJAX_SERVE_CACHE) and adds offline HuggingFace,
no tokenizer threads and ``MINIJAX_EXAMPLES_SMALL=1``, which a notebook with a scale knob (04)
reads to run small. The notebooks that run SmolLM2's large steps get XLA's default code
generation instead of the suite's cheap one (conftest.py ``FAST_COMPILE``): their time is in
running programs, not in compiling them.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import nbclient
import nbformat
import pytest
from jupyter_client import kernelspec
from jupyter_client.manager import KernelManager

from tests.conftest import FAST_COMPILE

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
NOTEBOOKS = sorted(EXAMPLES.glob("*.ipynb"))
CELL_TIMEOUT_S = 120  # the slowest cell takes seconds: a hung kernel fails instead of waiting
STARTUP_TIMEOUT_S = 60


# The suite's cheap code generation runs SmolLM2's steps a third slower: alone, with an empty
# compilation cache, 05 took 133 s with it and 70 s without, 01 26.0 s and 24.1 s (RESULTS.md
# "The suite under 10 minutes")
DEFAULT_CODEGEN = {"01_quickstart", "05_rl_in_place"}


def kernel_env(default_codegen: bool = False) -> dict[str, str]:
    """Added to the inherited environment of a kernel."""
    path = os.pathsep.join(p for p in (str(EXAMPLES), os.environ.get("PYTHONPATH")) if p)
    flags = os.environ.get("XLA_FLAGS", "").split()
    if default_codegen:
        flags = [f for f in flags if f not in FAST_COMPILE]
    return {
        "XLA_FLAGS": " ".join(flags),
        "PYTHONPATH": path,
        "PYTHONDONTWRITEBYTECODE": "1",  # no __pycache__ in examples/
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "MINIJAX_EXAMPLES_SMALL": "1",  # the scale knob of the notebooks that have one
    }


class ThisInterpreter(kernelspec.KernelSpecManager):
    """Resolves every kernel name to ipykernel on ``sys.executable``, with ``kernel_env``."""

    default_codegen = False

    def get_kernel_spec(self, kernel_name: str) -> kernelspec.KernelSpec:
        return kernelspec.KernelSpec(
            argv=[sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
            display_name=f"Python ({sys.prefix})", language="python",
            env=kernel_env(self.default_codegen))


def tree(path: Path) -> dict[str, int]:
    return {str(p.relative_to(path)): p.stat().st_mtime_ns for p in path.rglob("*")}


def test_examples_exist():
    names = {p.name for p in NOTEBOOKS}
    assert {"01_quickstart.ipynb", "02_scheduler_anatomy.ipynb", "03_your_own_model.ipynb"} <= names, names


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_stored_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    dirty = [i for i, cell in enumerate(nb.cells) if cell.cell_type == "code"
             and (cell.get("outputs") or cell.get("execution_count") is not None)]
    assert not dirty, (f"{path.name}: code cells {dirty} carry outputs or execution counts; "
                       f"clear them: jupyter nbconvert --clear-output --inplace {path}")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs(path, tmp_path):
    before = tree(EXAMPLES)
    nb = nbformat.read(path, as_version=4)
    specs = ThisInterpreter()
    specs.default_codegen = path.stem in DEFAULT_CODEGEN
    km = KernelManager(kernel_name="python3", kernel_spec_manager=specs)
    client = nbclient.NotebookClient(
        nb, km=km, timeout=CELL_TIMEOUT_S, startup_timeout=STARTUP_TIMEOUT_S,
        resources={"metadata": {"path": str(tmp_path)}})  # the kernel's working directory
    client.execute()  # raises CellExecutionError (the cell and its traceback) on any error
    code = [cell for cell in nb.cells if cell.cell_type == "code"]
    assert code and all(cell.execution_count is not None for cell in code)
    assert tree(EXAMPLES) == before, "running a notebook changed examples/"
