"""How an engine's parts are chosen from its configuration: dtype, KV pool size, tokenizer,
scheduler (the attention backend: :mod:`minijax_serve.attention.registry`)."""

from __future__ import annotations

import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from minijax_serve.config import EngineConfig
from minijax_serve.executor.processes import multi_process
from minijax_serve.memory import NoPrefixCache, PageAllocator, RadixCache, RequestSlots, SlotTable
from minijax_serve.models.config import ModelSpec
from minijax_serve.scheduler import Scheduler, SchedulerLimits
from minijax_serve.scheduler.policy import SchedulePolicy
from minijax_serve.scheduler.retract import NewTokenRatio


def default_dtype(name: str, platform: str):
    """The dtype ``name`` resolves to on ``platform``: "auto" is float32 on CPU, else bfloat16."""
    if name == "auto":
        return jnp.float32 if platform == "cpu" else jnp.bfloat16
    return jnp.dtype(name)


def _free_device_bytes() -> int:
    stats = jax.devices()[0].memory_stats()
    if stats and "bytes_limit" in stats:
        return stats["bytes_limit"] - stats.get("bytes_in_use", 0)
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def pool_tokens(config: EngineConfig, cfg: ModelSpec, dtype, context_length: int,
                tp: int = 1) -> int:
    """KV pool size in tokens: ``max_total_tokens``, or ``mem_fraction_static`` of the free
    device memory (at most every request slot's whole context) in tokens of ``dtype`` (the
    pools': 1 byte an element for an FP8 cache); with tensor parallelism a device holds 1/tp of
    each token's KV heads (``cfg``'s, replicated ones included)."""
    if config.max_total_tokens:
        return config.max_total_tokens
    per_token = cfg.kv_bytes_per_token(jnp.dtype(dtype).itemsize) // tp
    free = _free_device_bytes()
    if jax.default_backend() == "cpu":  # CPU devices share the host's memory
        free //= min(tp, jax.local_device_count())
    if multi_process():  # every process sizes the same pool: the smallest device's
        free = int(multihost_utils.process_allgather(np.int64(free)).min())
    return pool_from_free_memory(config, free, per_token, context_length)


def pool_from_free_memory(config: EngineConfig, free_bytes: float, per_token_bytes: float,
                          context_length: int) -> int:
    """``mem_fraction_static`` of a device's free memory in tokens of ``per_token_bytes``, at
    least a page and at most every request slot's whole context."""
    tokens = int(max(free_bytes, 0) * config.mem_fraction_static / per_token_bytes)
    return max(config.page_size, min(tokens, config.max_running_requests * context_length))


def load_tokenizer(path: Path):
    """The HF tokenizer of a model directory (offline, no remote code)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    if not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        raise FileNotFoundError(
            f"{path}: no tokenizer.json or tokenizer_config.json; pass skip_tokenizer_init=True "
            "to use token ids only"
        )
    return AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)


def build_scheduler(config: EngineConfig, cfg: ModelSpec, allocator: PageAllocator,
                    slots: RequestSlots, table: SlotTable, chunk_tokens: int | None) -> Scheduler:
    """The scheduler, its prefix cache (``scheduler.cache``) and schedule policy."""
    cache = (RadixCache if config.enable_radix_cache else NoPrefixCache)(allocator)
    policy = SchedulePolicy(config.schedule_policy, cache, lpm_max_queue=config.lpm_max_queue,
                            seed=config.seed)
    limits = SchedulerLimits(
        max_running=config.max_running_requests, max_prefill_tokens=config.max_prefill_tokens,
        chunk_tokens=chunk_tokens, mixed=config.enable_mixed_chunk,
        retract_policy=config.retract_policy, force_retract_every=config.force_retract_every,
        exact_ignore_eos=config.exact_ignore_eos_admission)
    init_ratio = min(config.init_new_token_ratio * config.schedule_conservativeness, 1.0)
    ratio = NewTokenRatio(init_ratio, min(init_ratio * config.min_new_token_ratio_factor, 1.0),
                          config.new_token_ratio_decay_steps, config.retract_decode_steps)
    return Scheduler(allocator=allocator, slots=slots, table=table, cache=cache, policy=policy,
                     limits=limits, ratio=ratio, eos_ids=cfg.eos_token_ids)


def step_tokens(config: EngineConfig, context_length: int, chunk_tokens: int | None) -> int:
    """The most new tokens one step can carry: one prompt runs whole without chunking; with it,
    a chunk (and, mixing, the decode tokens that ride along)."""
    tokens = max(config.max_prefill_tokens, context_length)
    if chunk_tokens is not None:
        mixed_decoders = config.max_running_requests if config.enable_mixed_chunk else 0
        tokens = min(chunk_tokens, tokens + mixed_decoders)
    return tokens

