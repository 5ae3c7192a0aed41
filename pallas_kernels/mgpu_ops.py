"""The Mosaic GPU ragged kernel's building blocks that differ between a GPU and Mosaic GPU's
interpreter (:mod:`pallas_kernels.ragged_paged_attention_mgpu`): its two matmuls, register
layouts, FP8 tiles converted through registers, and the shared-memory tiling."""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.mgpu_limits import BLOCK_Q


class Products(NamedTuple):
    """What differs between the GPU and the interpreter: the kernel's two matmuls (``wgmma``
    there, dots of the same tiles here), register layouts (which the interpreter has not), and
    loading a tile in the wgmma layout. ``scores`` runs ``after_issue`` between issuing its
    matmul and reading the result (where a warpgroup yields the tensor cores to the other)."""
    scores: Callable  # (q_smem, k_smem, after_issue) -> [BLOCK_Q, block_kv] float32
    values: Callable  # (acc [BLOCK_Q, D], p [BLOCK_Q, block_kv], v_smem) -> acc + p @ v
    layout: Callable  # (array, layout) -> array
    iota: Callable  # (shape, dimension) -> int32 array in the wgmma layout
    load: Callable  # (untiled smem ref) -> its array in the wgmma layout


def convert(src, dst) -> None:
    """An FP8 tile into the queries' dtype, through registers (``wgmma`` reads K and V from
    shared memory, and multiplies FP8 only by FP8): what this warpgroup's products read.
    Mosaic GPU converts FP8 to float16 only, exactly; on to float32, then the target (each
    step exact: an FP8 value has 4 significant bits)."""
    x = src[...].astype(jnp.float16)
    dst[...] = (x if dst.dtype == jnp.float16 else x.astype(jnp.float32)).astype(dst.dtype)
    plgpu.commit_smem()


def wgmma_products(block_kv: int) -> Products:
    def scores(q_smem, k_smem, after_issue: Callable[[], None]):
        def body(acc):
            plgpu.wgmma(acc, q_smem, plgpu.transpose_ref(k_smem, (1, 0)))
            after_issue()
            return acc[...]  # awaits the matmul
        return pl.run_scoped(body, plgpu.ACC((BLOCK_Q, block_kv), jnp.float32))

    def values(acc, p, v_smem):  # accumulated in place: no second accumulator's registers
        return pl.run_state(lambda ref: plgpu.wgmma(ref, p, v_smem))(plgpu.ACC.init(acc))

    def iota(shape, dimension):
        return plgpu.broadcasted_iota(jnp.int32, shape, dimension, layout=plgpu.Layout.WGMMA)

    def load(ref):  # no conflict-free pattern exists from an untiled tile; it runs once
        return plgpu.load(ref, (), layout=plgpu.Layout.WGMMA, optimized=False)

    return Products(scores, values, plgpu.layout_cast, iota, load)


def interpret_products() -> Products:
    def dot(a, b, contract_b):
        return jax.lax.dot_general(a, b, (((1,), (contract_b,)), ((), ())),
                                   precision=jax.lax.Precision.HIGHEST,
                                   preferred_element_type=jnp.float32)

    def scores(q, k, after_issue: Callable[[], None]):
        s = dot(q[...], k[...], 1)
        after_issue()
        return s

    return Products(scores, lambda acc, p, v: acc + dot(p, v[...], 0), lambda x, _: x,
                    lambda shape, dim: jax.lax.broadcasted_iota(jnp.int32, shape, dim),
                    lambda ref: ref[...])


def tiles(head_dim: int, dtype) -> tuple:
    """The shared-memory tiling of [rows, head_dim] tiles in ``dtype``: 8 rows of the widest
    swizzle a row holds (128 bytes: 64 bfloat16 columns, 32 of float32 in the interpreter, 128
    FP8 ones; 64 bytes for FP8 at head_dim 64)."""
    swizzle = plgpu.find_swizzle(min(head_dim * jnp.dtype(dtype).itemsize, 128) * 8, "tiles")
    return (plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)),
            plgpu.SwizzleTransform(swizzle))
