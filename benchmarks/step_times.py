"""Time single model steps of SmolLM2-135M in isolation: a decode step and a prefill step.

The model call alone (no sampler, no scheduler), on synthetic ragged batches: decode =
``--num-seqs`` (64) sequences of one new token each with 100–380 tokens already in the pools;
prefill = ``--prefill-tokens`` (4096) new tokens of fresh prompts of 32–256 tokens. ``--widths``
repeats the run for several page-table widths, to see what the width bucket costs. Prints
compile time and the median step time.

``--profile``: also where a step's time goes, by XLA operation (``op_profile.py``: three steps
traced with ``jax.profiler``, each op's self time summed, the top ops and the totals per kind of
op). On CPU the runtime reports its ops only with
``XLA_FLAGS=--xla_cpu_enable_xprof_traceme=true``; tracing slows the step a little.

    python benchmarks/step_times.py --mode decode --widths 32 512
    XLA_FLAGS=--xla_cpu_enable_xprof_traceme=true python benchmarks/step_times.py --num-seqs 8 --profile
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from op_profile import print_op_times, trace_events

from minijax_serve.attention.layer import AttentionMetadata, PagedAttention
from minijax_serve.models.loader import load_model
from minijax_serve.models.protocol import forward
from minijax_serve.models.registry import resolve_model

PAGE_SIZE, NUM_PAGES = 16, 2200


def synthetic_batch(mode: str, width: int, vocab: int, rng: np.random.Generator,
                    num_seqs: int = 64, prefill_tokens: int = 4096):
    if mode == "decode":
        lens = np.sort(rng.integers(100, 380, num_seqs))[::-1]
        positions, seq_ids = lens - 1, np.arange(num_seqs)
        cu = np.arange(num_seqs + 1)
    else:
        lens, total = [], 0
        while total < prefill_tokens:
            lens.append(min(int(rng.integers(32, 257)), prefill_tokens - total))
            total += lens[-1]
        lens = np.array(lens)
        assert len(lens) <= num_seqs, "more prompts than --num-seqs"
        positions = np.concatenate([np.arange(n) for n in lens])
        seq_ids = np.repeat(np.arange(len(lens)), lens)
        cu = np.full(num_seqs + 1, prefill_tokens)
        cu[0], cu[1:len(lens) + 1] = 0, np.cumsum(lens)
    table = np.zeros((num_seqs, width), np.int32)
    next_page = 1
    for i, n in enumerate(lens):
        pages = -(-int(n) // PAGE_SIZE)
        table[i, :pages] = np.arange(next_page, next_page + pages)
        next_page += pages
    kv_lens = np.zeros(num_seqs, np.int32)
    kv_lens[:len(lens)] = lens
    slots = table[seq_ids, positions // PAGE_SIZE] * PAGE_SIZE + positions % PAGE_SIZE
    i32 = lambda x: jnp.asarray(x, jnp.int32)  # noqa: E731
    meta = AttentionMetadata(i32(positions), i32(seq_ids), i32(slots), i32(cu), i32(table),
                             i32(kv_lens))
    ids = i32(rng.integers(0, vocab, len(positions)))
    return ids, meta, i32(np.maximum(cu[1:] - 1, 0))


def time_step(args: argparse.Namespace, width: int) -> tuple[float, float]:
    model = load_model(resolve_model("smollm2-135m").path, dtype=jnp.float32).model
    cfg = model.cfg
    rng = np.random.default_rng(0)
    ids, meta, logits_rows = synthetic_batch(args.mode, width, cfg.vocab_size, rng, args.num_seqs,
                                             args.prefill_tokens)
    shape = (cfg.num_layers, cfg.num_kv_heads, NUM_PAGES, PAGE_SIZE, cfg.head_dim)
    k_pool = jnp.asarray(rng.standard_normal(shape, np.float32))
    v_pool = jnp.asarray(rng.standard_normal(shape, np.float32))
    graphdef, params = nnx.split(model)

    def step(params, k_pool, v_pool, ids, meta, rows):
        model = nnx.merge(graphdef, params)
        logits, attn = forward(model, ids, PagedAttention(k_pool, v_pool, meta), rows)
        return logits, attn.k_pool, attn.v_pool

    start = time.perf_counter()
    compiled = jax.jit(step, donate_argnums=(1, 2)).lower(
        params, k_pool, v_pool, ids, meta, logits_rows).compile()
    compile_s = time.perf_counter() - start
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        logits, k_pool, v_pool = compiled(params, k_pool, v_pool, ids, meta, logits_rows)
        logits.block_until_ready()
        times.append(time.perf_counter() - start)
    if args.profile:
        pools = [k_pool, v_pool]

        def run():  # the pools are donated: each call takes the last one's
            logits, pools[0], pools[1] = compiled(params, *pools, ids, meta, logits_rows)
            return logits
        print_op_times(trace_events(run))
    return compile_s, float(np.median(times))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("decode", "prefill"), default="decode")
    parser.add_argument("--widths", type=int, nargs="+", default=[32],
                        help="page-table widths in pages (default: 32)")
    parser.add_argument("--num-seqs", type=int, default=64,
                        help="sequences of a decode step, sequence slots of a prefill (default: 64)")
    parser.add_argument("--prefill-tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--profile", action="store_true",
                        help="also print where a step's time goes by XLA op (see above)")
    args = parser.parse_args()
    for width in args.widths:
        compile_s, step_s = time_step(args, width)
        print(f"{args.mode} width {width:4d} pages: compile {compile_s:5.2f} s, "
              f"step {step_s * 1e3:8.1f} ms (median of {args.repeats})")


if __name__ == "__main__":
    main()
