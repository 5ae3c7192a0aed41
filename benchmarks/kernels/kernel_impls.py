"""The implementations ``bench_kernels.py`` compares, as functions of one batch (``Args``):
our two Pallas kernels (Triton), the Mosaic GPU ragged kernel, JAX's ``paged_attention`` and the
jnp reference, each with its tiles over the shape's defaults."""

from __future__ import annotations

import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
from kernel_cases import Args, Shape

from pallas_kernels.paged_decode_attention import paged_decode_attention
from pallas_kernels.ragged_paged_attention import ragged_paged_attention
from pallas_kernels.ragged_paged_attention_mgpu import (check_mgpu_shapes,
                                                        ragged_paged_attention_mgpu)
from pallas_kernels.reference import ragged_paged_attention_ref


def jax_paged_splits(width: int) -> tuple[int, int]:
    """(k_splits, pages_per_compute_block) JAX's kernel accepts for this table width."""
    k_splits = math.gcd(width, 16)
    return k_splits, math.gcd(width // k_splits, 8)


def decode_kernel(shape: Shape, interpret: bool, **tiles: Any) -> Callable[[Args], jax.Array]:
    """Our decode kernel on a batch, with ``tiles`` (block_kv, num_splits, num_warps,
    num_stages) over the shape's defaults."""
    kw = {"block_kv": shape.block_kv, **tiles}
    scale = 1.0 / math.sqrt(shape.head_dim)
    return lambda a: paged_decode_attention(a["q"], a["k_pool"], a["v_pool"], 0,
                                            a["page_table"], a["kv_lens"], scale=scale,
                                            interpret=interpret, **kw)


def ragged_kernel(shape: Shape, interpret: bool, **tiles: Any) -> Callable[[Args], jax.Array]:
    """Our ragged kernel on a batch, with ``tiles`` (block_q, block_kv, num_warps, num_stages)
    over the shape's defaults."""
    kw = {"block_q": shape.block_q, "block_kv": shape.block_kv, **tiles}
    scale = 1.0 / math.sqrt(shape.head_dim)
    return lambda a: ragged_paged_attention(a["q"], a["k_pool"], a["v_pool"], 0,
                                            a["page_table"], a["cu_q_lens"], a["kv_lens"],
                                            scale=scale, interpret=interpret, **kw)


def mgpu_kernel(shape: Shape, interpret: bool, **tiles: Any) -> Callable[[Args], jax.Array]:
    """The Mosaic GPU ragged kernel on a batch, with ``tiles`` (block_kv, num_slots,
    warpgroups). In the interpreter one warpgroup by default: it compiles every program of a
    two-warpgroup kernel anew (about a second each on a 2-core CPU)."""
    scale = 1.0 / math.sqrt(shape.head_dim)
    tiles = {"warpgroups": 1, **tiles} if interpret else tiles
    return lambda a: ragged_paged_attention_mgpu(a["q"], a["k_pool"], a["v_pool"], 0,
                                                 a["page_table"], a["cu_q_lens"], a["kv_lens"],
                                                 scale=scale, interpret=interpret, **tiles)


def mgpu_fits(shape: Shape) -> bool:
    """Whether the Mosaic GPU kernel takes this shape (in bfloat16, its default tiles)."""
    try:
        check_mgpu_shapes(jnp.bfloat16, shape.head_dim, shape.page_size, 64, 2)
    except ValueError:
        return False
    return True


def implementations(shape: Shape, interpret: bool) -> dict[str, Callable[[Args], jax.Array]]:
    """Every implementation the shape allows, by name (module docstring of bench_kernels)."""
    scale = 1.0 / math.sqrt(shape.head_dim)

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

    impls = {"pallas_decode": decode_kernel(shape, interpret),
             "pallas_ragged": ragged_kernel(shape, interpret), "jax_paged": jax_paged, "xla": xla}
    if mgpu_fits(shape):
        impls["mgpu_ragged"] = mgpu_kernel(shape, interpret)
        if not interpret:  # its interpreter takes minutes a batch: tests/kernels checks it
            impls["mgpu_ragged_ws"] = mgpu_kernel(shape, interpret, warp_specialized=True)
    return impls
