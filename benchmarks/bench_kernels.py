"""Check and time the paged-attention kernels on the default device, one kernel call at a time.

Implementations (all read one layer of paged K/V pools [1, kv_heads, pages, page_size, D]):

* ``pallas_decode``  :func:`pallas_kernels.paged_decode_attention.paged_decode_attention`
* ``pallas_ragged``  :func:`pallas_kernels.ragged_paged_attention.ragged_paged_attention`
* ``jax_paged``      JAX's ``jax.experimental.pallas.ops.gpu.paged_attention`` (decode only; it
  takes no scale, so it gets ``q * scale``, precomputed; ``k_splits``/``pages_per_compute_block``
  the largest divisors of the table width up to its defaults 16 / 8)
* ``xla``            the pure-jnp reference, ``reference.ragged_paged_attention_ref`` (it is
  the engine's "xla" backend; it takes the new tokens' K/V as inputs, precomputed here)

1. Correctness, on random inputs (``--seed``, printed), float32 and bfloat16: a ragged mixed
   batch (decodes, short and long prefills with and without a cached prefix, sequences ending
   exactly on a page boundary, one with no new tokens, padding tokens) for ``pallas_ragged``, and
   a decode batch for ``pallas_decode`` (and ``jax_paged``, bfloat16 only, for information),
   against the reference computed in float32 from the same (bf16-rounded) values. Reported:
   ||out - ref|| / ||ref|| over the real tokens; must be <= 1e-5 (float32) or 2e-2 (bfloat16).
2. Timings in bfloat16: a decode batch (every sequence at the same context) with all four
   implementations, and a ragged mixed batch (prefill chunks after a cached prefix plus decodes)
   with ``pallas_ragged`` and ``xla``. Each implementation is jitted and compiled ahead (compile
   time reported), run twice, then timed: one sample = ``--inner`` back-to-back calls, blocked on
   all their outputs, divided by ``--inner`` (so Python dispatch overlaps the device work); the
   median of up to ``--reps`` samples within ``--budget-s`` seconds (at least 3).
   Bytes = the useful traffic: each sequence's kv_len x kv_heads x head_dim x 2 (K and V) x
   itemsize, plus q read and the output written (the same for every implementation, whatever it
   really moves). Achieved bytes/s is compared with the copy bandwidth measured in the same run
   (:func:`minijax_serve.executor.ceilings.copy_bandwidth`: bytes read + bytes written per second),
   the same read + write convention. Attention FLOP/s counts 4 x num_heads x head_dim per
   (query, visible key) pair.

Sizes. Default: the qwen3-0.6b attention shape (16 q heads, 8 kv heads, head_dim 128, page size
16, Pallas tiles 64 x 64); decode batch 64 at contexts 2048 and 4096; mixed = 4 prefill chunks
of 1024 tokens after 1024 cached + 64 decodes at 2048. ``--tiny``: 4 q heads, 2 kv heads,
head_dim 32, page size 8, tiles 16 x 16, decode batch 8 at 128, mixed 2 x (32 after 32) + 8
decodes at 64 (~30-60 s on a 2-core CPU). Timed in the order: decode at the first context,
mixed, decode at the others (a run cut short has both kinds). On CPU the Pallas kernels run with
``interpret=True``.
``--sweep``: then time the Pallas kernels' tile sizes (decode: ``block_kv`` x ``num_splits``;
ragged: ``block_q`` x ``block_kv``), for a GPU session choosing the defaults.
``--lower-only``: lower every call of a run for CUDA with ``interpret=False`` (Pallas -> Triton
IR; needs no GPU, runs nothing; Triton's own compile to PTX happens only on a GPU).

Prints the rows as they finish and a table at the end; ``--output-json`` gets one JSON object
appended, rewritten after every row (a run cut short keeps what it measured). Exit status 1 if a
required check fails or a Pallas/XLA row errors (JAX's kernel is information only).

    PYTHONPATH=. python benchmarks/bench_kernels.py --tiny --output-json /tmp/kernels.json
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from minijax_serve.executor import ceilings
from pallas_kernels.paged_decode_attention import paged_decode_attention
from pallas_kernels.ragged_paged_attention import ragged_paged_attention
from pallas_kernels.reference import ragged_paged_attention_ref

Args = dict[str, Any]  # the arrays of one batch (or their ShapeDtypeStructs)
T0 = time.perf_counter()  # the rows' done_at_s count from here (import time)
THRESHOLD = {"float32": 1e-5, "bfloat16": 2e-2}
# (implementation, dtype) checked; the reference runs in float32 only; JAX's kernel is timed in
# bfloat16 only, and its float32 path is no concern here (it may use TF32 on GPUs)
CHECKS = {("pallas_ragged", "float32"), ("pallas_ragged", "bfloat16"),
          ("pallas_decode", "float32"), ("pallas_decode", "bfloat16"), ("jax_paged", "bfloat16"),
          ("xla", "float32")}
BANDWIDTH_CONVENTION = ("bytes/s = (bytes read + bytes written) / s for the kernels (K/V and q "
                        "read, output written) and for the copy (ceilings.copy_bandwidth)")


@dataclasses.dataclass(frozen=True)
class Shape:
    """Attention shape and the Pallas kernels' tile sizes."""
    num_heads: int
    kv_heads: int
    head_dim: int
    page_size: int
    block_q: int = 64
    block_kv: int = 64


@dataclasses.dataclass(frozen=True)
class Sizes:
    shape: Shape
    ragged_check: list[tuple[int, int]]  # (new tokens, kv_len) per sequence
    decode_check: list[int]  # kv_len per sequence
    decode_batch: int
    decode_contexts: tuple[int, ...]
    mixed: list[tuple[int, int]]
    pad_tokens: int = 3


def full_sizes() -> Sizes:
    ps = 16
    return Sizes(
        Shape(16, 8, 128, ps),
        # decodes (one on a page boundary), short and long prefills with and without a cached
        # prefix, a prefill ending on a page boundary, a sequence with no new tokens
        [(1, 37), (1, 100), (1, 4 * ps), (5, 5), (7, 40), (150, 220), (130, 130),
         (2 * ps, 5 * ps), (0, 20)],
        [1, 17, 2 * ps, 100, 255, 256, 64 * ps, 700, 1000, 5, 31, 33, 48, 513, 129, 3],
        64, (2048, 4096), [(1024, 2048)] * 4 + [(1, 2048)] * 64)


def tiny_sizes() -> Sizes:
    ps = 8
    return Sizes(
        Shape(4, 2, 32, ps, block_q=16, block_kv=16),
        [(1, 9), (1, 2 * ps), (3, 3), (5, 13), (20, 37), (17, 17), (ps, 3 * ps), (0, 6)],
        [1, 9, 2 * ps, 40, 5, 6 * ps, 23, 33],
        8, (128,), [(32, 64)] * 2 + [(1, 64)] * 8)


@dataclasses.dataclass
class Layout:
    """Host-side metadata of a ragged batch; pages are shuffled so no sequence is contiguous."""
    q_lens: np.ndarray
    kv_lens: np.ndarray
    page_table: np.ndarray  # [S, W], unused entries 0
    cu_q_lens: np.ndarray
    seq_ids: np.ndarray  # [T]; padding tokens: the last sequence, as the engine does
    positions: np.ndarray  # [T]; padding tokens: 0
    num_pages: int
    num_real: int  # tokens before the padding

    @property
    def num_tokens(self) -> int:
        return len(self.seq_ids)


def make_layout(seqs: list[tuple[int, int]], page_size: int, pad_tokens: int,
                rng: np.random.Generator) -> Layout:
    q_lens = np.array([q for q, _ in seqs], np.int32)
    kv_lens = np.array([kv for _, kv in seqs], np.int32)
    pages = -(-kv_lens // page_size)
    width = max(1, int(pages.max()))
    num_pages = int(pages.sum()) + 1
    perm = rng.permutation(num_pages).astype(np.int32)
    table = np.zeros((len(seqs), width), np.int32)
    for i, (start, n) in enumerate(zip(np.cumsum(pages) - pages, pages)):
        table[i, :n] = perm[start:start + n]
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    seq_ids = np.concatenate([np.repeat(np.arange(len(seqs)), q_lens),
                              np.full(pad_tokens, len(seqs) - 1)]).astype(np.int32)
    positions = np.concatenate([np.arange(kv - q, kv) for q, kv in seqs]
                               + [np.zeros(pad_tokens)]).astype(np.int32)
    return Layout(q_lens, kv_lens, table, cu, seq_ids, positions, num_pages, int(cu[-1]))


def abstract_args(lay: Layout, shape: Shape, dtype: Any) -> Args:
    """ShapeDtypeStructs of :func:`make_args` (to lower without allocating)."""
    t, s = lay.num_tokens, len(lay.kv_lens)
    pool = (1, shape.kv_heads, lay.num_pages, shape.page_size, shape.head_dim)
    sds = jax.ShapeDtypeStruct
    return {"q": sds((t, shape.num_heads, shape.head_dim), dtype),
            "q_scaled": sds((t, shape.num_heads, shape.head_dim), dtype),
            "k_pool": sds(pool, dtype), "v_pool": sds(pool, dtype),
            "k_new": sds((t, shape.kv_heads, shape.head_dim), dtype),
            "v_new": sds((t, shape.kv_heads, shape.head_dim), dtype),
            "page_table": sds(lay.page_table.shape, jnp.int32),
            "cu_q_lens": sds((s + 1,), jnp.int32), "kv_lens": sds((s,), jnp.int32),
            "seq_ids": sds((t,), jnp.int32), "positions": sds((t,), jnp.int32)}


def make_args(lay: Layout, shape: Shape, dtype: Any, rng: np.random.Generator) -> Args:
    """Random q and pools on the device (seeded from ``rng``); k_new/v_new = the new tokens'
    entries of the pools."""
    spec = abstract_args(lay, shape, dtype)
    page = lay.page_table[lay.seq_ids, lay.positions // shape.page_size]
    real = np.arange(lay.num_tokens) < lay.num_real
    args = _random_arrays(int(rng.integers(2**31)), page, lay.positions % shape.page_size, real,
                          spec["q"].shape, spec["k_pool"].shape, jnp.dtype(dtype))
    i32 = functools.partial(jnp.asarray, dtype=jnp.int32)
    return {**args, "page_table": i32(lay.page_table), "cu_q_lens": i32(lay.cu_q_lens),
            "kv_lens": i32(lay.kv_lens), "seq_ids": i32(lay.seq_ids),
            "positions": i32(lay.positions)}


@functools.partial(jax.jit, static_argnums=(4, 5, 6))
def _random_arrays(seed: jax.Array, page: jax.Array, off: jax.Array, real: jax.Array,
                   q_shape: tuple[int, ...], pool_shape: tuple[int, ...], dtype: Any) -> Args:
    """make_args's float arrays in one compiled program; the "rbg" PRNG compiles much faster
    than the default threefry on CPU."""
    kq, kk, kv = jax.random.split(jax.random.key(seed, impl="rbg"), 3)
    q = jax.random.normal(kq, q_shape, dtype)
    k_pool = jax.random.normal(kk, pool_shape, dtype)
    v_pool = jax.random.normal(kv, pool_shape, dtype)

    def new(pool: jax.Array) -> jax.Array:  # [T, kv_heads, D]; padding tokens: zeros
        return jnp.where(real[:, None, None], pool[0][:, page, off].swapaxes(0, 1), 0)

    q_scaled = (q.astype(jnp.float32) / math.sqrt(q_shape[-1])).astype(dtype)
    return {"q": q, "q_scaled": q_scaled, "k_pool": k_pool, "v_pool": v_pool,
            "k_new": new(k_pool), "v_new": new(v_pool)}


def jax_paged_splits(width: int) -> tuple[int, int]:
    """(k_splits, pages_per_compute_block) JAX's kernel accepts for this table width."""
    k_splits = math.gcd(width, 16)
    return k_splits, math.gcd(width // k_splits, 8)


def implementations(shape: Shape, interpret: bool) -> dict[str, Callable[[Args], jax.Array]]:
    scale = 1.0 / math.sqrt(shape.head_dim)
    blocks = {"block_kv": shape.block_kv, "interpret": interpret}

    def pallas_decode(a: Args) -> jax.Array:
        return paged_decode_attention(a["q"], a["k_pool"], a["v_pool"], 0, a["page_table"],
                                      a["kv_lens"], scale=scale, **blocks)

    def pallas_ragged(a: Args) -> jax.Array:
        return ragged_paged_attention(a["q"], a["k_pool"], a["v_pool"], 0, a["page_table"],
                                      a["cu_q_lens"], a["kv_lens"], scale=scale,
                                      block_q=shape.block_q, **blocks)

    def jax_paged(a: Args) -> jax.Array:
        from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention
        k_splits, ppcb = jax_paged_splits(a["page_table"].shape[1])
        return paged_attention(a["q_scaled"], a["k_pool"][0], a["v_pool"][0], a["page_table"],
                               a["kv_lens"], k_splits=k_splits, pages_per_compute_block=ppcb,
                               interpret=interpret)

    def xla(a: Args) -> jax.Array:
        return ragged_paged_attention_ref(
            a["q"], a["k_new"], a["v_new"], a["k_pool"], a["v_pool"], 0, a["page_table"],
            a["cu_q_lens"], a["seq_ids"], a["positions"], a["kv_lens"], scale)

    return {"pallas_decode": pallas_decode, "pallas_ragged": pallas_ragged,
            "jax_paged": jax_paged, "xla": xla}


def traffic(lay: Layout, shape: Shape, itemsize: int) -> tuple[int, float]:
    """(useful bytes read + written, attention FLOPs) of one call (module docstring)."""
    kv = int(lay.kv_lens.sum()) * shape.kv_heads * shape.head_dim * 2 * itemsize
    qo = 2 * lay.num_real * shape.num_heads * shape.head_dim * itemsize
    keys = sum(q * kv - q * (q - 1) // 2  # token i of q sees kv - q + i + 1 keys
               for q, kv in zip(lay.q_lens.tolist(), lay.kv_lens.tolist()))
    return kv + qo, 4.0 * shape.num_heads * shape.head_dim * keys


def rel_err(out: jax.Array, ref: jax.Array, rows: int) -> float:
    o = np.asarray(out[:rows], np.float64)
    r = np.asarray(ref[:rows], np.float64)
    return float(np.linalg.norm(o - r) / np.linalg.norm(r))


def time_call(fn: Callable[[Args], jax.Array], args: Args, reps: int, inner: int,
              budget_s: float) -> dict[str, Any]:
    """Compile ahead, warm up twice, then the median of up to ``reps`` samples (module doc)."""
    t0 = time.perf_counter()
    compiled = jax.jit(fn).lower(args).compile()
    compile_s = time.perf_counter() - t0
    for _ in range(2):
        jax.block_until_ready(compiled(args))
    samples: list[float] = []
    start = time.perf_counter()
    while len(samples) < reps and (len(samples) < 3 or time.perf_counter() - start < budget_s):
        t = time.perf_counter()
        jax.block_until_ready([compiled(args) for _ in range(inner)])
        samples.append((time.perf_counter() - t) / inner)
    return {"median_s": float(np.median(samples)), "min_s": min(samples),
            "samples": len(samples), "inner": inner, "compile_s": compile_s}


class Report:
    """The run's JSON object, rewritten after every case as the last line of ``path``."""

    def __init__(self, path: str | None, obj: dict[str, Any]):
        self.path, self.obj = (Path(path) if path else None), obj
        self.before = self.path.read_text() if self.path and self.path.is_file() else ""
        if self.before and not self.before.endswith("\n"):
            self.before += "\n"

    def save(self) -> None:  # write then rename: a run killed mid-write leaves the last save
        if self.path:
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_text(self.before + json.dumps(self.obj, default=str) + "\n")
            os.replace(tmp, self.path)


def run_case(report: Report, key: str, row: dict[str, Any], body: Callable[[], dict]) -> dict:
    """Run one case, catching its error, print it, add it to the report and save."""
    try:
        row.update(body())
    except Exception as e:  # noqa: BLE001 - one failing case must not stop the others
        row["error"] = f"{type(e).__name__}: {e}"
        traceback.print_exc()
    row["done_at_s"] = round(time.perf_counter() - T0, 2)
    report.obj[key].append(row)
    report.save()
    print(format_row(key, row), flush=True)
    return row


def format_row(key: str, r: dict[str, Any]) -> str:
    head = f"{r['case']:<16} {r['impl']:<14}"
    if "error" in r:
        return f"{head} ERROR{'' if r.get('required', True) else ' (info only)'} {r['error'][:200]}"
    if key == "correctness":
        verdict = "ok" if r["ok"] else ("FAIL" if r["required"] else "above (info only)")
        return (f"{head} {r['dtype']:<9} rel err {r['rel_err']:.2e} "
                f"(<= {r['threshold']:.0e}) {verdict}")
    if key == "lowered":
        return (f"{head} {r['dtype']:<9} lowered for cuda: {r['triton_calls']} Triton call(s), "
                f"{r['chars']} chars of StableHLO")
    return (f"{head} {r['median_s'] * 1e3:9.3f} ms {r['bytes_per_s'] / 1e9:9.1f} GB/s "
            f"{r['fraction_of_copy'] * 100:6.1f} % {r['flops_per_s'] / 1e12:8.3f} TFLOP/s  "
            f"compile {r['compile_s']:5.1f} s, {r['samples']}x{r['inner']} calls")


def check_cases(sizes: Sizes, rng: np.random.Generator) -> list[tuple[str, Layout, list[str]]]:
    """(name, layout, implementations checked against the reference) of the correctness cases."""
    ps = sizes.shape.page_size
    return [("ragged_mixed", make_layout(sizes.ragged_check, ps, sizes.pad_tokens, rng),
             ["pallas_ragged"]),
            ("decode", make_layout([(1, n) for n in sizes.decode_check], ps, 0, rng),
             ["pallas_decode", "jax_paged"])]


def timing_cases(sizes: Sizes) -> list[tuple[str, list[tuple[int, int]], list[str]]]:
    """(name, (new tokens, kv_len) per sequence, implementations timed) of the timed cases."""
    decode = [(f"decode_b{sizes.decode_batch}_{ctx}", [(1, ctx)] * sizes.decode_batch,
               ["pallas_decode", "pallas_ragged", "jax_paged", "xla"])
              for ctx in sizes.decode_contexts]
    return decode[:1] + [("mixed", sizes.mixed, ["pallas_ragged", "xla"])] + decode[1:]


@functools.partial(jax.jit, static_argnums=1)
def cast(args: Args, dtype: Any) -> Args:
    """The float arrays of ``args`` in ``dtype``."""
    return jax.tree.map(
        lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, args)


def correctness(report: Report, sizes: Sizes, rng: np.random.Generator,
                impls: dict[str, Callable], ok_impls: set[str]) -> None:
    for case, lay, names in check_cases(sizes, rng):
        # inputs are made lazily (functools.cache), so that an error lands in the rows
        base = functools.cache(functools.partial(make_args, lay, sizes.shape, jnp.float32, rng))
        for dtype in ("float32", "bfloat16"):
            @functools.cache
            def inputs(dtype: str = dtype, base: Callable[[], Args] = base) -> tuple[Args, Any]:
                args = cast(base(), jnp.dtype(dtype))
                return args, jax.jit(impls["xla"])(cast(args, jnp.float32))  # ref: rounded values

            for name in (n for n in names if n in ok_impls and (n, dtype) in CHECKS):
                row = {"case": case, "impl": name, "dtype": dtype, "threshold": THRESHOLD[dtype],
                       "required": name != "jax_paged",
                       "seqs": [[int(q), int(k)] for q, k in zip(lay.q_lens, lay.kv_lens)]}

                def check(name=name, inputs=inputs, lay=lay) -> dict:
                    args, ref = inputs()
                    err = rel_err(jax.jit(impls[name])(args), ref, lay.num_real)
                    return {"rel_err": err, "ok": err <= THRESHOLD[dtype]}
                run_case(report, "correctness", row, check)


def timings(report: Report, sizes: Sizes, rng: np.random.Generator,
            impls: dict[str, Callable], ok_impls: set[str], copy_bw: float,
            opts: argparse.Namespace) -> None:
    shape, dtype = sizes.shape, jnp.bfloat16
    for case, seqs, names in timing_cases(sizes):
        lay = make_layout(seqs, shape.page_size, 0, rng)
        args = functools.cache(functools.partial(make_args, lay, shape, dtype, rng))  # lazily
        nbytes, flops = traffic(lay, shape, jnp.dtype(dtype).itemsize)
        for name in (n for n in names if n in ok_impls):
            row = {"case": case, "impl": name, "required": name != "jax_paged",
                   "dtype": "bfloat16", "num_seqs": len(seqs),
                   "num_tokens": lay.num_tokens, "kv_tokens": int(lay.kv_lens.sum()),
                   "bytes": nbytes, "flops": flops}

            def measure(name=name, args=args) -> dict:
                r = time_call(impls[name], args(), opts.reps, opts.inner, opts.budget_s)
                bps = nbytes / r["median_s"]
                return {**r, "bytes_per_s": bps, "fraction_of_copy": bps / copy_bw,
                        "flops_per_s": flops / r["median_s"]}
            run_case(report, "timings", row, measure)
        args.cache_clear()  # free the pools before the next case


SWEEP_DECODE = [(block_kv, splits) for block_kv in (32, 64, 128) for splits in (None, 1, 4, 16)]
SWEEP_RAGGED = [(32, 32), (64, 32), (64, 64), (128, 64), (64, 128)]  # (block_q, block_kv)


def sweep(report: Report, sizes: Sizes, rng: np.random.Generator, copy_bw: float,
          opts: argparse.Namespace, interpret: bool) -> None:
    """Tile sizes of the Pallas kernels (``--sweep``): the decode kernel's ``block_kv`` x
    ``num_splits`` on the first decode case, the ragged kernel's (``block_q``, ``block_kv``) on
    the mixed case; bf16, timed as in :func:`timings`."""
    shape, dtype = sizes.shape, jnp.bfloat16
    scale = 1.0 / math.sqrt(shape.head_dim)
    decode_case, mixed_case = timing_cases(sizes)[0], timing_cases(sizes)[1]
    variants = [(decode_case, f"pallas_decode[kv={kv},splits={sp}]",
                 functools.partial(paged_decode_attention, scale=scale, block_kv=kv,
                                   num_splits=sp, interpret=interpret),
                 ("q", "k_pool", "v_pool", 0, "page_table", "kv_lens"))
                for kv, sp in SWEEP_DECODE]
    variants += [(mixed_case, f"pallas_ragged[q={bq},kv={kv}]",
                  functools.partial(ragged_paged_attention, scale=scale, block_q=bq,
                                    block_kv=kv, interpret=interpret),
                  ("q", "k_pool", "v_pool", 0, "page_table", "cu_q_lens", "kv_lens"))
                 for bq, kv in SWEEP_RAGGED]
    for case, seqs, _ in (decode_case, mixed_case):
        lay = make_layout(seqs, shape.page_size, 0, rng)
        args = make_args(lay, shape, dtype, rng)
        nbytes, flops = traffic(lay, shape, jnp.dtype(dtype).itemsize)
        for _, name, kernel, names in (v for v in variants if v[0][0] == case):
            def call(a: Args, kernel=kernel, names=names) -> jax.Array:
                return kernel(*(a[n] if isinstance(n, str) else n for n in names))

            def measure(call=call) -> dict:
                r = time_call(call, args, opts.reps, opts.inner, opts.budget_s)
                bps = nbytes / r["median_s"]
                return {**r, "bytes_per_s": bps, "fraction_of_copy": bps / copy_bw,
                        "flops_per_s": flops / r["median_s"]}
            row = {"case": case, "impl": name, "required": False, "dtype": "bfloat16",
                   "bytes": nbytes, "flops": flops}
            run_case(report, "sweep", row, measure)
        del args


def lower_only(report: Report, sizes: Sizes, rng: np.random.Generator) -> None:
    """Lower every call of a run (correctness in float32 and bfloat16, timings in bfloat16) for
    CUDA with interpret=False: Pallas -> Triton IR, no GPU needed, nothing runs."""
    impls = implementations(sizes.shape, interpret=False)
    calls = [(case, lay, [n for n in names + ["xla"] if (n, dtype) in CHECKS], dtype)
             for case, lay, names in check_cases(sizes, rng) for dtype in ("float32", "bfloat16")]
    calls += [(case, make_layout(seqs, sizes.shape.page_size, 0, rng), names, "bfloat16")
              for case, seqs, names in timing_cases(sizes)]
    for case, lay, names, dtype in calls:
        args = abstract_args(lay, sizes.shape, jnp.dtype(dtype))
        for name in names:
            def lower(name=name) -> dict:
                text = jax.jit(impls[name]).trace(args).lower(
                    lowering_platforms=("cuda",)).as_text()
                return {"triton_calls": text.count("__gpu$xla.gpu.triton"), "chars": len(text)}
            run_case(report, "lowered", {"case": case, "impl": name, "dtype": dtype}, lower)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="tiny shapes (~30-60 s on a 2-core CPU)")
    p.add_argument("--lower-only", action="store_true",
                   help="only lower every call of a run for CUDA, interpret=False (no GPU "
                        "needed; nothing runs)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--reps", type=int, default=50, help="timed samples at most (default 50)")
    p.add_argument("--inner", type=int, default=None,
                   help="back-to-back calls per sample (default 5 on accelerators, 1 on CPU)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="seconds of timed samples per implementation and case, after its "
                        "compile and warm-up (default 2 on accelerators, 1 on CPU)")
    p.add_argument("--copy-mib", type=int, default=None,
                   help="size of the copy-bandwidth probe (default 2048 MiB on accelerators, "
                        "256 on CPU, 32 with --tiny)")
    p.add_argument("--skip-correctness", action="store_true")
    p.add_argument("--sweep", action="store_true",
                   help="after the timings, time the Pallas kernels' tile sizes (SWEEP_DECODE, "
                        "SWEEP_RAGGED) on the first decode case and the mixed case")
    p.add_argument("--output-json", default=None, help="append one JSON object to this file")
    opts = p.parse_args(argv)

    cpu = jax.default_backend() == "cpu"
    interpret = cpu and not opts.lower_only
    opts.inner = opts.inner or (1 if cpu else 5)
    opts.budget_s = opts.budget_s if opts.budget_s is not None else (1.0 if cpu else 2.0)
    sizes = tiny_sizes() if opts.tiny else full_sizes()
    rng = np.random.default_rng(opts.seed)  # every layout and array comes from it
    dev = jax.devices()[0]
    print(f"bench_kernels: seed {opts.seed}, jax {jax.__version__}, {jax.default_backend()} "
          f"({dev.device_kind}), interpret={interpret}, {'tiny' if opts.tiny else 'full'} sizes: "
          f"{sizes.shape}", flush=True)
    if interpret and not opts.tiny:
        print("note: full sizes in Pallas's interpreter are slow; --tiny or --lower-only on CPU",
              flush=True)
    report = Report(opts.output_json, {
        "kind": "bench_kernels", "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "seed": opts.seed,
        "tiny": opts.tiny, "jax_version": jax.__version__, "backend": jax.default_backend(),
        "device_kind": dev.device_kind, "interpret": interpret,
        "shape": dataclasses.asdict(sizes.shape), "complete": False})

    if opts.lower_only:
        report.obj["lowered"] = []
        lower_only(report, sizes, rng)
        failed = [r for r in report.obj["lowered"]
                  if "error" in r or (r["impl"] != "xla" and not r["triton_calls"])]
    else:
        impls = implementations(sizes.shape, interpret)
        ok_impls = set(impls)
        copy_mib = opts.copy_mib or (32 if opts.tiny else ceilings.default_copy_mib())
        copy_bw = ceilings.copy_bandwidth(copy_mib)
        report.obj.update({"copy_mib": copy_mib, "copy_bytes_per_s": copy_bw,
                           "bandwidth_convention": BANDWIDTH_CONVENTION,
                           "correctness": [], "timings": []})
        report.save()
        print(f"copy bandwidth {copy_bw / 1e9:.1f} GB/s ({copy_mib} MiB; read + written)\n"
              f"{BANDWIDTH_CONVENTION}", flush=True)
        if not opts.skip_correctness:
            print("-- correctness (vs the float32 reference)", flush=True)
            correctness(report, sizes, rng, impls, ok_impls)
            if any("error" in r for r in report.obj["correctness"] if r["impl"] == "jax_paged"):
                ok_impls.discard("jax_paged")  # it does not run here: not timed, not a failure
                print("jax_paged: not timed (it failed to run above)", flush=True)
        print("-- timings (bfloat16; median per call, useful bytes/s, % of copy bandwidth, "
              "attention TFLOP/s)", flush=True)
        timings(report, sizes, rng, impls, ok_impls, copy_bw, opts)
        if opts.sweep:
            report.obj["sweep"] = []
            print("-- tile sizes (bfloat16; information only)", flush=True)
            sweep(report, sizes, rng, copy_bw, opts, interpret)
        failed = [r for r in report.obj["correctness"] + report.obj["timings"]
                  if r["required"] and ("error" in r or not r.get("ok", True))]
    report.obj["complete"] = True
    report.obj["elapsed_s"] = round(time.perf_counter() - T0, 1)
    report.save()

    headers = {"lowered": "lowered for CUDA (interpret=False)",
               "correctness": "||out - ref|| / ||ref||, ref = the jnp reference in float32",
               "timings": "bf16, median per call | useful bytes/s | % of the copy bandwidth "
                          "(both read + write) | attention FLOP/s",
               "sweep": "tile sizes of the Pallas kernels, bf16, same columns"}
    print("=" * 100)
    if "copy_bytes_per_s" in report.obj:
        print(f"copy bandwidth {report.obj['copy_bytes_per_s'] / 1e9:.1f} GB/s "
              f"(read + written, {report.obj['copy_mib']} MiB); seed {opts.seed}")
    for k in ("lowered", "correctness", "timings", "sweep"):
        if report.obj.get(k):
            print(f"-- {headers[k]}")
        for r in report.obj.get(k, []):
            print(format_row(k, r))
    print("=" * 100)
    print(f"{len(failed)} failed" if failed else "all ok",
          f"({time.perf_counter() - T0:.0f} s)", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
