"""Time single model steps of SmolLM2-135M in isolation: a decode step and a prefill step.

The model call alone (no sampler, no scheduler), on synthetic ragged batches: decode = 64
sequences of one new token each with 100–380 tokens already in the pools; prefill = 4096 new
tokens of fresh prompts of 32–256 tokens. ``--widths`` repeats the run for several page-table
widths, to see what the width bucket costs. Prints compile time and the median step time.

    python benchmarks/step_times.py --mode decode --widths 32 512
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from minijax_serve.models.attention import AttentionMetadata
from minijax_serve.models.loader import load_model
from minijax_serve.models.registry import resolve_model

PAGE_SIZE, NUM_SEQS, NUM_PAGES, PREFILL_TOKENS = 16, 64, 2200, 4096


def synthetic_batch(mode: str, width: int, vocab: int, rng: np.random.Generator):
    if mode == "decode":
        lens = np.sort(rng.integers(100, 380, NUM_SEQS))[::-1]
        positions, seq_ids = lens - 1, np.arange(NUM_SEQS)
        cu = np.arange(NUM_SEQS + 1)
    else:
        lens, total = [], 0
        while total < PREFILL_TOKENS:
            lens.append(min(int(rng.integers(32, 257)), PREFILL_TOKENS - total))
            total += lens[-1]
        lens = np.array(lens)
        positions = np.concatenate([np.arange(n) for n in lens])
        seq_ids = np.repeat(np.arange(len(lens)), lens)
        cu = np.full(NUM_SEQS + 1, PREFILL_TOKENS)
        cu[0], cu[1:len(lens) + 1] = 0, np.cumsum(lens)
    table = np.zeros((NUM_SEQS, width), np.int32)
    next_page = 1
    for i, n in enumerate(lens):
        pages = -(-int(n) // PAGE_SIZE)
        table[i, :pages] = np.arange(next_page, next_page + pages)
        next_page += pages
    kv_lens = np.zeros(NUM_SEQS, np.int32)
    kv_lens[:len(lens)] = lens
    slots = table[seq_ids, positions // PAGE_SIZE] * PAGE_SIZE + positions % PAGE_SIZE
    i32 = lambda x: jnp.asarray(x, jnp.int32)  # noqa: E731
    meta = AttentionMetadata(i32(positions), i32(seq_ids), i32(slots), i32(cu), i32(table),
                             i32(kv_lens))
    ids = i32(rng.integers(0, vocab, len(positions)))
    return ids, meta, i32(np.maximum(cu[1:] - 1, 0))


def time_step(mode: str, width: int, repeats: int) -> tuple[float, float]:
    model = load_model(resolve_model("smollm2-135m").path, dtype=jnp.float32).model
    cfg = model.cfg
    rng = np.random.default_rng(0)
    ids, meta, logits_rows = synthetic_batch(mode, width, cfg.vocab_size, rng)
    shape = (cfg.num_layers, cfg.num_kv_heads, NUM_PAGES, PAGE_SIZE, cfg.head_dim)
    k_pool = jnp.asarray(rng.standard_normal(shape, np.float32))
    v_pool = jnp.asarray(rng.standard_normal(shape, np.float32))
    graphdef, params = nnx.split(model)

    def step(params, k_pool, v_pool, ids, meta, rows):
        return nnx.merge(graphdef, params)(ids, meta, rows, k_pool, v_pool)

    start = time.perf_counter()
    compiled = jax.jit(step, donate_argnums=(1, 2)).lower(
        params, k_pool, v_pool, ids, meta, logits_rows).compile()
    compile_s = time.perf_counter() - start
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        logits, k_pool, v_pool = compiled(params, k_pool, v_pool, ids, meta, logits_rows)
        logits.block_until_ready()
        times.append(time.perf_counter() - start)
    return compile_s, float(np.median(times))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("decode", "prefill"), default="decode")
    parser.add_argument("--widths", type=int, nargs="+", default=[32],
                        help="page-table widths in pages (default: 32)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    for width in args.widths:
        compile_s, step_s = time_step(args.mode, width, args.repeats)
        print(f"{args.mode} width {width:4d} pages: compile {compile_s:5.2f} s, "
              f"step {step_s * 1e3:8.1f} ms (median of {args.repeats})")


if __name__ == "__main__":
    main()
