"""Ragged paged attention for Hopper, in Pallas's Mosaic GPU dialect: TMA loads and warpgroup MMA.

The candidate for issue 26's prefill target (300 TFLOP/s). Same contract as
``ragged_paged_attention`` (the portable Triton kernel): any mix of decode tokens and prefill
chunks, every key and value already in the paged pools, padding rows zero. It takes the prefill
job over once an H200 run measures it faster (``benchmarks/gpu_check.sh``, sections ``kernels``,
``ksweep`` and ``pallas``); until then the engine runs it only when asked
(``attention_backend="pallas_mgpu"``) and the Triton kernel by default.

Work split: one program takes 64 consecutive new tokens of one sequence (``block_table`` from
the Triton kernel says which) for ``warpgroups`` query heads of one KV head, a warpgroup (128
threads) each. Each warpgroup loads its queries with one TMA copy; warpgroup 0 walks the
sequence's KV in blocks of ``block_kv`` tokens for all of them: a block is
``block_kv // page_size`` page copies landing side by side in shared memory on one barrier,
issued ``num_slots - 1`` blocks ahead of the block being multiplied, into a slot every
warpgroup has released (its K once their scores are read, its V once their values are).
``warp_specialized`` gives the loads to a warpgroup of their own instead (FlashAttention-3's
producer and consumers; with two consumers they take turns on the tensor cores). Scores and
the weighted values are ``wgmma`` products accumulated in float32 registers; the online
softmax runs in base 2 with the scale folded in. Only the blocks on the causal diagonal are
masked. Programs launch longest KV walk first, so the last wave is of short ones. The output
leaves through shared memory in at most seven TMA stores whose row counts are the bits of the
program's row count, so a partial block never writes over the next sequence's rows.

Limits: bfloat16 or float16 on a GPU (``wgmma`` multiplies float32 as TF32, which would break
the engine's float32 equality with HuggingFace); float32 only in the interpreter, where the
engine's HuggingFace-equality tests run it; head_dim a multiple of 64; page_size a multiple of
8 dividing ``block_kv``.

On CPU (``interpret=True``) it runs in Mosaic GPU's interpreter, which simulates the TMA copies,
barriers and shared memory (and races, with ``detect_races``) but not the transposed or register
operands of ``wgmma``: there the two products are plain dots of the same shared-memory tiles
(``mgpu_ops.Products``). Everything else, the program table, the page walk, the pipeline, the
masks and the stores, runs as on the GPU.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.mgpu_limits import (BLOCK_KV, BLOCK_Q, COMPUTE_REGISTERS, LOADER_REGISTERS,
                                        NUM_SLOTS, check_mgpu_shapes, default_warpgroups)
from pallas_kernels.mgpu_ops import Products, convert, interpret_products, tiles, wgmma_products
from pallas_kernels.ragged_paged_attention import MASK_VALUE, block_table, kv_scales, pool_shapes

LOG2E = math.log2(math.e)
STORE_ROWS = (64, 32, 16, 8, 4, 2, 1)


def _kernel(meta_ref, table_ref, layer_ref, q_ref, k_ref, v_ref, *refs, scale: float,
            group: int, warpgroups: int, pages_per_block: int, num_slots: int,
            products: Products, quantized: bool, specialized: bool):
    if quantized:  # FP8 pools: their scales, and each warpgroup's converted K and V tiles
        scales_ref, o_ref, q_smem, k_smem, v_smem, o_smem, kc_smem, vc_smem, *bars = refs
    else:
        o_ref, q_smem, k_smem, v_smem, o_smem, *bars = refs
    q_bar, k_bar, v_bar, k_free, v_free, *turn = bars  # turn: two specialised warpgroups'
    b, wg = jax.lax.axis_index("block"), jax.lax.axis_index("wg")
    first_head = jax.lax.axis_index("heads") * warpgroups
    h, kv_head = first_head + wg, first_head // group
    seq, row0, num_rows = meta_ref[b, 0], meta_ref[b, 1], meta_ref[b, 2]
    first_pos, kv_end = meta_ref[b, 3], meta_ref[b, 4]
    layer = layer_ref[0]
    page_size, d = k_ref.shape[3], k_ref.shape[4]
    block_kv = pages_per_block * page_size
    wgmma_layout = plgpu.Layout.WGMMA
    num_blocks = pl.cdiv(kv_end, block_kv)
    k_scale = scales_ref[0, kv_head] if quantized else 1.0
    q_tile, o_tile = q_smem.at[wg], o_smem.at[wg]  # a computing warpgroup's (not the loader's)

    def load_block(j, _=None):  # once every warpgroup has released the slot's K (V)
        slot = j % num_slots
        pages = [table_ref[seq, j * pages_per_block + i] for i in range(pages_per_block)]
        for free, ready, pool, tile in ((k_free, k_bar, k_ref, k_smem),
                                        (v_free, v_bar, v_ref, v_smem)):
            pl.when(j >= num_slots)(functools.partial(plgpu.barrier_wait, free.at[slot]))
            for i, page in enumerate(pages):
                plgpu.copy_gmem_to_smem(pool.at[layer, kv_head, page],
                                        tile.at[slot, pl.ds(i * page_size, page_size)],
                                        ready.at[slot])

    def drain(_=None):  # the last slots' releases, never awaited by a load (every phase seen)
        def wait(j, _):
            plgpu.barrier_wait(k_free.at[j % num_slots])
            plgpu.barrier_wait(v_free.at[j % num_slots])
        jax.lax.fori_loop(jnp.maximum(num_blocks - num_slots, 0), num_blocks, wait, None)

    # `turn` balances only because both computing warpgroups take the same rows (one query head
    # each): their loops run equally often. Rows split between them would need an epilogue loop.
    def yield_turn():  # arrive, then wait for the other warpgroup to arrive as often
        plgpu.barrier_arrive(turn[0])
        plgpu.barrier_wait(turn[0])

    def kv_block(j, carry, causal: bool):
        m, l, acc = carry
        slot = j % num_slots
        if not specialized:  # warpgroup 0 loads, num_slots - 1 blocks ahead
            ahead = j + num_slots - 1
            pl.when((wg == 0) & (ahead < num_blocks))(functools.partial(load_block, ahead))
        plgpu.barrier_wait(k_bar.at[slot])
        k_tile, v_tile = k_smem.at[slot], v_smem.at[slot]
        if quantized:
            convert(k_tile, kc_smem.at[wg])
            k_tile = kc_smem.at[wg]
        s = products.scores(q_tile, k_tile, yield_turn if turn else (lambda: None))
        plgpu.barrier_arrive(k_free.at[slot])
        s = s * (scale * LOG2E * k_scale)
        if causal:
            row = products.iota((BLOCK_Q, block_kv), 0)
            key = products.iota((BLOCK_Q, block_kv), 1)
            s = jnp.where(j * block_kv + key <= first_pos + row, s, MASK_VALUE)
        m_new = jnp.maximum(m, s.max(axis=1))
        corr = jnp.exp2(m - m_new)
        p = jnp.exp2(s - jax.lax.broadcast_in_dim(m_new, s.shape, [0]))
        l = l * corr + p.sum(axis=1)
        acc = acc * jax.lax.broadcast_in_dim(corr, acc.shape, [0])
        p = p.astype(q_tile.dtype)
        if turn:  # softmax done: the tensor cores go to the other warpgroup's scores first
            if d <= 128:  # keep the softmax before the barriers (FlashAttention-3's order)
                m_new, l, acc, p = jax.lax.optimization_barrier((m_new, l, acc, p))
            plgpu.barrier_arrive(turn[0])
            plgpu.barrier_wait(v_bar.at[slot])
            plgpu.barrier_wait(turn[0])
        else:
            plgpu.barrier_wait(v_bar.at[slot])
        if quantized:
            convert(v_tile, vc_smem.at[wg])
            v_tile = vc_smem.at[wg]
        acc = products.values(acc, p, v_tile)
        plgpu.barrier_arrive(v_free.at[slot])
        return m_new, l, acc

    def attend():  # this warpgroup's query head: its 64 rows' attention, stored
        # queries land in the untiled buffer (a TMA box into the 8-row tiles of q_smem must
        # start on a tile: row0 need not), then go to q_smem through registers
        plgpu.copy_gmem_to_smem(q_ref.at[pl.ds(row0, BLOCK_Q), h], o_tile, q_bar.at[wg])
        if not specialized:
            @pl.when(wg == 0)
            def _():
                for j in range(num_slots - 1):
                    pl.when(j < num_blocks)(functools.partial(load_block, j))
        plgpu.barrier_wait(q_bar.at[wg])
        q_tile[...] = products.load(o_tile)
        plgpu.commit_smem()
        rows_layout = wgmma_layout.reduce(1)
        init = (products.layout(jnp.full((BLOCK_Q,), MASK_VALUE, jnp.float32), rows_layout),
                products.layout(jnp.full((BLOCK_Q,), 0.0, jnp.float32), rows_layout),
                products.layout(jnp.full((BLOCK_Q, d), 0.0, jnp.float32), wgmma_layout))
        if turn:  # warpgroup 1 starts half a block behind warpgroup 0
            pl.when(wg == 1)(yield_turn)
        visible = jnp.clip((first_pos + 1) // block_kv, 0, num_blocks)
        carry = jax.lax.fori_loop(0, visible, functools.partial(kv_block, causal=False), init)
        _, l, acc = jax.lax.fori_loop(visible, num_blocks,
                                      functools.partial(kv_block, causal=True), carry)
        if turn:
            pl.when(wg == 0)(yield_turn)
        elif not specialized:
            pl.when(wg == 0)(drain)
        inv = (scales_ref[1, kv_head] if quantized else 1.0) / jnp.where(l > 0, l, 1.0)
        o_tile[...] = (acc * jax.lax.broadcast_in_dim(inv, acc.shape, [0])).astype(o_tile.dtype)
        plgpu.commit_smem()
        done = 0
        for n in STORE_ROWS:
            @pl.when(num_rows & n != 0)
            def _(n=n, done=done):
                plgpu.copy_smem_to_gmem(o_tile.at[pl.ds(done, n)],
                                        o_ref.at[pl.ds(row0 + done, n), h])
            done = done + (num_rows & n)
        plgpu.wait_smem_to_gmem(0)

    @pl.when(num_rows > 0)
    def _():
        if not specialized:
            attend()
            return
        # FlashAttention-3's warp specialisation: one warpgroup only loads (few registers), the
        # others only compute (the registers it gave up, when two of them take turns)
        @pl.when(wg == warpgroups)
        def _():
            if turn:
                plgpu.set_max_registers(LOADER_REGISTERS, action="decrease")
            jax.lax.fori_loop(0, num_blocks, load_block, None)
            drain()

        @pl.when(wg < warpgroups)
        def _():
            if turn:
                plgpu.set_max_registers(COMPUTE_REGISTERS, action="increase")
            attend()


@functools.partial(jax.jit, static_argnames=("scale", "block_kv", "num_slots", "warpgroups",
                                             "warp_specialized", "interpret", "detect_races"))
def ragged_paged_attention_mgpu(
    q: jax.Array,
    k_pool: jax.Array,
    v_pool: jax.Array,
    layer: jax.Array | int,
    page_table: jax.Array,
    cu_q_lens: jax.Array,
    kv_lens: jax.Array,
    *,
    scale: float,
    block_kv: int = BLOCK_KV,
    num_slots: int = NUM_SLOTS,
    warpgroups: int | None = None,
    warp_specialized: bool = False,
    interpret: bool = False,
    detect_races: bool = False,
    scales: tuple[jax.Array, jax.Array] | None = None,
) -> jax.Array:
    """Causal attention of a ragged batch over paged KV; arguments as ``ragged_paged_attention``
    (FP8 pools with their ``scales``: each page lands in shared memory as stored and each
    warpgroup converts the block to q's dtype through its registers, since ``wgmma`` reads K
    and V from shared memory and multiplies FP8 only by FP8; the conversion's GPU lowering
    awaits a run on a GPU: ``benchmarks/gpu_check.sh fp8``).

    Args:
      block_kv: key tokens per inner step (whole pages, a multiple of 64).
      num_slots: shared-memory buffers for KV blocks; ``num_slots - 1`` are in flight while one
        is multiplied.
      warpgroups: query heads of one KV head per program, a warpgroup each, sharing every KV
        block loaded (1 or 2; default ``default_warpgroups``).
      warp_specialized: one more warpgroup that only issues the KV loads, FlashAttention-3's
        producer, while the others only compute; two computing warpgroups then take turns on
        the tensor cores (one's softmax beside the other's matmuls) and the loader gives them
        its registers. Off by default until a GPU measures it faster (``kernel_sweeps.py``
        times both; the tuning table keeps the winner).
      interpret: run in Mosaic GPU's interpreter (on CPU).
      detect_races: with ``interpret``, the interpreter's race detector on (its verdict:
        ``jax._src.pallas.mosaic_gpu.interpret.gpu_callbacks.get_races()``).
    Returns:
      [T, num_heads, D] in q's dtype.
    """
    t, num_heads, d = q.shape
    page_size = k_pool.shape[3]
    group, _ = pool_shapes(q, k_pool)
    extra, quantized = kv_scales(scales, q.dtype)
    kv_dtype = k_pool.dtype
    warpgroups = warpgroups or default_warpgroups(group, d, block_kv, num_slots, kv_dtype.itemsize)
    check_mgpu_shapes(q.dtype, d, page_size, block_kv, num_slots, group, warpgroups,
                      bool(interpret), kv_dtype)
    ppb = block_kv // page_size
    w = page_table.shape[1]
    table = jnp.pad(page_table.astype(jnp.int32), ((0, 1), (0, -w % ppb)))
    meta = block_table(cu_q_lens, kv_lens, t, BLOCK_Q)
    meta = meta[jnp.argsort(-meta[:, 4], stable=True)]  # the longest KV walks start first
    rows = t + BLOCK_Q + -t % 8  # a last block reads q past t; TMA wants whole 8-row tiles
    q_tiles, kv_tiles = (tiles(d, dtype) for dtype in (q.dtype, kv_dtype))
    converted = [plgpu.SMEM((warpgroups, block_kv, d), q.dtype, transforms=q_tiles)] * 2
    products = interpret_products() if interpret else wgmma_products(block_kv)
    pingpong = warp_specialized and warpgroups == 2
    if interpret:
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
        interpret = InterpretGPUParams(detect_races=detect_races)
    out = plgpu.kernel(
        functools.partial(_kernel, scale=scale, group=group, warpgroups=warpgroups,
                          pages_per_block=ppb, num_slots=num_slots, products=products,
                          quantized=quantized, specialized=warp_specialized),
        out_type=jax.ShapeDtypeStruct((t, num_heads, d), q.dtype),  # stores stop at row t
        scratch_types=[
            plgpu.SMEM((warpgroups, BLOCK_Q, d), q.dtype, transforms=q_tiles),
            plgpu.SMEM((num_slots, block_kv, d), kv_dtype, transforms=kv_tiles),
            plgpu.SMEM((num_slots, block_kv, d), kv_dtype, transforms=kv_tiles),
            plgpu.SMEM((warpgroups, BLOCK_Q, d), q.dtype),
            *(converted if quantized else ()),
            plgpu.Barrier(num_barriers=warpgroups),
            plgpu.Barrier(num_arrivals=ppb, num_barriers=num_slots),
            plgpu.Barrier(num_arrivals=ppb, num_barriers=num_slots),
            plgpu.Barrier(num_arrivals=warpgroups, num_barriers=num_slots),  # K released
            plgpu.Barrier(num_arrivals=warpgroups, num_barriers=num_slots),  # V released
            *([plgpu.Barrier(num_arrivals=2)] if pingpong else []),  # the tensor cores' turn
        ],
        # Pallas launches its grid row-major: the heads vary fastest, so the order holds
        grid=(meta.shape[0], num_heads // warpgroups),
        grid_names=("block", "heads"),
        num_threads=warpgroups + warp_specialized,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=interpret or None,
        kernel_name="ragged_paged_attention_mgpu",
    )(meta, table, jnp.asarray(layer, jnp.int32).reshape(1),
      jnp.pad(q, ((0, rows - t), (0, 0), (0, 0))), k_pool, v_pool, *extra)
    return out
