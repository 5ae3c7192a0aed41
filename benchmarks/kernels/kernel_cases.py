"""The cases of ``bench_kernels.py``: attention shapes and batch sizes, random ragged batches on
the device, their useful traffic, and the timing loop (the implementations: kernel_impls.py)."""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

Args = dict[str, Any]  # the arrays of one batch (or their ShapeDtypeStructs)
THRESHOLD = {"float32": 1e-5, "bfloat16": 2e-2}
# (implementation, dtype) checked; the reference runs in float32 only; JAX's kernel is timed in
# bfloat16 only, and its float32 path is no concern here (it may use TF32 on GPUs)
CHECKS = {("pallas_ragged", "float32"), ("pallas_ragged", "bfloat16"),
          ("pallas_decode", "float32"), ("pallas_decode", "bfloat16"), ("jax_paged", "bfloat16"),
          ("mgpu_ragged", "bfloat16"), ("mgpu_ragged_ws", "bfloat16"), ("xla", "float32"),
          ("torch_sdpa", "bfloat16"), ("torch_flex", "bfloat16")}
PEERS = ("torch_sdpa", "torch_flex")  # torch's attention (torch_peer.py)
# information rows (an error or a miss does not fail the run): JAX's kernel, torch's, and the
# Mosaic GPU kernel with a loading warpgroup (warp_specialized), which no GPU has run yet
INFO_ONLY = {"jax_paged", "mgpu_ragged_ws", *PEERS}
# ours that no GPU has run yet: their rows come after every other, the peers' included
UNTRIED = ("mgpu_ragged_ws",)
# ours: the kernels the engine runs, or runs once the tuning table says so (the peers are
# compared with the fastest of them)
OURS = ("pallas_decode", "pallas_ragged", "mgpu_ragged", "mgpu_ragged_ws")


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
    prefill: list[tuple[int, int]]
    grid_batches: tuple[int, ...]  # --grid: decode batches x contexts
    grid_contexts: tuple[int, ...]
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
        64, (2048, 4096), [(1024, 2048)] * 4 + [(1, 2048)] * 64, [(1024, 2048)] * 4,
        (8, 16, 32, 64, 128, 256), (512, 1024, 2048, 4096, 8192))


def tiny_sizes() -> Sizes:
    ps = 8
    return Sizes(
        Shape(4, 2, 64, ps, block_q=16, block_kv=16),
        [(1, 9), (1, 2 * ps), (3, 3), (5, 13), (20, 37), (17, 17), (ps, 3 * ps), (0, 6)],
        [1, 9, 2 * ps, 40, 5, 6 * ps, 23, 33],
        8, (128,), [(32, 64)] * 2 + [(1, 64)] * 4, [(32, 64)] * 2, (2, 8), (32, 128))


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


def sample(calls: Callable[[], Any], inner: int, reps: int, budget_s: float,
           min_samples: int) -> dict[str, Any]:
    """The median of ``min_samples`` to ``reps`` samples within ``budget_s``, each one run of
    ``calls`` (``inner`` back-to-back calls, then waiting for them all) divided by ``inner``."""
    samples: list[float] = []
    start = time.perf_counter()
    while len(samples) < reps and (len(samples) < min_samples
                                   or time.perf_counter() - start < budget_s):
        t = time.perf_counter()
        calls()
        samples.append((time.perf_counter() - t) / inner)
    return {"median_s": float(np.median(samples)), "min_s": min(samples),
            "samples": len(samples), "inner": inner}


def time_call(fn: Callable[[Args], jax.Array], args: Args, reps: int, inner: int,
              budget_s: float, min_samples: int = 3, warmups: int = 2) -> dict[str, Any]:
    """Compile ahead, warm up, then :func:`sample` (module doc)."""
    t0 = time.perf_counter()
    compiled = jax.jit(fn).lower(args).compile()
    compile_s = time.perf_counter() - t0
    for _ in range(warmups):
        jax.block_until_ready(compiled(args))
    calls = lambda: jax.block_until_ready([compiled(args) for _ in range(inner)])  # noqa: E731
    return {**sample(calls, inner, reps, budget_s, min_samples), "compile_s": compile_s}


def check_cases(sizes: Sizes, rng: np.random.Generator) -> list[tuple[str, Layout, list[str]]]:
    """(name, layout, implementations checked against the reference) of the correctness cases."""
    ps = sizes.shape.page_size
    return [("ragged_mixed", make_layout(sizes.ragged_check, ps, sizes.pad_tokens, rng),
             ["pallas_ragged", "mgpu_ragged", "mgpu_ragged_ws"]),
            ("decode", make_layout([(1, n) for n in sizes.decode_check], ps, 0, rng),
             ["pallas_decode", "jax_paged", "torch_flex"]),
            ("prefill", make_layout(sizes.prefill, ps, 0, rng), ["torch_sdpa"])]


class Variant(NamedTuple):
    """One implementation timed on one case: (new tokens, kv_len) per sequence."""

    case: str
    seqs: list[tuple[int, int]]
    impl: str
    fn: Callable[[Args], jax.Array] | None  # None for torch's peers (torch_peer.py)
    required: bool = False  # an error fails the run


def timed_cases(sizes: Sizes) -> dict[str, list[tuple[int, int]]]:
    """The timed cases, in order: decode at the first context, mixed, prefill, decode at the
    others (a run cut short has every kind)."""
    decode = [(f"decode_b{sizes.decode_batch}_{ctx}", [(1, ctx)] * sizes.decode_batch)
              for ctx in sizes.decode_contexts]
    return dict(decode[:1] + [("mixed", sizes.mixed), ("prefill", sizes.prefill)] + decode[1:])


def timing_variants(sizes: Sizes, impls: dict[str, Callable], interpret: bool = False,
                    peers: tuple[str, ...] = ()) -> list[Variant]:
    """The decode implementations and both ragged kernels on the decode cases, the ragged ones
    on the others, and the reference on all (those of ``impls``); torch's ``peers`` where they
    take the batch (SDPA on the decode and prefill cases, FlexAttention on the decode ones).
    The Mosaic GPU kernel (a decode candidate too) is not timed in its interpreter, where a
    call takes seconds and says nothing about a GPU; the correctness check still runs it."""
    mgpu = () if interpret else ("mgpu_ragged",)
    variants = []
    for case, seqs in timed_cases(sizes).items():
        names = (("pallas_decode", "pallas_ragged", *mgpu, "jax_paged", "xla", "torch_sdpa",
                  "torch_flex") if case.startswith("decode")
                 else ("pallas_ragged", *mgpu, "mgpu_ragged_ws", "xla")
                 + (("torch_sdpa",) if case == "prefill" else ()))
        variants += [Variant(case, seqs, n, impls.get(n), n not in INFO_ONLY)
                     for n in names if n in impls or n in peers]
    return variants


@functools.partial(jax.jit, static_argnums=1)
def cast(args: Args, dtype: Any) -> Args:
    """The float arrays of ``args`` in ``dtype``."""
    return jax.tree.map(
        lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, args)
