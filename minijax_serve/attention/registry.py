"""The attention backends by name: the one place that resolves ``attention_backend`` and explains
a refusal. Nothing else in the engine imports a kernel module; a new kernel (an FP8-KV one, a
faster GPU one) is a backend registered here.

``"xla"``: the jnp reference; ``"pallas"``: the Triton kernels; ``"pallas_mgpu"``: the Mosaic GPU
ragged kernel for prompt steps with the Triton decode kernel (Hopper). ``"auto"`` takes the Triton
kernels on a GPU where they run and support the model's shapes, else the reference.
"""

from __future__ import annotations

import functools
import logging

import jax.numpy as jnp

from minijax_serve.attention.backends import (AttentionBackend, AttentionMetadata, HeadShape,
                                              MosaicHybridBackend, ReferenceBackend, TritonBackend)
from minijax_serve.attention.kv_cache import kv_value_dtype
from minijax_serve.config import EngineConfig
from pallas_kernels import tuning

log = logging.getLogger(__name__)

BACKENDS: dict[str, AttentionBackend] = {b.name: b for b in (
    ReferenceBackend("xla", "the pure-jnp reference: every platform, shape and dtype"),
    TritonBackend("pallas", "Pallas Triton kernels: ragged prefill and split-KV decode",
                  decode_kernel=True),
    MosaicHybridBackend("pallas_mgpu", "Mosaic GPU ragged kernel for prompt steps (Hopper), "
                        "Triton decode kernel", decode_kernel=True),
)}


def get_backend(name: str) -> AttentionBackend:
    """The backend registered as ``name``."""
    if name not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {', '.join(BACKENDS)}, got {name!r}")
    return BACKENDS[name]


def ragged_decodes(name: str, device_kind: str, dtype, cfg, page_size: int, tp: int = 1) -> bool:
    """Whether backend ``name``'s unified steps run their decode-only steps on its ragged kernel
    rather than in decode programs of their own on its decode kernel: the ``decode_routing``
    tuning table's row for ``device_kind`` and one device's share of ``cfg``'s heads
    (``pallas_kernels/tuning``; written from the measured decode grid). A backend without a
    decode kernel always does."""
    if not get_backend(name).decode_kernel:
        return True
    kv_heads = max(1, cfg.num_kv_heads // tp)  # replicated where tp exceeds them
    row = tuning.lookup("decode_routing", device_kind, jnp.dtype(dtype).name,
                        cfg.num_heads // tp, kv_heads, cfg.head_dim, page_size)
    return bool(row.get(name, True))


def check_page_size(name: str, page_size: int) -> None:
    """Raise ValueError if backend ``name`` ("auto" included: nothing to check) cannot run pages
    of ``page_size`` tokens; needs no model, so a command line is checked before loading one."""
    if name != "auto":
        get_backend(name).check_page_size(page_size)


def check_kv_cache_dtype(name: str, kv_cache_dtype: str, platform: str,
                         simulated: bool = False) -> None:
    """Raise ValueError naming ``kv_cache_dtype`` if backend ``name`` cannot read such pools on
    ``platform`` ("auto": nothing to check, it falls back to one that can); needs no model."""
    if name != "auto":
        get_backend(name).check_kv_cache_dtype(kv_cache_dtype, platform, simulated)


def check_before_loading(config: EngineConfig, platform: str, simulated: bool) -> None:
    """What the configured backend can be refused for without a model (its page size, its KV
    cache dtype on ``platform``): checked before any weight is loaded."""
    check_page_size(config.attention_backend, config.page_size)
    check_kv_cache_dtype(config.attention_backend, config.kv_cache_dtype, platform, simulated)


@functools.cache
def pallas_kernels_run() -> bool:
    """Whether the Triton backend compiles and runs on the default device (a tiny call of each
    kernel): ``attention_backend="auto"`` falls back to the reference where it does not."""
    q = jnp.ones((4, 2, 16), jnp.float32)
    pool = jnp.ones((1, 1, 2, 16, 16), jnp.float32)
    meta = AttentionMetadata(positions=jnp.zeros(4, jnp.int32), seq_ids=jnp.arange(4),
                             slot_mapping=jnp.zeros(4, jnp.int32), cu_q_lens=jnp.arange(5),
                             page_table=jnp.zeros((4, 1), jnp.int32),
                             kv_lens=jnp.ones((4,), jnp.int32))
    backend = BACKENDS["pallas"]
    try:
        outs = [backend(q, None, None, pool, pool, 0, meta, 1.0, decode) for decode in (False, True)]
    except Exception as err:  # noqa: BLE001 (any lowering or compile failure means "no")
        log.warning("the Pallas attention kernels do not run here (%s: %s)", type(err).__name__, err)
        return False
    if not all(bool(jnp.allclose(o, 1.0)) for o in outs):  # every value is 1: so is attention
        log.warning("the Pallas attention kernels give wrong results here")
        return False
    return True


def attention_backend(config: EngineConfig, cfg, platform: str, dtype=jnp.float32) -> str:
    """The name of the backend that runs ``config.attention_backend`` for a model of ``cfg``'s
    shapes (``num_heads``, ``num_kv_heads``, ``head_dim``) on ``platform`` (jax.default_backend(),
    or a simulated device's). "auto" takes the Triton kernels only where they run and support
    the model's shapes and its KV cache dtype (a simulated GPU runs no kernel: the shapes
    decide), else the reference; a named backend raises ValueError naming what it cannot run."""
    name = config.resolved_attention_backend(platform)
    backend = get_backend(name)
    shape = HeadShape(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
    simulated = config.simulate is not None
    try:
        backend.check_page_size(config.page_size)
        backend.check_kv_cache_dtype(config.kv_cache_dtype, platform, simulated)
        backend.check(shape, config.page_size, dtype, platform, config.tensor_parallel_size,
                      simulated, kv_value_dtype(config.kv_cache_dtype, dtype))
    except ValueError:
        if config.attention_backend != "auto":
            raise
        return "xla"
    if config.attention_backend == "auto" and name != "xla" and not simulated and not pallas_kernels_run():
        return "xla"
    return name
