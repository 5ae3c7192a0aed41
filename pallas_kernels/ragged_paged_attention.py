"""Ragged paged attention in Pallas: any mix of decode tokens and prefill chunks in one kernel.

The batch is the engine's ragged layout (``minijax_serve/executor/forward_batch.py``): the new tokens of all sequences flattened
on one axis with offsets ``cu_q_lens``; every sequence's keys and values, **including this step's
new tokens**, are already in the paged pools (the model writes them first), so the kernel reads
keys only from pages.

Work split: each sequence's new tokens are cut into blocks of about ``block_q`` query rows
(``block_q // group`` tokens, the group padded); one program takes one such block and one KV
head, so the GQA group's query heads share every key and value block it loads (``block_q`` rows
per matmul). It walks the sequence's pages in blocks of
``block_kv`` tokens up to its last query's position (causal), folding them in with an online
softmax; only the blocks along the diagonal are masked (FlashAttention's split of the loop).
A small table, built outside the kernel, says which sequence and rows each program owns;
the tokens past ``cu_q_lens[-1]`` (padding) form one more pseudo-sequence with no keys, so every
output row is written (zeros for padding).

Why portable Pallas (``pl.pallas_call`` with plain ref indexing, ``jax.lax.dot_general``, the
Triton backend's masked store): it lowers through Triton on NVIDIA GPUs of every generation and
runs unchanged with ``interpret=True`` on CPU, where the tests check it. A Mosaic GPU variant
(Hopper and newer) would be a second implementation, worth adding only when measured faster.

Triton needs power-of-two tile shapes: the head dim and page size must be powers of two; the GQA
group is padded up to one. Float32 matmuls run at full precision (no TF32).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

HIGHEST = jax.lax.Precision.HIGHEST
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)  # finite: a masked row never makes NaN
MIN_DOT = 16  # Triton's smallest matmul side


def next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def check_shapes(num_heads: int, kv_heads: int, head_dim: int, page_size: int = 1) -> None:
    """Raise ValueError for shapes the kernels do not support."""
    if num_heads % kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of kv_heads ({kv_heads})")
    if head_dim < MIN_DOT or head_dim != next_pow2(head_dim):
        raise ValueError(f"the Pallas kernels need head_dim to be a power of two >= {MIN_DOT}, "
                         f"got {head_dim}")
    if page_size != next_pow2(page_size):
        raise ValueError(f"the Pallas kernels need page_size to be a power of two, got {page_size}")


def check_blocks(**blocks: int) -> None:
    """Tile sizes must be powers of two (Triton's tensors are)."""
    for name, n in blocks.items():
        if n < 1 or n != next_pow2(n):
            raise ValueError(f"{name} must be a power of two, got {n}")


def pool_shapes(q: jax.Array, k_pool: jax.Array) -> tuple[int, int]:
    """Check q [T, num_heads, D] against the pools; returns (group, group padded to a power of 2)."""
    _, num_heads, head_dim = q.shape
    _, kv_heads, _, page_size, pool_dim = k_pool.shape
    if pool_dim != head_dim:
        raise ValueError(f"head_dim of q ({head_dim}) and the pools ({pool_dim}) differ")
    check_shapes(num_heads, kv_heads, head_dim, page_size)
    group = num_heads // kv_heads
    return group, next_pow2(group)


def mm(a: jax.Array, b: jax.Array, contract_b: int) -> jax.Array:
    """a [M, K] times b (contracting b's axis ``contract_b``), accumulated in float32; float32
    inputs at full precision (Triton would use TF32)."""
    precision = HIGHEST if a.dtype == jnp.float32 else None
    return jax.lax.dot_general(a, b, (((1,), (contract_b,)), ((), ())), precision=precision,
                               preferred_element_type=jnp.float32)


def online_softmax_step(carry, s: jax.Array, v: jax.Array):
    """Fold scores ``s`` [M, BK] (masked entries = MASK_VALUE) and values v [BK, D] into
    (running max, denominator, numerator)."""
    m, l, acc = carry
    m_new = jnp.maximum(m, s.max(axis=1))
    corr = jnp.exp(m - m_new)
    p = jnp.exp(s - m_new[:, None])
    return m_new, l * corr + p.sum(axis=1), acc * corr[:, None] + mm(p.astype(v.dtype), v, 0)


def kv_scales(scales: jax.Array | None, dtype) -> tuple[tuple[jax.Array, ...], bool]:
    """The kernels' extra input for FP8 pools: K and V scales stacked, [2, kv_heads] float32
    (``scales``: (k_scale, v_scale), or None for pools of plain values); and whether there is
    one."""
    if scales is None or scales[0] is None:
        return (), False
    return (jnp.stack(scales).astype(jnp.float32),), True


def head_scales(refs, h, quantized: bool):
    """(the K scale, the V scale, the output ref) of KV head ``h`` from a kernel's trailing
    refs: (scales, out) for FP8 pools, (out,) otherwise (scales 1)."""
    if not quantized:
        return 1.0, 1.0, refs[0]
    scales_ref, o_ref = refs[0], refs[1]
    return scales_ref[0, h], scales_ref[1, h], o_ref


def load_kv(ref, layer, h, pages, block_kv: int, dtype) -> jax.Array:
    """A block of ``block_kv`` keys or values [block_kv, D] of KV head ``h`` from its pages, in
    the queries' ``dtype`` (an FP8 pool's values converted where they are loaded)."""
    return ref[layer, h, pages, :, :].reshape(block_kv, ref.shape[4]).astype(dtype)


def _kernel(meta_ref, table_ref, layer_ref, q_ref, k_ref, v_ref, *refs, scale: float,
            block_q: int, group: int, pages_per_block: int, quantized: bool):
    b, h = pl.program_id(0), pl.program_id(1)
    k_scale, v_scale, o_ref = head_scales(refs, h, quantized)
    seq, row0, num_rows = meta_ref[b, 0], meta_ref[b, 1], meta_ref[b, 2]
    first_pos, kv_end = meta_ref[b, 3], meta_ref[b, 4]
    layer = layer_ref[0]
    page_size, d = k_ref.shape[3], k_ref.shape[4]
    block_kv = pages_per_block * page_size
    rows = block_q * group

    @pl.when(num_rows > 0)
    def _():
        q = q_ref[pl.ds(row0, block_q), h, :, :].reshape(rows, d)
        row_pos = first_pos + jax.lax.broadcasted_iota(jnp.int32, (rows, block_kv), 0) // group

        def kv_block(j, carry, causal: bool):
            pages = table_ref[seq, pl.ds(j * pages_per_block, pages_per_block)]
            k = load_kv(k_ref, layer, h, pages, block_kv, q.dtype)
            v = load_kv(v_ref, layer, h, pages, block_kv, q.dtype)
            s = mm(q, k, 1) * (scale * k_scale)
            if causal:
                key_pos = j * block_kv + jax.lax.broadcasted_iota(jnp.int32, (rows, block_kv), 1)
                s = jnp.where(key_pos <= row_pos, s, MASK_VALUE)
            return online_softmax_step(carry, s, v)

        init = (jnp.full((rows,), MASK_VALUE, jnp.float32), jnp.zeros((rows,), jnp.float32),
                jnp.zeros((rows, d), jnp.float32))
        # the blocks every row sees whole (their last key at or before the first row's
        # position) need no mask; only the rest, along the diagonal, are masked
        num_blocks = pl.cdiv(kv_end, block_kv)
        visible = jnp.clip((first_pos + 1) // block_kv, 0, num_blocks)
        carry = jax.lax.fori_loop(0, visible, functools.partial(kv_block, causal=False), init)
        _, l, acc = jax.lax.fori_loop(visible, num_blocks,
                                      functools.partial(kv_block, causal=True), carry)
        out = acc / jnp.where(l > 0, l, 1.0)[:, None]
        out = (out * v_scale if quantized else out).reshape(block_q, group, d)
        row_ok = jax.lax.broadcasted_iota(jnp.int32, (block_q, group, d), 0) < num_rows
        plgpu.store(o_ref.at[pl.ds(row0, block_q), h, :, :], out.astype(o_ref.dtype), mask=row_ok)


def block_table(cu_q_lens: jax.Array, kv_lens: jax.Array, num_tokens: int,
                block_q: int) -> jax.Array:
    """[num_blocks, 5] int32 rows (sequence, first row, rows, first row's position, keys to read)
    for the programs; the padding tokens are one more sequence with no keys, and programs past
    the last block get 0 rows."""
    s = kv_lens.shape[0]
    starts = cu_q_lens.astype(jnp.int32)
    lens = jnp.append(starts[1:] - starts[:-1], num_tokens - starts[-1])
    kv = jnp.append(kv_lens.astype(jnp.int32), 0)
    blocks = -(-lens // block_q)
    first_block = jnp.cumsum(blocks) - blocks
    num_blocks = -(-num_tokens // block_q) + s + 1
    b = jnp.arange(num_blocks, dtype=jnp.int32)
    seq = jnp.clip(jnp.searchsorted(first_block, b, side="right") - 1, 0, s).astype(jnp.int32)
    local = b - first_block[seq]
    num_rows = jnp.where(local < blocks[seq], jnp.minimum(block_q, lens[seq] - local * block_q), 0)
    first_pos = kv[seq] - lens[seq] + local * block_q
    kv_end = jnp.clip(jnp.minimum(kv[seq], first_pos + num_rows), 0, None)
    return jnp.stack([seq, starts[seq] + local * block_q, num_rows, first_pos, kv_end], axis=1)


@functools.partial(jax.jit, static_argnames=("scale", "block_q", "block_kv", "num_warps",
                                             "num_stages", "interpret"))
def ragged_paged_attention(
    q: jax.Array,
    k_pool: jax.Array,
    v_pool: jax.Array,
    layer: jax.Array | int,
    page_table: jax.Array,
    cu_q_lens: jax.Array,
    kv_lens: jax.Array,
    *,
    scale: float,
    block_q: int = 64,
    block_kv: int = 64,
    num_warps: int = 4,
    num_stages: int = 2,
    interpret: bool = False,
    scales: tuple[jax.Array, jax.Array] | None = None,
) -> jax.Array:
    """Causal attention of a ragged batch of new tokens over their sequences' paged KV.

    Args:
      q: [T, num_heads, D] queries of the new tokens, sequences one after another.
      k_pool, v_pool: [layers, kv_heads, num_pages, page_size, D], already holding the keys and
        values of every position below ``kv_lens`` (the new tokens' included).
      layer: the layer of the pools to read (a traced scalar is fine).
      page_table: [S, W] page ids of each sequence.
      cu_q_lens: [S+1] offsets of each sequence's new tokens in q; tokens from ``cu_q_lens[-1]``
        on are padding and get zeros. A sequence may have no new tokens.
      kv_lens: [S] each sequence's KV length after this step; its new tokens are its last ones.
      scale: the softmax scale.
      block_q: query rows (tokens × padded group) per program, rounded to cover whole groups.
      block_kv: key tokens per inner step (at least one page).
      num_warps, num_stages: Triton's warps per program and software-pipelining depth of the
        KV loop.
      interpret: run the kernel in Pallas's interpreter (on CPU).
      scales: FP8 pools' (k_scale, v_scale), [kv_heads] float32 each (a stored key is
        k / k_scale): the scores are scaled by the K scale and the output by the V scale, the
        FP8 values converted to q's dtype as they are loaded. None: plain pools.
    Returns:
      [T, num_heads, D] in q's dtype.
    """
    t, num_heads, d = q.shape
    _, kv_heads, _, page_size, _ = k_pool.shape
    group, padded = pool_shapes(q, k_pool)
    check_blocks(block_q=block_q, block_kv=block_kv)
    bq = max(1, max(block_q, MIN_DOT) // padded)
    ppb = max(1, max(block_kv, MIN_DOT) // page_size)
    s, w = page_table.shape
    table = jnp.pad(page_table.astype(jnp.int32), ((0, 1), (0, -w % ppb)))
    meta = block_table(cu_q_lens, kv_lens, t, bq)
    qg = jnp.pad(q.reshape(t, kv_heads, group, d), ((0, bq), (0, 0), (0, padded - group), (0, 0)))
    extra, quantized = kv_scales(scales, q.dtype)
    out = pl.pallas_call(
        functools.partial(_kernel, scale=scale, block_q=bq, group=padded, pages_per_block=ppb,
                          quantized=quantized),
        grid=(meta.shape[0], kv_heads),
        out_shape=jax.ShapeDtypeStruct(qg.shape, q.dtype),
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name="ragged_paged_attention",
    )(meta, table, jnp.asarray(layer, jnp.int32).reshape(1), qg, k_pool, v_pool, *extra)
    return out[:t, :, :group].reshape(t, num_heads, d)
