"""The attention backends: what each supports and how the engine calls it.

Every backend takes the same call: a layer's queries ``q`` [T, heads, D] and this step's keys
and values ``k``, ``v`` [T, kv_heads, D], over the paged pools (which already hold ``k`` and
``v``) described by an :class:`AttentionMetadata`; it returns [T, heads, D]. ``decode`` says
every sequence has exactly one new token (known when the step is compiled): a backend with a
decode kernel takes it there. FP8 pools come with the layer's ``k_scale``/``v_scale``
[kv_heads] (:mod:`minijax_serve.attention.kv_cache`): every backend reads the FP8 values and
dequantises them as it loads them. ``check`` raises ValueError naming the limit for a model
shape, page size, dtype, KV cache dtype or platform the backend cannot run;
:mod:`minijax_serve.attention.registry` resolves a name to a backend and calls it.

The kernels' tile sizes come from their tuning tables (:mod:`pallas_kernels.tuning`), keyed by
the device kind, dtype, head counts, head dim and page size.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from minijax_serve.attention.kv_cache import as_stored, fp8_view
from pallas_kernels import tuning
from pallas_kernels.ragged_paged_attention import check_shapes
from pallas_kernels.mgpu_limits import BLOCK_KV as MGPU_BLOCK_KV, NUM_SLOTS, check_mgpu_shapes
from pallas_kernels.reference import ragged_paged_attention_ref

# The Pallas kernels are imported when a step first calls them: Pallas's Triton and Mosaic GPU
# modules take 0.3 s to import (python -X importtime), which every process paid, the CLI's
# included, though the CPU's default backend never runs them.


class AttentionMetadata(NamedTuple):
    """Where each new token sits and where its sequence's KV lives (device arrays).

    positions, seq_ids, slot_mapping: [T]; cu_q_lens: [S+1]; page_table: [S, W]; kv_lens: [S].
    ``slot_mapping`` is the flat KV slot (page * page_size + offset) each new token writes;
    tokens past ``cu_q_lens[-1]`` are padding.
    """

    positions: jax.Array
    seq_ids: jax.Array
    slot_mapping: jax.Array
    cu_q_lens: jax.Array
    page_table: jax.Array
    kv_lens: jax.Array


class HeadShape(NamedTuple):
    """The attention shape of a model (per device under tensor parallelism: local heads)."""

    num_heads: int
    kv_heads: int
    head_dim: int


def _interpret() -> bool:
    return jax.default_backend() == "cpu"


def _tuned(kernel: str, q: jax.Array, k_pool: jax.Array) -> dict[str, Any]:
    """The tuning table's row for this call's shapes on the default device."""
    _, heads, head_dim = q.shape
    _, kv_heads, _, page_size, _ = k_pool.shape
    return tuning.lookup(kernel, jax.devices()[0].device_kind, jnp.dtype(q.dtype).name, heads,
                         kv_heads, head_dim, page_size)


@dataclasses.dataclass(frozen=True)
class AttentionBackend:
    """A way to run paged attention. ``decode_kernel``: decode steps (one new token per
    sequence) can be compiled as programs of their own that run a decode kernel; whether unified
    steps run their decode-only steps on the ragged kernel instead (no programs of their own)
    is data, the ``decode_routing`` tuning table (``registry.ragged_decodes``)."""

    name: str
    description: str
    decode_kernel: bool = False

    def check(self, shape: HeadShape, page_size: int, dtype, platform: str, tp: int,
              simulated: bool = False, kv_dtype=None) -> None:
        """Raise ValueError naming the limit if this backend cannot run ``shape`` in ``dtype``
        (its pools in ``kv_dtype``, default ``dtype``) on ``platform`` over ``tp`` devices
        (``simulated``: a simulated device of that platform, whose kernels are never run)."""

    def check_page_size(self, page_size: int) -> None:
        """Raise ValueError if ``page_size`` is one this backend cannot run (no model needed)."""

    def check_kv_cache_dtype(self, kv_cache_dtype: str, platform: str,
                             simulated: bool = False) -> None:
        """Raise ValueError naming ``kv_cache_dtype`` if this backend cannot read such pools
        on ``platform`` (no model needed)."""

    def __call__(self, q: jax.Array, k: jax.Array, v: jax.Array, k_pool: jax.Array,
                 v_pool: jax.Array, layer: jax.Array, m: AttentionMetadata, scale: float,
                 decode: bool, k_scale: jax.Array | None = None,
                 v_scale: jax.Array | None = None) -> jax.Array:
        raise NotImplementedError


class ReferenceBackend(AttentionBackend):
    """The pure-jnp reference (the CPU path and the oracle): per sequence over its own pages,
    any shape, page size, dtype and KV cache dtype, every platform. A step's new keys and
    values are rounded as an FP8 pool stores them, as the kernels read them from the pages."""

    def __call__(self, q, k, v, k_pool, v_pool, layer, m, scale, decode, k_scale=None,
                 v_scale=None):
        return ragged_paged_attention_ref(q, as_stored(k, k_scale), as_stored(v, v_scale),
                                          k_pool, v_pool, layer, m.page_table, m.cu_q_lens,
                                          m.seq_ids, m.positions, m.kv_lens, scale,
                                          k_scale=k_scale, v_scale=v_scale)


def _scales(k_scale, v_scale) -> tuple[jax.Array, jax.Array] | None:
    return None if k_scale is None else (k_scale, v_scale)


def check_fp8_triton(backend: str, kv_cache_dtype: str, platform: str, simulated: bool) -> None:
    """ValueError unless Triton can convert FP8 on the default GPU: compute capability 8.9
    (Ada, Hopper) or more; Pallas's interpreter (CPU) and a simulated device always can."""
    if kv_cache_dtype == "auto" or platform != "gpu" or simulated:
        return
    device = jax.devices()[0]
    capability = getattr(device, "compute_capability", None)
    if capability is None or float(capability) < 8.9:
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} with attention_backend={backend!r} "
                         f"needs an NVIDIA GPU of compute capability 8.9 (Ada, Hopper) or more "
                         f"to convert FP8 in its kernels, got {device.device_kind} (compute "
                         f"capability {capability}); use attention_backend='xla' or "
                         "kv_cache_dtype='auto'")


class TritonBackend(AttentionBackend):
    """Portable Pallas (Triton on NVIDIA GPUs, interpreted on CPU): the ragged kernel for steps
    with prompt tokens, the split-KV decode kernel for decode steps."""

    def check(self, shape, page_size, dtype, platform, tp, simulated=False, kv_dtype=None):
        check_shapes(shape.num_heads, shape.kv_heads, shape.head_dim, page_size)

    def check_kv_cache_dtype(self, kv_cache_dtype, platform, simulated=False):
        check_fp8_triton(self.name, kv_cache_dtype, platform, simulated)

    def check_page_size(self, page_size):
        if page_size & (page_size - 1):
            raise ValueError(f"attention_backend={self.name!r} needs page_size to be a power of "
                             f"two, got {page_size}")

    def ragged(self, q, k_pool, v_pool, layer, m, scale, scales):
        from pallas_kernels.ragged_paged_attention import ragged_paged_attention

        return ragged_paged_attention(q, k_pool, v_pool, layer, m.page_table, m.cu_q_lens,
                                      m.kv_lens, scale=scale, interpret=_interpret(),
                                      scales=scales, **_tuned("ragged_paged_attention", q, k_pool))

    def __call__(self, q, k, v, k_pool, v_pool, layer, m, scale, decode, k_scale=None,
                 v_scale=None):
        scales = _scales(k_scale, v_scale)
        k_pool, v_pool = fp8_view(k_pool), fp8_view(v_pool)  # FP8 pools' bits as FP8
        if decode:
            from pallas_kernels.paged_decode_attention import paged_decode_attention

            return paged_decode_attention(q, k_pool, v_pool, layer, m.page_table, m.kv_lens,
                                          scale=scale, interpret=_interpret(), scales=scales,
                                          **_tuned("paged_decode_attention", q, k_pool))
        return self.ragged(q, k_pool, v_pool, layer, m, scale, scales)


def check_hopper(device) -> None:
    """ValueError unless ``device`` is an NVIDIA GPU of compute capability 9.0 (Hopper) or more,
    which the Mosaic GPU kernel's TMA and ``wgmma`` need."""
    capability = getattr(device, "compute_capability", None)
    if device.platform != "gpu" or capability is None or float(capability) < 9.0:
        raise ValueError(f"attention_backend='pallas_mgpu' needs an NVIDIA GPU of compute "
                         f"capability 9.0 (Hopper) or more, got {device.device_kind} "
                         f"({device.platform}, compute capability {capability})")


class MosaicHybridBackend(TritonBackend):
    """Hopper: the Mosaic GPU ragged kernel (TMA, wgmma) for steps with prompt tokens, the Triton
    decode kernel for decode steps."""

    def check(self, shape, page_size, dtype, platform, tp, simulated=False, kv_dtype=None):
        if platform != "cpu" and not simulated:
            check_hopper(jax.devices()[0])
        super().check(shape, page_size, dtype, platform, tp, simulated, kv_dtype)
        # one warpgroup: the kernel takes two only where their tiles fit (default_warpgroups)
        check_mgpu_shapes(dtype, shape.head_dim, page_size, MGPU_BLOCK_KV, NUM_SLOTS,
                          interpret=platform == "cpu", kv_dtype=kv_dtype)
        if platform == "cpu" and not simulated and tp > 1:
            raise ValueError(
                f"attention_backend='pallas_mgpu' with tensor_parallel_size={tp} on CPU: Mosaic "
                "GPU's interpreter keeps one shared memory for every device, so its kernels "
                "cannot run on several devices at once (a kernel ending on one device finds "
                "another's barriers allocated); use attention_backend='pallas' or "
                "tensor_parallel_size=1 on CPU")

    def check_page_size(self, page_size):
        super().check_page_size(page_size)
        if page_size % 8 or MGPU_BLOCK_KV % page_size:
            raise ValueError(f"attention_backend='pallas_mgpu' needs page_size to be 8, 16, 32 "
                             f"or 64 (a multiple of 8 dividing the kernel's {MGPU_BLOCK_KV}-token "
                             f"KV blocks), got {page_size}")

    def ragged(self, q, k_pool, v_pool, layer, m, scale, scales):
        from pallas_kernels.ragged_paged_attention_mgpu import ragged_paged_attention_mgpu

        # one warpgroup in the interpreter, which compiles every program of a two-warpgroup
        # kernel anew (seconds a call)
        tiles = _tuned("ragged_paged_attention_mgpu", q, k_pool)
        if _interpret():
            tiles["warpgroups"] = 1
        return ragged_paged_attention_mgpu(q, k_pool, v_pool, layer, m.page_table, m.cu_q_lens,
                                           m.kv_lens, scale=scale, interpret=_interpret(),
                                           scales=scales, **tiles)
