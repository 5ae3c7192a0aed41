"""Benchmark figures: latency summaries, model FLOPs of a run, and a measured matmul peak.

Model FLOPs (useful work only; padding, retract re-prefills and the sampler are not counted).
A request with ``P`` prompt tokens and ``O`` output tokens runs ``T = P + O - 1`` tokens through
the model (its last output token is sampled but never fed back). Each forwarded token costs

* ``2 · N`` FLOPs in the weight matmuls, ``N`` = ``ModelConfig.num_params()`` (a slight
  over-count: the embedding lookup is no matmul and prefill computes the LM head for the last
  token only);
* ``4 · layers · heads · head_dim · c`` FLOPs in attention, ``c`` the keys it attends to
  (``Q·Kᵀ`` and ``P·V``, 2 FLOPs per multiply-add each). The token at position ``k`` attends to
  ``k + 1`` keys, so a request's attention sums ``c`` over ``1..T``: ``T · (T + 1) / 2``.

MFU = (model FLOPs / duration) / peak, where the peak is the best time of a square ``jnp``
matmul in the engine's dtype on the same device, in the same process.
"""

from __future__ import annotations

import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from minijax_serve.models.config import ModelConfig


def summarize(values: Sequence[float], scale: float = 1.0) -> dict[str, float]:
    """Mean, median and p99 of ``values`` times ``scale`` (zeros when empty)."""
    if not len(values):
        return {"mean": 0.0, "median": 0.0, "p99": 0.0}
    a = np.asarray(values, dtype=np.float64) * scale
    return {"mean": float(a.mean()), "median": float(np.median(a)), "p99": float(np.percentile(a, 99))}


def request_latencies(outputs: Sequence[Any]) -> dict[str, list[float]]:
    """Per-request TTFT, end-to-end latency and time per output token (after the first), in s."""
    ttft, e2e, tpot = [], [], []
    for out in outputs:
        if out.first_token_time is not None:
            ttft.append(out.first_token_time - out.arrival_time)
        if out.finish_time is not None:
            e2e.append(out.finish_time - out.arrival_time)
            if out.first_token_time is not None and len(out.token_ids) > 1:
                tpot.append((out.finish_time - out.first_token_time) / (len(out.token_ids) - 1))
    return {"ttft": ttft, "e2e": e2e, "tpot": tpot}


def model_flops(cfg: ModelConfig, prompt_lens: Sequence[int], output_lens: Sequence[int]) -> float:
    """FLOPs of serving the requests once each (see the module docstring for the formula)."""
    per_token = 2.0 * cfg.num_params()
    attn_per_key = 4.0 * cfg.num_layers * cfg.num_heads * cfg.head_dim
    total = 0.0
    for p, o in zip(prompt_lens, output_lens):
        t = p + max(o, 1) - 1
        total += per_token * t + attn_per_key * t * (t + 1) / 2
    return total


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
