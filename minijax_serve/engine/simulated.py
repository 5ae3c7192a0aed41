"""What a simulated engine builds instead of a model: the model's config (no weights are loaded),
its tokenizer, a runner that costs steps on the device profile, and a KV pool sized from the
profile."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax.numpy as jnp

from minijax_serve.config import EngineConfig
from minijax_serve.engine.model_source import (ModelArg, ServedModel, checked_tokenizer,
                                               model_tokenizer)
from minijax_serve.engine.setup import pool_from_free_memory
from minijax_serve.executor.tensor_parallel import kv_replicas
from minijax_serve.models.config import ModelConfig, ModelSpec, load_model_config
from minijax_serve.models.registry import resolve_model
from minijax_serve.simulate.cost_model import CostModel
from minijax_serve.simulate.profiles import DeviceProfile
from minijax_serve.simulate.runner import SimulatedRunner


def simulated_model(model: ModelArg, config: EngineConfig, model_config: ModelSpec | None,
                    tokenizer: Any) -> ServedModel:
    """A ServedModel without a module: the config of a named model (an alias or a directory:
    only its config.json and tokenizer are read) or ``model_config`` for a model object (which
    is neither called nor checked); ``tokenizer`` replaces the model's own."""
    if isinstance(model, (str, Path)):
        if model_config is not None:
            raise ValueError("model_config= goes with a model object; a model name or "
                             f"directory ({model!r}) brings its own")
        resolved = resolve_model(model)
        cfg = load_model_config(resolved.path)
        return ServedModel(None, cfg, model_tokenizer(resolved, config, cfg, tokenizer), 0.0)
    if not isinstance(model_config, ModelSpec):
        raise ValueError("model_config: a model object needs a ModelConfig that describes it, "
                         f"got {type(model_config).__name__}")
    return ServedModel(None, model_config, checked_tokenizer(tokenizer, model_config, config), 0.0)


def weight_bytes_per_device(cfg: ModelConfig, itemsize: int, tp: int, kv_replicas: int) -> float:
    """As the engine places them: the layers split over ``tp`` devices (each K/V projection
    repeated ``kv_replicas`` times when tp exceeds the KV heads), the embedding and LM head
    split by vocabulary (padded to a multiple of tp); the norms and the biases added after an
    input-split product replicated."""
    h, L = cfg.hidden_size, cfg.num_layers
    tables = 1 if cfg.tie_word_embeddings else 2
    vocab_rows = -(-cfg.vocab_size // tp) * h * tables  # one device's share
    replicated = L * (2 * h + 2 * cfg.head_dim * cfg.qk_norm + h * cfg.o_bias + h * cfg.mlp_bias) + h
    kv_weights = L * 2 * h * cfg.kv_size
    split = cfg.num_params() - cfg.vocab_size * h * tables - replicated
    return ((split + kv_weights * (kv_replicas - 1)) / tp + vocab_rows + replicated) * itemsize


def pool_tokens(config: EngineConfig, cfg: ModelConfig, profile: DeviceProfile, dtype,
                context_length: int, tp: int, kv_replicas: int) -> int:
    """``max_total_tokens``, or as the real engine sizes its pool on that device:
    ``mem_fraction_static`` of the memory JAX may allocate (``profile.usable_memory``) less the
    weights, in tokens of K and V (1/tp of each token's heads per device, replicated ones
    included), at most every request slot's whole context."""
    if config.max_total_tokens:
        return config.max_total_tokens
    itemsize = jnp.dtype(dtype).itemsize
    weights = weight_bytes_per_device(cfg, itemsize, tp, kv_replicas)
    free = profile.usable_memory(tp) - weights
    per_token = cfg.kv_bytes_per_token(itemsize) * kv_replicas / tp
    if free * config.mem_fraction_static < per_token * config.page_size:
        raise ValueError(f"simulate={profile.name!r}: {weights / 1e9:.1f} GB of weights per "
                         f"device leave no room for a KV pool in its "
                         f"{profile.usable_memory(tp) / 1e9:.0f} GB; raise tensor_parallel_size")
    return pool_from_free_memory(config, free, per_token, context_length)


def simulated_runner(config: EngineConfig, cfg: ModelConfig, profile: DeviceProfile, dtype,
                     clock: Any, tokenizer: Any,
                     context_length: int) -> tuple[SimulatedRunner, int]:
    """No device: the cost model of ``tensor_parallel_size`` devices of ``profile`` driving a
    :class:`SimulatedRunner` (dummy ids below the vocabulary, or a smaller tokenizer's size),
    and the pool's pages sized from the profile's memory."""
    tp = config.tensor_parallel_size
    replicas = kv_replicas(cfg, tp)
    cost = CostModel(profile, cfg, dtype, tp, replicas)
    token_range = min(cfg.vocab_size, len(tokenizer)) if tokenizer else cfg.vocab_size
    runner = SimulatedRunner(cost, clock, token_range, cfg.eos_token_ids, config.max_logprobs)
    tokens = pool_tokens(config, cfg, profile, dtype, context_length, tp, replicas)
    return runner, tokens // config.page_size + 1  # + scratch
