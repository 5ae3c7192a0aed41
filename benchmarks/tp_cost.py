"""What tensor parallelism costs per step: the collectives in the compiled step, and on CPU the
sharded program's overhead.

``collectives`` (the default): for each model shape and tp, the decode step of
``--num-seqs`` sequences (bfloat16, the GPU defaults: layers unrolled) and its greedy sampler
are compiled on forced CPU devices from abstract weights (nothing is allocated) and the
collectives of the optimized HLO are counted with their bytes, beside the weights one device
holds. The per-layer count comes
from compiling 1 and 2 layers (the step is the same program around them), so an 8B model need
not be compiled whole. The projection for 8 x H200 assumes ring collectives, an all-reduce
moving ``2 (tp-1)/tp x bytes`` and an all-gather ``(tp-1)/tp x bytes``, at ``--link-gbps`` per
direction (NVLink 4 on H200: 900 GB/s per GPU in both directions together, NVIDIA's H200
datasheet, so 450 GB/s each way) plus ``--latency-us`` per collective (assumed).

``time``: the decode step of SmolLM2 and its greedy sampler (dummy weights, float32) at tp = 1
and tp = ``--tp``
on forced CPU devices, alternating, to show what the sharded program adds where nothing can be
gained (the devices share the host's cores).

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python benchmarks/tp_cost.py
    XLA_FLAGS=--xla_force_host_platform_device_count=3 python benchmarks/tp_cost.py time --tp 3
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import re
import time
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from minijax_serve.executor.buckets import StepShape
from minijax_serve.executor.forward_batch import empty_forward_batch, pack, sampling_size
from minijax_serve.executor.step_functions import forward_step, sample_step
from minijax_serve.executor.tensor_parallel import (POOL_SPEC, layout, logits_sharding, pad_vocab,
                                                    param_shardings, replicated)
from minijax_serve.models.config import load_model_config
from minijax_serve.models.decoder import DecoderLM
from minijax_serve.models.registry import resolve_model

COLLECTIVE = re.compile(r"=\s*(\S+)\s+(all-reduce|all-gather|reduce-scatter|all-to-all|"
                        r"collective-permute)(-start)?\(")
BYTES = {"bf16": 2, "f16": 2, "f32": 4, "s32": 4, "u32": 4, "pred": 1, "s8": 1}


def collectives(hlo: str) -> Counter:
    """How many of each (op, bytes) collective an optimized HLO module holds."""
    out = Counter()
    for shape, op, _ in COLLECTIVE.findall(hlo):
        total = 0
        for dtype, dims in re.findall(r"(\w+)\[([\d,]*)\]", shape):
            total += BYTES.get(dtype, 4) * int(np.prod([int(d) for d in dims.split(",") if d]))
        out[op, total] += 1
    return out


def compiled_step(cfg, tp: int, shape: StepShape, pages: int, dtype, layer_loop: str,
                  abstract: bool = True):
    """The compiled decode step of ``cfg`` at ``tp``, and (not abstract) its arguments."""
    lay = layout(cfg, tp)  # a mesh of one device at tp = 1, as the engine runs it
    make = lambda: pad_vocab(DecoderLM(cfg, dtype=dtype, rngs=nnx.Rngs(0)), tp)  # noqa: E731
    model = nnx.eval_shape(make) if abstract else make()
    graphdef, state = nnx.split(model)
    leaves, tree = jax.tree.flatten(state)
    shardings, rep = param_shardings(model, state, lay), replicated(lay)
    pool = NamedSharding(lay.mesh, POOL_SPEC)
    pool_shape = (cfg.num_layers, cfg.num_kv_heads, pages, 16, cfg.head_dim)
    if abstract:
        params = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s) for x, s in zip(leaves, shardings)]
        k = v = jax.ShapeDtypeStruct(pool_shape, dtype, sharding=pool)
        buf = jax.ShapeDtypeStruct((shape.num_seqs + 1,), jnp.int32, sharding=rep)
    else:
        params = [jax.device_put(x, s) for x, s in zip(leaves, shardings)]
        k, v = (jnp.zeros(pool_shape, dtype, device=pool) for _ in range(2))
        buf = jnp.zeros((shape.num_seqs + 1,), jnp.int32, device=rep)
    packed = pack(empty_forward_batch(shape))
    fn = functools.partial(forward_step, graphdef, tree, "xla", layer_loop, lay.mesh, shape, 0)
    compiled = jax.jit(fn, donate_argnums=(1, 2)).lower(params, k, v, buf, packed).compile()
    return compiled, (params, k, v, buf, packed)


def compiled_greedy_sampler(cfg, tp: int, num_seqs: int):
    """The greedy sampler of ``num_seqs`` sequences at ``tp``, on the logits as a step leaves
    them (split by vocabulary where tp divides it)."""
    lay = layout(cfg, tp)
    rep = replicated(lay)
    logits = jax.ShapeDtypeStruct((num_seqs, cfg.vocab_size), jnp.float32,
                                  sharding=logits_sharding(lay.mesh, cfg.vocab_size))
    fn = functools.partial(sample_step, num_seqs, True, False, False, rep)
    return jax.jit(fn, donate_argnums=(0,)).lower(
        jax.ShapeDtypeStruct((num_seqs + 1,), jnp.int32, sharding=rep), logits,
        jax.ShapeDtypeStruct((sampling_size(num_seqs),), jnp.int32, sharding=rep)).compile()


def device_weight_bytes(params) -> int:
    """Bytes of the weights one device holds."""
    return sum(int(np.prod(p.sharding.shard_shape(p.shape))) * p.dtype.itemsize for p in params)


def run_collectives(args: argparse.Namespace) -> None:
    shape = StepShape(args.num_seqs, args.num_seqs, args.pages_per_seq, decode=True)
    print(f"decode step of {args.num_seqs} sequences, bfloat16, layers unrolled; projection: "
          f"ring all-reduce at {args.link_gbps:.0f} GB/s per direction + {args.latency_us:.0f} µs "
          "per collective (assumed)")
    print(f"{'model':14} {'tp':>3} {'weights MB':>10} {'per layer':>10} {'rest':>5} "
          f"{'per step':>9} {'bytes/step':>12} {'projected µs':>13}")
    for name in args.models:
        base = load_model_config(resolve_model(name).path)
        for tp in args.tp:
            counts, weights = [], []
            try:
                for layers in (1, 2):
                    cfg = dataclasses.replace(base, num_layers=layers)
                    compiled, (params, *_) = compiled_step(
                        cfg, tp, shape, args.num_seqs * args.pages_per_seq + 1, jnp.bfloat16,
                        "unroll")
                    counts.append(collectives(compiled.as_text()))
                    weights.append(device_weight_bytes(params))
            except ValueError as err:
                print(f"{name:14} {tp:>3}   {err}")
                continue
            L = base.num_layers
            sampler = collectives(compiled_greedy_sampler(base, tp, args.num_seqs).as_text())
            keys = counts[0].keys() | counts[1].keys() | sampler.keys()  # (op, bytes)
            per_layer = {k: counts[1][k] - counts[0][k] for k in keys}
            step = {k: counts[0][k] + (L - 1) * per_layer[k] + sampler[k] for k in keys}
            ring = {"all-reduce": 2 * (tp - 1) / tp, "all-gather": (tp - 1) / tp}
            n = sum(step.values())
            nbytes = sum(b * c for (_, b), c in step.items())
            moved = sum(ring.get(op, 1.0) * b * c for (op, b), c in step.items())
            projected = n * args.latency_us + 1e6 * moved / (args.link_gbps * 1e9)
            total_weights = weights[0] + (L - 1) * (weights[1] - weights[0])
            ops = {}
            for (op, _), c in step.items():
                ops[op] = ops.get(op, 0) + c
            kinds = ", ".join(f"{c} {op}" for op, c in sorted(ops.items()) if c) or "-"
            print(f"{name:14} {tp:>3} {total_weights / 1e6:>10,.1f} "
                  f"{sum(per_layer.values()):>10} {n - L * sum(per_layer.values()):>5} {n:>9} "
                  f"{nbytes:>12,} {projected:>13.1f}  {kinds}")


def run_time(args: argparse.Namespace) -> None:
    cfg = load_model_config(resolve_model("smollm2-135m").path)
    shape = StepShape(args.num_seqs, args.num_seqs, args.pages_per_seq, decode=True)
    pages = args.num_seqs * args.pages_per_seq + 1
    steps = {tp: compiled_step(cfg, tp, shape, pages, jnp.float32, "scan", abstract=False)
             for tp in (1, args.tp)}
    samplers = {tp: compiled_greedy_sampler(cfg, tp, args.num_seqs) for tp in steps}
    times: dict[int, list[float]] = {tp: [] for tp in steps}
    for _ in range(args.rounds):
        for tp, (fn, (params, k, v, buf, packed)) in steps.items():
            for _ in range(3):
                start = time.perf_counter()
                k, v, logits, front = fn(params, k, v, buf, packed)
                buf, tokens = samplers[tp](buf, logits, front)
                tokens.block_until_ready()
                times[tp].append(time.perf_counter() - start)
            steps[tp] = (fn, (params, k, v, buf, packed))
    for tp, t in times.items():
        print(f"SmolLM2 decode step and greedy sampler, {args.num_seqs} sequences, tp={tp}: median "
              f"{1e3 * np.median(t):.1f} ms (25-75 %: {1e3 * np.percentile(t, 25):.1f}-"
              f"{1e3 * np.percentile(t, 75):.1f}), {len(t)} calls")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", nargs="?", choices=("collectives", "time"), default="collectives")
    ap.add_argument("--models", nargs="+", default=["smollm2-135m", "qwen3-0.6b", "llama-3-8b"])
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2, 3, 4, 8])
    ap.add_argument("--num-seqs", type=int, default=64)
    ap.add_argument("--pages-per-seq", type=int, default=8)
    ap.add_argument("--link-gbps", type=float, default=450.0)
    ap.add_argument("--latency-us", type=float, default=10.0)
    ap.add_argument("--rounds", type=int, default=6)
    args = ap.parse_args()
    if args.mode == "time":
        args.tp = args.tp[-1]
        run_time(args)
    else:
        run_collectives(args)


if __name__ == "__main__":
    main()
