"""Shared fixtures: tiny random-weight HF models of every supported family, their HF references,
and the real SmolLM2 default. Everything expensive is computed once per test session."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Every process of the run (this one, xdist's workers, servers, notebooks' kernels, scripts) reads
# these: one JAX compilation cache in the repository, every program written to it, as engines do.
# `make test`'s workers share it: an entry read while another worker still writes it is a miss
# (JAX warns and compiles the program).
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                      str(Path(__file__).resolve().parents[1] / ".jax_cache"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
# The suite compiles ~2,000 small programs and runs most of them a few times, so it asks XLA for
# cheap code generation: LLVM at -O0 (a third less compile time than its default: the suite 801 s
# instead of 985-1,095 on 2 cores) and XLA CPU's older fused-kernel emitters instead of its MLIR
# fusion emitters (half the compile time of a tiny model's step, a third slower SmolLM2 steps:
# the suite cold 654 s instead of 748; RESULTS.md "The suite under 10 minutes"). No fast-math
# either way; float32 rounding differs a little (tokens equal, logprobs within hf_reference's
# tolerance). Subprocesses inherit these flags; those that set XLA_FLAGS (tensor parallelism's
# forced devices) add to this value.
FAST_COMPILE = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false")
for _flag in FAST_COMPILE:
    if _flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_flag}".strip()

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from tests import hf_reference  # noqa: E402

RUN_CACHE_ENV = "MINIJAX_SERVE_CACHE"
_run_cache: Path | None = None  # the directory this process made (the controller), removed last


def _use_a_cache_of_this_run() -> None:
    """Point ``$MINIJAX_SERVE_CACHE`` at a temporary directory for the whole run, so the Orbax
    load caches of the tests' temporary models do not pile up in the user's home. The controller
    makes it before xdist starts its workers, which inherit it; SmolLM2's conversion is linked in
    from the user's cache when it is complete there (otherwise the run converts its own). A
    ``MINIJAX_SERVE_CACHE`` set by the caller is kept."""
    global _run_cache
    if RUN_CACHE_ENV in os.environ:
        return
    from minijax_serve.models.gguf_convert import is_complete
    from minijax_serve.models.loader import cache_root

    home_smollm2 = cache_root() / "smollm2-135m"
    _run_cache = Path(tempfile.mkdtemp(prefix="minijax_serve_tests_"))
    if is_complete(home_smollm2):
        (_run_cache / "smollm2-135m").symlink_to(home_smollm2.resolve(), target_is_directory=True)
    os.environ[RUN_CACHE_ENV] = str(_run_cache)


_use_a_cache_of_this_run()


def pytest_unconfigure(config):
    if _run_cache is not None:
        shutil.rmtree(_run_cache, ignore_errors=True)

pytest_plugins = ["tests.tiny_server"]  # the tiny OpenAI-compatible server, one per session

FAMILIES = ["llama", "qwen2", "qwen3", "mistral"]


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """family -> directory of a saved tiny random model."""
    root = tmp_path_factory.mktemp("tiny_models")
    return {f: hf_reference.save_tiny_model(f, root / f) for f in FAMILIES}


@pytest.fixture(scope="session")
def tiny_prompts():
    """16 token-id prompts of lengths 1..40 (vocab ids below 250, valid in every tiny model)."""
    rng = np.random.default_rng(1234)
    lengths = [1, 2, 3, 5, 7, 9, 12, 15, 17, 20, 24, 27, 31, 34, 37, 40]
    return [rng.integers(0, 250, size=n).tolist() for n in lengths]


@pytest.fixture(scope="session")
def tiny_greedy_refs(tiny_dir, tiny_prompts):
    """family -> HF greedy continuations (24 tokens) of every tiny prompt."""
    return {f: hf_reference.greedy(tiny_dir[f], tiny_prompts, 24) for f in FAMILIES}


@pytest.fixture(scope="session")
def hf_llama(tiny_dir):
    """The tiny Llama loaded in HF transformers (the reference)."""
    return hf_reference.load_hf(tiny_dir["llama"])


# The real SmolLM2 with small buckets: context 256, prefill steps of 128 and 256 tokens.
SMOLLM2_SMALL = dict(max_total_tokens=4096, max_running_requests=4, max_prefill_tokens=256,
                     min_token_bucket=128, min_kv_bucket=256, context_length=256)


@pytest.fixture(scope="session")
def smollm2_dir():
    from minijax_serve.models.gguf_convert import ensure_smollm2
    from minijax_serve.models.loader import cache_root

    return ensure_smollm2(cache_root())


@pytest.fixture(scope="session")
def smollm2_engine(smollm2_dir):
    """One SmolLM2 engine (page size 16) shared by every module: tests leave it idle."""
    from minijax_serve import Engine

    return Engine("smollm2-135m", page_size=16, **SMOLLM2_SMALL)


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_dir):
    return hf_reference.load_hf(smollm2_dir)
