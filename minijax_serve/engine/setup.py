"""How an engine's parts are chosen from its configuration: dtype, the limits sized from the
device (:mod:`minijax_serve.engine.limits`), tokenizer, scheduler (the attention backend: :mod:`minijax_serve.attention.registry`)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from minijax_serve.config import EngineConfig
from minijax_serve.engine.limits import (DeviceMemory, Limits, resolve_limits,
                                         slot_row_bytes)
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


def device_kind(sim) -> str:
    """The device the engine runs on, as JAX names it (the kernels' tuning tables' key): the
    first device's, or a simulated profile's (``sim``)."""
    return jax.devices()[0].device_kind if sim is None else sim.device_kind


def device_memory(tp: int, agree: bool = True) -> DeviceMemory:
    """The default device's memory: its limit and what is free of it (on a CPU the host's
    available memory, shared by the ``min(tp, local devices)`` devices of this process, and
    by every process on the host); with several processes and ``agree``, the smallest
    device's free memory, on all (a collective)."""
    platform = jax.default_backend()
    # this process's own device: another process's raises (its collectives then wait for this
    # process until gloo gives up, DEADLINE_EXCEEDED after 30 s on the other processes)
    stats = jax.local_devices()[0].memory_stats()
    if stats and "bytes_limit" in stats:
        total = free = stats["bytes_limit"]
        free -= stats.get("bytes_in_use", 0)
        # JAX preallocates this share of the device: its total memory, for the chunk's tier
        total /= float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.75"))
    else:
        total = free = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    devices = 1
    if platform == "cpu":  # CPU devices share the host's memory
        devices = min(tp, jax.local_device_count())
        free /= devices * jax.process_count()
    if agree and multi_process():  # every process sizes the same pool: the smallest device's (in MiB:
        # the gather is of int32 unless JAX runs with 64-bit types)
        free = int(multihost_utils.process_allgather(np.int32(free // 2**20)).min()) * 2**20
    return DeviceMemory(platform, total, free, devices)


def device_limits(config: EngineConfig, cfg: ModelSpec, dtype, context_length: int,
                  tp: int = 1) -> Limits:
    """The engine's limits on the default device (:func:`~minijax_serve.engine.limits.
    resolve_limits`); with tensor parallelism a device holds 1/tp of each token's KV heads
    (``cfg``'s, replicated ones included)."""
    itemsize = jnp.dtype(dtype).itemsize
    # a pool of max_total_tokens needs no agreement on free memory (no collective), but the
    # device's total still picks the chunk's tier
    memory = device_memory(tp, agree=not config.max_total_tokens)
    return resolve_limits(config, memory, cfg.kv_bytes_per_token(itemsize) / tp, context_length,
                          itemsize, slot_row_bytes(cfg.vocab_size))


# What AutoTokenizer makes of a ``tokenizer_class`` of these (with a tokenizer.json) is
# PreTrainedTokenizerFast, loaded here without AutoTokenizer, which reads the model's config
# and with it imports torch when it is installed: a process's first SmolLM2 tokenizer 5.7 s
# instead of 1.4 (benchmarks/RESULTS.md, "The tokenizer without torch")
FAST_TOKENIZER_CLASSES = ("PreTrainedTokenizerFast", "TokenizersBackend")


def _tokenizer_class(path: Path) -> str | None:
    """``tokenizer_class`` of the directory's tokenizer_config.json (None when unreadable:
    AutoTokenizer's path then names the bad file)."""
    try:
        return json.loads((path / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError):
        return None


def load_tokenizer(path: Path):
    """The HF tokenizer of a model directory (offline, no remote code)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        raise FileNotFoundError(
            f"{path}: no tokenizer.json or tokenizer_config.json; pass skip_tokenizer_init=True "
            "to use token ids only"
        )
    try:
        if (path / "tokenizer.json").is_file() and _tokenizer_class(path) in FAST_TOKENIZER_CLASSES:
            from transformers import PreTrainedTokenizerFast

            return PreTrainedTokenizerFast.from_pretrained(str(path))
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)
    except Exception as e:  # a corrupt file: name it (the library's message rarely does)
        files = [path / f for f in ("tokenizer.json", "tokenizer_config.json")
                 if (path / f).is_file()]
        for file in files:
            try:
                json.loads(file.read_text())
            except (UnicodeDecodeError, json.JSONDecodeError) as bad:
                raise ValueError(f"{file}: cannot load the tokenizer: not valid JSON: "
                                 f"{bad}") from None
        named = " or ".join(str(f) for f in files)
        raise ValueError(f"{named}: cannot load the tokenizer: {type(e).__name__}: {e}") from None


def build_scheduler(config: EngineConfig, limits: Limits, cfg: ModelSpec,
                    allocator: PageAllocator, slots: RequestSlots, table: SlotTable) -> Scheduler:
    """The scheduler, its prefix cache (``scheduler.cache``) and schedule policy."""
    cache = (RadixCache if config.enable_radix_cache else NoPrefixCache)(allocator)
    policy = SchedulePolicy(config.schedule_policy, cache, lpm_max_queue=config.lpm_max_queue,
                            seed=config.seed)
    limits = SchedulerLimits(
        max_running=limits.max_running_requests, max_prefill_tokens=limits.max_prefill_tokens,
        chunk_tokens=limits.chunked_prefill_size, mixed=limits.mixed,
        retract_policy=config.retract_policy, force_retract_every=config.force_retract_every,
        exact_ignore_eos=config.exact_ignore_eos_admission)
    init_ratio = min(config.init_new_token_ratio * config.schedule_conservativeness, 1.0)
    ratio = NewTokenRatio(init_ratio, min(init_ratio * config.min_new_token_ratio_factor, 1.0),
                          config.new_token_ratio_decay_steps, config.retract_decode_steps)
    return Scheduler(allocator=allocator, slots=slots, table=table, cache=cache, policy=policy,
                     limits=limits, ratio=ratio, eos_ids=cfg.eos_token_ids)


def step_tokens(limits: Limits, context_length: int) -> int:
    """The most new tokens one step can carry: one prompt runs whole without chunking; with it,
    a chunk (and, mixing, the decode tokens that ride along)."""
    tokens = max(limits.max_prefill_tokens, context_length)
    if limits.chunked_prefill_size is not None:
        mixed_decoders = limits.max_running_requests if limits.mixed else 0
        tokens = min(limits.chunked_prefill_size, tokens + mixed_decoders)
    return tokens
