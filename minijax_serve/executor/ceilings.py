"""A device's ceilings, measured as the bench measures them: the FLOP/s of a large square matmul
and the bytes/s of a large element-wise copy (read + written, as ``bandwidthTest`` counts).
The bench sets MFU and bandwidth utilisation against them; the simulated accelerator's
profiles are calibrated against them (:mod:`minijax_serve.simulate.profiles`)."""

from __future__ import annotations

import time
from typing import Any

import jax
import jax.numpy as jnp


def default_matmul_size() -> int:
    """2048 on CPU; 8192 on accelerators, where a 2048 matmul is too short to reach the peak."""
    return 2048 if jax.default_backend() == "cpu" else 8192


def matmul_peak_flops(dtype: Any, n: int, reps: int = 5) -> float:
    """FLOP/s of the fastest of ``reps`` ``n×n @ n×n`` matmuls in ``dtype`` (after a warm-up)."""
    ka, kb = jax.random.split(jax.random.key(0))
    a = jax.random.normal(ka, (n, n), dtype)
    b = jax.random.normal(kb, (n, n), dtype)
    matmul = jax.jit(jnp.matmul)
    matmul(a, b).block_until_ready()  # compile + warm-up
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        matmul(a, b).block_until_ready()
        best = min(best, time.perf_counter() - start)
    del a, b
    return 2.0 * n**3 / best


def default_copy_mib() -> int:
    """Size of the timed copy: 256 MiB on CPU, 2 GiB on accelerators (well past any cache)."""
    return 256 if jax.default_backend() == "cpu" else 2048


def copy_bandwidth(mib: int, reps: int = 5) -> float:
    """Bytes/s (read + written) of the fastest of ``reps`` element-wise passes over a
    ``mib``-MiB float32 array into a new one, on the default device (after a warm-up)."""
    n = mib * (1 << 20) // 4
    x = jnp.zeros((n,), jnp.float32)
    bump = jax.jit(lambda a: a + 1.0)  # a plain copy could be elided; this cannot
    bump(x).block_until_ready()
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        bump(x).block_until_ready()
        best = min(best, time.perf_counter() - start)
    del x
    return 2.0 * n * 4 / best
