"""Memory over engine lifetimes: create an engine, generate a few tokens, drop it; again and again.

    python benchmarks/engine_cycles.py [--cycles 300] [--every 25] [--clear-jax-caches]

On the tiny Llama of benchmarks/compile_cache.py (dummy weights; or ``--model``, a model
directory), each cycle creates an :class:`~minijax_serve.Engine`, generates ``--tokens`` tokens
for three prompts, drops the engine and collects garbage. Every ``--every`` cycles it prints the
process's resident memory, JAX's live arrays (``len(jax.live_arrays())``), the Python objects
the garbage collector tracks, and the resident memory's growth per cycle since the last report.
The compilation cache is as the library leaves it (on, in ``$MINIJAX_SERVE_CACHE/jax``), so
after the first cycle every program loads from it.

Each engine traces its programs afresh, and tracing fills JAX's own in-memory caches, bounded
LRU caches (``jnp.einsum``, in the reference attention, builds a new jit wrapper per call, so
each cycle adds a dozen entries to one that holds at most 2048): they grow until full. With
``--clear-jax-caches`` (``jax.clear_caches()`` after each cycle) the objects left are exactly
those an engine leaves behind: none, if the count is flat.
"""

from __future__ import annotations

import argparse
import gc
import os
import tempfile
import time
from pathlib import Path

from compile_cache import (  # benchmarks/ is the script's path
    TINY_ENGINE,
    write_tiny_llama,
)


def rss_mib() -> float:
    """This process's resident memory in MiB (Linux: /proc/self/statm)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def cycle(model: str, kwargs: dict, tokens: int) -> None:
    """One engine's life: create it, generate ``tokens`` tokens for three prompts, drop it."""
    from minijax_serve import Engine, SamplingParams

    engine = Engine(model, **kwargs)
    params = SamplingParams(max_new_tokens=tokens, ignore_eos=True)
    outs = engine.generate([[1, 2, 3], [4, 5, 6, 7, 8], [9] * 20], params)
    assert all(len(o.token_ids) == tokens for o in outs)
    del engine, outs
    gc.collect()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", type=int, default=300)
    parser.add_argument("--every", type=int, default=25, help="report every N cycles")
    parser.add_argument("--tokens", type=int, default=4, help="tokens generated per prompt")
    parser.add_argument("--model", help="a model directory (default: the tiny Llama)")
    parser.add_argument("--clear-jax-caches", action="store_true",
                        help="jax.clear_caches() after each cycle (JAX's caches out of the count)")
    args = parser.parse_args()
    import jax

    with tempfile.TemporaryDirectory() as tmp:
        if args.model:
            model, kwargs = args.model, dict(skip_tokenizer_init=True, max_total_tokens=1024,
                                             max_running_requests=4)
        else:
            model, kwargs = str(write_tiny_llama(Path(tmp) / "tiny-llama")), TINY_ENGINE
        print(f"{'cycle':>6} {'RSS MiB':>8} {'live arrays':>11} {'gc objects':>10} "
              f"{'RSS KiB/cycle':>13} {'s/cycle':>7}")
        last = (0, time.perf_counter(), None)  # cycle, time, RSS of the last report
        for i in range(1, args.cycles + 1):
            cycle(model, kwargs, args.tokens)
            if args.clear_jax_caches:
                jax.clear_caches()
                gc.collect()
            if i % args.every and i != 1:
                continue
            now, rss = time.perf_counter(), rss_mib()
            growth = "" if last[2] is None else f"{(rss - last[2]) * 1024 / (i - last[0]):.1f}"
            print(f"{i:>6} {rss:>8.1f} {len(jax.live_arrays()):>11} {len(gc.get_objects()):>10} "
                  f"{growth:>13} {(now - last[1]) / (i - last[0]):>7.2f}", flush=True)
            last = (i, now, rss)


if __name__ == "__main__":
    main()
