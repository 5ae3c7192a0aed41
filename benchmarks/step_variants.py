"""Time variants of one model step against each other, interleaved in one process.

This machine's speed drifts by 10–20 % over minutes, so two separate runs cannot tell a 5 % change
from the drift. This script compiles every variant of the same step (the synthetic batches of
``step_times.py``) and calls them in turn, round after round, so that all of them see the same
drift. It prints each variant's median step time, its ratio to the first variant's, and its
largest logit difference from the first (0: the same arithmetic).

A variant is ``default`` or comma-separated settings:

* ``xla:KEY=VALUE``: an XLA compile option of the step, e.g. ``xla:xla_cpu_experimental_ynn_fusion_type=``
  (an empty value: no YNNPACK fusions, so the dots run on XLA's own Eigen path);
* ``q_tile=N``, ``kv_block_tokens=N``, ``kv_chunk_tokens=N``: the reference attention's tiles;
* ``layer_loop=scan`` or ``layer_loop=unroll``;
* ``attention=off``: the attention replaced by its queries (what the rest of the step costs).

    python benchmarks/step_variants.py --num-seqs 8 default xla:xla_cpu_experimental_ynn_fusion_type=
    python benchmarks/step_variants.py --mode prefill --prefill-tokens 512 q_tile=32 q_tile=64
"""

from __future__ import annotations

import argparse
import functools
import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from step_times import NUM_PAGES, PAGE_SIZE, synthetic_batch

import minijax_serve.attention.layer as attention
from minijax_serve.models.loader import load_model
from minijax_serve.models.protocol import forward
from minijax_serve.models.registry import resolve_model

TILES = ("q_tile", "kv_block_tokens", "kv_chunk_tokens")


class Variant(NamedTuple):
    options: dict[str, Any]  # XLA compile options
    tiles: dict[str, int]  # the reference attention's tile arguments
    loop: str = "scan"
    attention: bool = True


def parse_variant(text: str) -> Variant:
    options: dict[str, Any] = {}
    tiles: dict[str, int] = {}
    loop, attend = "scan", True
    for item in ([] if text == "default" else text.split(",")):
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"variant setting {item!r} is not KEY=VALUE")
        if key.startswith("xla:"):
            options[key[4:]] = value
        elif key in TILES:
            tiles[key] = int(value)
        elif key == "layer_loop" and value in ("scan", "unroll"):
            loop = value
        elif key == "attention" and value == "off":
            attend = False
        else:
            raise ValueError(f"unknown variant setting {item!r}: xla:KEY=VALUE, "
                             f"{', '.join(TILES)}, layer_loop=scan|unroll or attention=off")
    return Variant(options, tiles, loop, attend)


def _queries(attn, q, *args, **kwargs):
    return q, attn


def make_step(graphdef, loop: str):
    """A new step function each call, so that jax traces every variant anew."""
    def step(params, k_pool, v_pool, ids, meta, rows):
        model = nnx.merge(graphdef, params)
        logits, attn = forward(model, ids, attention.PagedAttention(k_pool, v_pool, meta), rows,
                               loop)
        return logits, attn.k_pool, attn.v_pool
    return step


def run(args: argparse.Namespace) -> dict[str, tuple[float, float]]:
    """Compile and time every variant; returns variant -> (median seconds, max |logit diff|)."""
    model = load_model(resolve_model(args.model).path, dtype=jnp.float32).model
    cfg = model.cfg
    graphdef, params = nnx.split(model)
    batch = synthetic_batch(args.mode, args.width, cfg.vocab_size, np.random.default_rng(0),
                            args.num_seqs, args.prefill_tokens)
    shape = (cfg.num_layers, cfg.num_kv_heads, NUM_PAGES, PAGE_SIZE, cfg.head_dim)
    rng = np.random.default_rng(0)
    pools = [jnp.asarray(rng.standard_normal(shape, np.float32)) for _ in range(2)]
    reference, paged = attention.ragged_paged_attention_ref, attention.PagedAttention.__call__
    compiled = {}
    for text in args.variants:
        variant = parse_variant(text)
        attention.ragged_paged_attention_ref = functools.partial(reference, **variant.tiles)
        attention.PagedAttention.__call__ = paged if variant.attention else _queries
        try:
            lowered = jax.jit(make_step(graphdef, variant.loop), donate_argnums=(1, 2)).lower(
                params, *pools, *batch)
        finally:
            attention.ragged_paged_attention_ref = reference
            attention.PagedAttention.__call__ = paged
        compiled[text] = lowered.compile(compiler_options=variant.options)
    times: dict[str, list[float]] = {text: [] for text in compiled}
    logits: dict[str, np.ndarray] = {}
    for _ in range(args.rounds):
        for text, fn in compiled.items():
            for _ in range(args.calls):
                start = time.perf_counter()
                out = fn(params, *pools, *batch)
                out[0].block_until_ready()
                times[text].append(time.perf_counter() - start)
                pools = list(out[1:])
            logits[text] = np.asarray(out[0])
    first = logits[args.variants[0]]
    return {text: (float(np.median(times[text])), float(np.abs(logits[text] - first).max()))
            for text in compiled}


def main(argv: list[str] | None = None) -> dict[str, tuple[float, float]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("variants", nargs="+", help="'default' or comma-separated settings (above)")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--mode", choices=("decode", "prefill"), default="decode")
    parser.add_argument("--num-seqs", type=int, default=64,
                        help="sequences of a decode step, sequence slots of a prefill (default: 64)")
    parser.add_argument("--prefill-tokens", type=int, default=512)
    parser.add_argument("--width", type=int, default=32, help="page-table width in pages")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--calls", type=int, default=3, help="calls of each variant per round")
    args = parser.parse_args(argv)
    for text in args.variants:
        parse_variant(text)  # every error before the slow part
    results = run(args)
    base = results[args.variants[0]][0]
    what = (f"{args.num_seqs} sequences" if args.mode == "decode"
            else f"{args.prefill_tokens} new tokens")
    print(f"{args.mode} step, {what}; median of {args.rounds} rounds x {args.calls} calls")
    width = max(len(t) for t in results)
    print(f"  {'variant':<{width}}  {'ms':>9}  {'ratio':>6}  max |logit diff|")
    for text, (seconds, diff) in results.items():
        print(f"  {text:<{width}}  {seconds * 1e3:9.1f}  {seconds / base:5.2f}x  {diff:.1e}")
    return results


if __name__ == "__main__":
    main()
