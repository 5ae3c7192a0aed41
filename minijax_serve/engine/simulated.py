"""What a simulated engine builds instead of a model: the model's config (no weights are loaded),
its tokenizer, the cost model that runs its steps in the dtypes asked for, and the limits
sized from the device profile as the real engine sizes them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax.numpy as jnp

from minijax_serve.attention.kv_cache import kv_dtype
from minijax_serve.config import EngineConfig
from minijax_serve.core.clock import VirtualClock
from minijax_serve.engine.model_source import (ModelArg, ServedModel, checked_tokenizer,
                                               model_tokenizer)
from minijax_serve.engine.limits import (DeviceMemory, Limits, resolve_limits,
                                         slot_row_bytes)
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


def weight_bytes_per_device(cfg: ModelConfig, itemsize: int, tp: int, kv_replicas: int,
                            quantized: bool = False) -> float:
    """As the engine places them: the layers split over ``tp`` devices (each K/V projection
    repeated ``kv_replicas`` times when tp exceeds the KV heads), the embedding and LM head
    split by vocabulary (padded to a multiple of tp); the norms and the biases added after an
    input-split product replicated. ``quantized``: the layers' matrices in FP8 (a byte each)
    with a float32 scale per output column, split with their columns (o's and down's whole)."""
    h, L, i = cfg.hidden_size, cfg.num_layers, cfg.intermediate_size
    tables = 1 if cfg.tie_word_embeddings else 2
    vocab_rows = -(-cfg.vocab_size // tp) * h * tables  # one device's share
    replicated = L * (2 * h + 2 * cfg.head_dim * cfg.qk_norm + h * cfg.o_bias + h * cfg.mlp_bias) + h
    matrices = L * cfg.layer_matrix_params()
    biases = cfg.num_params() - cfg.vocab_size * h * tables - replicated - matrices  # split
    matrices += L * 2 * h * cfg.kv_size * (kv_replicas - 1)
    if not quantized:
        return ((matrices + biases) / tp + vocab_rows + replicated) * itemsize
    split_scales = L * (cfg.q_size + 2 * cfg.kv_size * kv_replicas + 2 * i)
    return ((matrices + 4 * split_scales + biases * itemsize) / tp
            + (vocab_rows + replicated) * itemsize + 4 * L * 2 * h)


def simulated_limits(config: EngineConfig, cfg: ModelConfig, profile: DeviceProfile, dtype,
                     context_length: int, tp: int, kv_replicas: int) -> Limits:
    """The limits the real engine would size on that device (:func:`~minijax_serve.engine.
    limits.resolve_limits`): its pool from the memory JAX may allocate
    (``profile.usable_memory``) less the weights, in tokens of K and V (1/tp of each token's
    heads per device, replicated ones included; a byte an element with an FP8 KV cache;
    FP8 weights with ``config.quantization``)."""
    itemsize = jnp.dtype(dtype).itemsize
    weights = weight_bytes_per_device(cfg, itemsize, tp, kv_replicas,
                                      config.quantization is not None)
    free = profile.usable_memory(tp) - weights
    kv_itemsize = kv_dtype(config.kv_cache_dtype, dtype).itemsize
    per_token = cfg.kv_bytes_per_token(kv_itemsize) * kv_replicas / tp
    if not config.max_total_tokens and free * config.mem_fraction_static < per_token * config.page_size:
        raise ValueError(f"simulate={profile.name!r}: {weights / 1e9:.1f} GB of weights per "
                         f"device leave no room for a KV pool in its "
                         f"{profile.usable_memory(tp) / 1e9:.0f} GB; raise tensor_parallel_size")
    memory = DeviceMemory(profile.platform, profile.memory_bytes, free,
                          tp if profile.platform == "cpu" else 1)
    return resolve_limits(config, memory, per_token, context_length, kv_itemsize,
                          slot_row_bytes(cfg.vocab_size))


def simulated_runner(config: EngineConfig, cfg: ModelConfig, profile: DeviceProfile, dtype,
                     tp: int, clock: VirtualClock, tokenizer: Any,
                     context_length: int) -> tuple[SimulatedRunner, Limits]:
    """The runner of a simulated engine (a cost model of ``tp`` devices of ``profile``, its
    weights and KV in the dtypes ``config`` asks for) and its limits."""
    replicas = kv_replicas(cfg, tp)
    cost = CostModel(profile, cfg, dtype, tp, replicas, config.quantization,
                     kv_dtype(config.kv_cache_dtype, dtype))
    token_range = min(cfg.vocab_size, len(tokenizer)) if tokenizer else cfg.vocab_size
    runner = SimulatedRunner(cost, clock, token_range, cfg.eos_token_ids, config.max_logprobs)
    return runner, simulated_limits(config, cfg, profile, dtype, context_length, tp, replicas)
