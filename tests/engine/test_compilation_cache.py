"""The persistent compilation cache every engine turns on: where it goes, what it leaves alone
(a directory configured already, an opt-out), and that creating an engine asks for it. Nothing
here compiles."""

from __future__ import annotations

import jax
import pytest

from minijax_serve import Engine, EngineConfig
from minijax_serve.engine import compilation_cache, core as engine_core
from minijax_serve.cli import build_parser
from minijax_serve.config.flags import engine_config_from_args
from minijax_serve.engine.compilation_cache import (ENV_VAR, MIN_COMPILE_TIME_S,
                                                    enable_compilation_cache)

SETTINGS = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs")


@pytest.fixture
def jax_settings(monkeypatch):
    """JAX's cache settings as they were (tests/conftest.py's), restored after the test."""
    monkeypatch.delenv(ENV_VAR, raising=False)
    saved = {name: getattr(jax.config, name) for name in SETTINGS}
    yield saved
    for name, value in saved.items():
        jax.config.update(name, value)


def _current() -> dict:
    return {name: getattr(jax.config, name) for name in SETTINGS}


def test_a_configured_directory_is_kept_with_its_threshold(jax_settings):
    assert jax_settings["jax_compilation_cache_dir"]  # conftest.py chose one
    assert enable_compilation_cache() == jax_settings["jax_compilation_cache_dir"]
    assert _current() == jax_settings


def test_default_directory_caches_every_program(jax_settings, monkeypatch, tmp_path):
    monkeypatch.setenv("MINIJAX_SERVE_CACHE", str(tmp_path))
    jax.config.update("jax_compilation_cache_dir", None)
    assert enable_compilation_cache() == str(tmp_path / "jax")
    assert _current() == {"jax_compilation_cache_dir": str(tmp_path / "jax"),
                          "jax_persistent_cache_min_compile_time_secs": MIN_COMPILE_TIME_S}


@pytest.mark.parametrize("how", ["config", "env"])
def test_opting_out_leaves_jax_untouched(jax_settings, monkeypatch, tmp_path, how):
    monkeypatch.setenv("MINIJAX_SERVE_CACHE", str(tmp_path))
    jax.config.update("jax_compilation_cache_dir", None)
    if how == "env":
        monkeypatch.setenv(ENV_VAR, "0")
    assert enable_compilation_cache(enabled=how != "config") is None
    assert _current() == dict(jax_settings, jax_compilation_cache_dir=None)
    assert not (tmp_path / "jax").exists()


def test_config_field_flag_and_env_spellings(monkeypatch):
    assert EngineConfig().compilation_cache is True
    with pytest.raises(ValueError, match="compilation_cache must be True or False"):
        EngineConfig(compilation_cache="no")
    args = build_parser().parse_args(["bench", "--no-compilation-cache"])
    assert engine_config_from_args(args).compilation_cache is False
    for value, on in (("0", False), ("off", False), ("False", False), ("1", True), ("", True)):
        monkeypatch.setenv(ENV_VAR, value)
        assert compilation_cache.enabled_by_env() is on


def test_creating_an_engine_asks_for_the_cache_first(monkeypatch):
    calls = []

    class Stop(Exception):
        pass

    def spy(enabled: bool) -> None:  # stops the engine before it loads anything
        calls.append(enabled)
        raise Stop

    monkeypatch.setattr(engine_core, "enable_compilation_cache", spy)
    for enabled in (True, False):
        with pytest.raises(Stop):
            Engine("no-such-model", compilation_cache=enabled)
    assert calls == [True, False]
