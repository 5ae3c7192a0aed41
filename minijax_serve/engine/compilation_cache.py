"""JAX's persistent compilation cache, on by default for every engine.

Each engine compiles its step programs afresh (their ``jax.jit`` closures belong to it), so
without a persistent cache a second :class:`~minijax_serve.Engine` of the same shapes, in the
same process or a later one, compiles everything again. :func:`enable_compilation_cache` is
called when an engine is created: it points JAX's cache at ``$MINIJAX_SERVE_CACHE/jax``
(default ``~/.cache/minijax_serve/jax``) and writes every program to it whatever its compile
time (JAX's default threshold of 1 s would skip a tiny model's programs and a large model's
samplers; writing one costs a few milliseconds). Later compilations of the same programs load
them from disk.

* A cache directory configured already (``jax.config.update("jax_compilation_cache_dir", ...)``
  or ``JAX_COMPILATION_CACHE_DIR``) is kept as it is, with its own thresholds.
* Opt out with ``EngineConfig(compilation_cache=False)`` (``--no-compilation-cache``) or
  ``MINIJAX_SERVE_COMPILATION_CACHE=0`` in the environment: JAX's settings are left untouched.
  The cache is process-wide: an engine that opts out does not turn off a cache that an earlier
  engine (or the user) turned on; ``jax.config.update("jax_enable_compilation_cache", False)``
  does.
"""

from __future__ import annotations

import os

import jax

from minijax_serve.models.loader import cache_root

ENV_VAR = "MINIJAX_SERVE_COMPILATION_CACHE"  # "0", "false", "off" or "no": off
MIN_COMPILE_TIME_S = 0.0  # cache every program (JAX's default is 1 s)


def enabled_by_env() -> bool:
    """False when ``$MINIJAX_SERVE_COMPILATION_CACHE`` turns the cache off."""
    return os.environ.get(ENV_VAR, "1").strip().lower() not in ("0", "false", "off", "no")


def enable_compilation_cache(enabled: bool = True) -> str | None:
    """Turn on JAX's persistent compilation cache unless ``enabled`` is False or the environment
    turns it off (module docstring); returns JAX's cache directory after the call (None: none).

    A directory configured already is kept, thresholds included; otherwise the cache goes to
    ``$MINIJAX_SERVE_CACHE/jax`` and takes every program (``MIN_COMPILE_TIME_S``)."""
    if not (enabled and enabled_by_env()):
        return jax.config.jax_compilation_cache_dir
    if not jax.config.jax_compilation_cache_dir:
        jax.config.update("jax_compilation_cache_dir", str(cache_root() / "jax"))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_TIME_S)
    return jax.config.jax_compilation_cache_dir
