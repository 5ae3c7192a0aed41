"""Every code block of README.md and docs/*.md runs or is checked here (as the notebooks run in
tests/examples/test_notebooks.py), and every repository path, module and link they name exists.

- ```python blocks of a page run in order in one namespace, like a notebook's cells (``assert``
  lines check, output comments illustrate). Engines are test-sized: ``Engine("smollm2-135m",
  ...)`` with only sizing keywords (:data:`SIZING`) is the session's shared SmolLM2 engine
  (tests/conftest.py), with other keywords a fresh one of the same sizes and programs; any other
  engine is built as written. A page ends with its engines idle and clean.
- ``127.0.0.1:30000`` is ``minijax-serve serve``'s default address: from the first block that
  names it to the page's end, a server over the shared engine (``smollm2-135m``) answers there,
  to the page's python blocks and ``curl`` commands.
- ```bash commands are checked, not run (but ``curl``): ``minijax-serve`` (and ``make bench
  BENCH_ARGS``) by the CLI's parser and EngineConfig, python scripts by their own parser, shell
  scripts, make targets and variables, pip extras, paths and environment variables by name.
- ```text blocks are diagrams; no other language, and no indented code block.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import inspect
import json
import pkgutil
import re
import runpy
import shlex
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest

import minijax_serve
from minijax_serve.cli import build_parser
from minijax_serve.config.flags import engine_config_from_args, sampling_params_from_args
from tests.conftest import SMOLLM2_SMALL
from tests.engine.test_engine import assert_idle_and_clean
from tests.server_util import running_server

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MAX_LINES = {"README.md": 250, "architecture.md": 150}
LANGUAGES = ("python", "bash", "text")
HOST = "127.0.0.1:30000"  # minijax-serve serve's default address
SIZING = {"page_size", "max_total_tokens", "max_running_requests", "context_length",
          "max_prefill_tokens", "min_token_bucket", "min_seq_bucket", "min_kv_bucket"}
SCRIPT = r"[\w/.-]+\.(py|sh|ipynb)"  # named in prose by its path from the repository's root
REPO_DIRS = ("minijax_serve", "pallas_kernels", "tests", "benchmarks", "examples", "docs")
GENERIC_ENV = {"XLA_FLAGS", "PYTHONPATH", "HF_HUB_OFFLINE", "TOKENIZERS_PARALLELISM"}
ENV_READERS = [ROOT / "Makefile", *(ROOT / "minijax_serve").rglob("*.py")]


class Block(NamedTuple):
    line: int  # the page's line of the block's first code line, 1-based
    lang: str
    code: str


def blocks(page: Path) -> list[Block]:
    text = page.read_text()
    return [Block(text.count("\n", 0, m.start(2)) + 1, m[1], m[2])
            for m in re.finditer(r"^```(\w*)\n(.*?)^```$", text, re.S | re.M)]


def prose(page: Path) -> str:
    """The page without its code blocks."""
    return re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


EACH_PAGE = pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))


# -- the pages' shape, paths and links -------------------------------------------------------

@EACH_PAGE
def test_blocks_are_fenced_with_a_known_language(page):
    limit, text = MAX_LINES.get(page.name), page.read_text()
    assert limit is None or len(text.splitlines()) <= limit, f"over {limit} lines"
    assert len(re.findall("^```", text, re.M)) == 2 * len(blocks(page)), "a fence is not closed"
    wrong = [f"line {b.line}: ```{b.lang}" for b in blocks(page) if b.lang not in LANGUAGES]
    assert not wrong, f"use one of {LANGUAGES}: {wrong}"
    indented = [m.group(0) for m in re.finditer(r"\n\n( {4,}\S.*)", prose(page))]
    assert not indented, f"an indented code block: fence it instead: {indented}"
    if page.name == "README.md":  # its table of contents
        missing = [p.name for p in PAGES[1:] if f"(docs/{p.name})" not in prose(page)]
        assert not missing, f"link these pages from README.md: {missing}"


def _resolves(dotted: str) -> bool:
    """``dotted`` is a module or attribute of this tree (not of another install's)."""
    try:
        obj = pkgutil.resolve_name(dotted)
    except (ImportError, AttributeError):
        return False
    module = obj if inspect.ismodule(obj) else inspect.getmodule(obj)
    return module is None or Path(module.__file__).resolve().is_relative_to(ROOT)


@EACH_PAGE
def test_named_paths_modules_and_links_exist(page):
    text, wrong = prose(page), []
    for span in (w.rstrip(".,:;") for s in re.findall(r"`([^`]+)`", text) for w in s.split()):
        if "/" in span and span.split("/")[0] in REPO_DIRS or re.fullmatch(SCRIPT, span):
            if not glob.glob(str(ROOT / span)):
                wrong.append(f"no file {span}")
        elif re.fullmatch(r"(minijax_serve|pallas_kernels)(\.\w+)+", span) and not _resolves(span):
            wrong.append(f"no module or attribute {span}")
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if target.startswith(("http://", "https://")):
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            wrong.append(f"link to a missing {target}")
        elif anchor and anchor not in map(slug, re.findall(r"^#+ (.*)$", prose(file), re.M)):
            wrong.append(f"link to a missing heading {target}")
    assert not wrong, "\n".join(wrong)


# -- bash blocks: each command checked without running it ------------------------------------

def commands(code: str) -> list[list[str]]:
    """Each command of a bash block as its words (comments dropped, continued lines joined)."""
    lines = code.replace("\\\n", " ").splitlines()
    return [w for line in lines if (w := shlex.split(line, comments=True))]


def check_cli(args: list[str]) -> None:
    """``minijax-serve ARGS`` parses, and its engine (and request) flags make a valid config."""
    try:
        parsed = build_parser().parse_args(args)
    except SystemExit as exit_:
        raise AssertionError(f"minijax-serve {shlex.join(args)}: the parser refused it") from exit_
    engine_config_from_args(parsed)
    if parsed.command == "generate":
        sampling_params_from_args(parsed)


class _Parsed(Exception):
    """Raised once a script's parser has taken its arguments: the script does not run."""


def check_script(script: str, args: list[str]) -> None:
    """A shell script mentions each flag given; a python script's own parser takes ``args``."""
    path = ROOT / script
    assert path.is_file(), f"no script {script}"
    if path.suffix == ".sh":
        text = path.read_text()
        missing = [a for a in args if a.startswith("--") and a.split("=")[0] not in text]
        assert not missing, f"{script} takes no {missing}"
        return
    parse_args = argparse.ArgumentParser.parse_args

    def parse(self, argv=None, namespace=None):
        parse_args(self, argv, namespace)  # SystemExit on an argument it refuses
        raise _Parsed

    with pytest.MonkeyPatch.context() as mp:  # sys.path and sys.argv as a run would have them
        mp.setattr(argparse.ArgumentParser, "parse_args", parse)
        mp.setattr(sys, "argv", [str(path), *args])
        mp.setattr(sys, "path", [str(path.parent), *sys.path])
        try:
            runpy.run_path(str(path), run_name="__main__")
        except _Parsed:
            return
        except SystemExit as exit_:
            raise AssertionError(f"{script}'s parser refused {shlex.join(args)}") from exit_
    raise AssertionError(f"{script} parsed no arguments")


def check_make(args: list[str]) -> None:
    """Targets and variables (``NAME=value``) of the Makefile; ``BENCH_ARGS`` are bench flags."""
    for arg in args:
        name, eq, value = arg.partition("=")
        rule = rf"^{name} [?:]?=" if eq else rf"^{name}:"
        assert re.search(rule, (ROOT / "Makefile").read_text(), re.M), f"the Makefile has no {name}"
        if name == "BENCH_ARGS":
            check_cli(["bench", *shlex.split(value)])


def check_command(words: list[str]) -> None:
    env = []
    while re.match(r"[A-Z_][A-Z0-9_]*=", words[0]):
        env.append(words.pop(0).split("=")[0])
    prog, args = words[0], words[1:]
    name = prog.rsplit("/", 1)[-1]
    for arg in args if name != "curl" else ():
        if "/" in arg and "=" not in arg and not arg.startswith(("/", "http", "$", "~", "-")):
            assert glob.glob(str(ROOT / arg)), f"no file {arg}"
    if name == "minijax-serve":
        check_cli(args)
    elif name in ("python", "python3") and args[:2] == ["-m", "minijax_serve"]:
        check_cli(args[2:])
    elif name in ("python", "python3") and args[:2] == ["-m", "pytest"]:
        assert args[2:], "name the tests"  # their paths are checked above
    elif name in ("python", "python3", "bash"):
        check_script(args[0], args[1:])
    elif name == "make":
        check_make(args)
    elif name == "pip":  # the extras installed are pyproject.toml's
        extras = [m[1] for a in args if (m := re.fullmatch(r"\.\[(.*)\]", a))]
        for extra in ",".join(extras).split(",") if extras else ():
            assert re.search(rf"^{extra} = \[", (ROOT / "pyproject.toml").read_text(), re.M), extra
    elif name == "jupyter":
        assert args[0] in ("lab", "nbconvert"), args
    elif name != "curl":  # curl runs in test_page_runs
        raise AssertionError(f"no check for {prog}: add one to tests/test_docs.py")
    script = [ROOT / args[0]] if name in ("python", "bash") and args[0] != "-m" else []
    for var in set(env) - GENERIC_ENV:
        assert any(var in p.read_text() for p in script + ENV_READERS), f"nothing reads {var}"


@EACH_PAGE
def test_bash_commands_are_valid(page):
    for block in (b for b in blocks(page) if b.lang == "bash"):
        for words in commands(block.code):
            try:
                check_command(words)
            except AssertionError as err:
                where = f"{page.name}:{block.line}: {shlex.join(words)}"
                raise AssertionError(f"{where}\n{err}") from None


# -- python blocks (and curl) run -----------------------------------------------------------

class DocsEngines:
    """The ``Engine`` the pages' python blocks get (module docstring), and what it made."""

    def __init__(self, request, monkeypatch):
        self.request, self.monkeypatch, self.real = request, monkeypatch, minijax_serve.Engine
        self.made, self.serving = [], False
        monkeypatch.setattr(minijax_serve, "Engine", self)

    def shared(self):
        """The session's SmolLM2 engine (made, if this is its first use, by the real Engine)."""
        self.monkeypatch.setattr(minijax_serve, "Engine", self.real)
        engine = self.request.getfixturevalue("smollm2_engine")
        self.monkeypatch.setattr(minijax_serve, "Engine", self)
        return engine

    def __call__(self, model, config=None, **kw):
        if model == "smollm2-135m" and config is None and "simulate" not in kw:
            rest = {k: v for k, v in kw.items() if k not in SIZING}
            assert rest or not self.serving, "the page's server owns the shared engine from " \
                "its first block on: make the engine before the server's blocks"
            engine = (self.shared() if not rest
                      else self.real(model, page_size=16, **SMOLLM2_SMALL, **rest))
        else:
            engine = self.real(model, config, **kw)
        self.made.append(engine)
        return engine

    def settle(self) -> None:
        """Finish what a failed block left: the shared engine stays idle for the suite."""
        for engine in self.made:
            while engine.has_unfinished():  # the loop always makes progress
                engine.step()


def run_curl(words: list[str], host: str) -> None:
    done = subprocess.run([w.replace(HOST, host) for w in words],
                          check=False, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "error" not in json.loads(done.stdout), done.stdout


@EACH_PAGE
def test_page_runs(page, request, monkeypatch):
    runnable = [b for b in blocks(page) if b.lang == "python"
                or b.lang == "bash" and any(w[0] == "curl" for w in commands(b.code))]
    engines = DocsEngines(request, monkeypatch)
    namespace, server = {"__name__": "docs"}, None
    with contextlib.ExitStack() as stack:
        stack.callback(engines.settle)
        for block in runnable:
            if server is None and HOST in block.code:  # from here to the page's end
                shared = engines.shared()
                server = stack.enter_context(
                    running_server(shared, served_model_name="smollm2-135m"))
                engines.serving = True
                engines.made.append(shared)
            if block.lang == "bash":
                for words in (w for w in commands(block.code) if w[0] == "curl"):
                    run_curl(words, server.base_url.removeprefix("http://"))
                continue
            code = "\n" * (block.line - 1) + block.code  # tracebacks show the page's own lines
            if server is not None:
                code = code.replace(HOST, server.base_url.removeprefix("http://"))
            exec(compile(code, str(page), "exec"), namespace)
    for engine in engines.made:
        assert_idle_and_clean(engine)
