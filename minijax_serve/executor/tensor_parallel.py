"""Tensor parallelism over a ``jax.sharding.Mesh`` with one axis, ``"tp"`` (single controller).

The weights are placed Megatron-style by the partition specs the model states
(``model.partition_spec(path)``; the built-in decoder's: q/k/v and gate/up split by output,
o and down by input, the embedding and the LM head by vocabulary, the norms replicated) and
XLA's SPMD partitioner inserts the collectives: an all-reduce after each input-split product and
after the embedding lookup. The logits leave the model split by vocabulary where tp divides it
(:func:`logits_sharding`): a greedy sampler takes each device's argmax and gathers only those
([S, tp] values and ids), other samplers and the logprobs program gather the logits whole. The
KV pools are split over KV heads; attention runs per device under ``shard_map``
(:class:`~minijax_serve.attention.layer.PagedAttention` with a mesh), so the kernels see only
their local heads. Everything else (the packed batch, the token buffer, the sampled tokens) is
replicated: every device holds the same tokens.

When tp exceeds the KV heads, each KV head is replicated over ``tp // num_kv_heads`` devices
(its K/V projection columns repeated, :func:`replicate_kv_heads`), as vLLM does; a vocabulary
tp does not divide is padded with zero rows (:func:`pad_vocab`), whose logits the head drops.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from minijax_serve.attention.layer import TP_AXIS
from minijax_serve.models.config import ModelSpec
from minijax_serve.models.decoder import DecoderLM

POOL_SPEC = P(None, TP_AXIS, None, None, None)  # [layers, kv_heads, pages, page_size, D]
SCALES_SPEC = P(None, TP_AXIS)  # FP8 pools' scales [layers, kv_heads]


class TPLayout(NamedTuple):
    mesh: Mesh
    size: int
    kv_replicas: int  # devices holding each KV head


def kv_replicas(spec: ModelSpec, tp: int) -> int:
    """How many devices hold each KV head; ValueError for head counts tp cannot split."""
    if spec.num_heads % tp:
        raise ValueError(f"tensor_parallel_size={tp} does not divide num_heads={spec.num_heads}")
    kv = spec.num_kv_heads
    if kv % tp and tp % kv:
        raise ValueError(f"tensor_parallel_size={tp} and num_kv_heads={kv}: neither divides the "
                         "other, so the KV heads can be neither split nor replicated evenly")
    return max(1, tp // kv)


def layout(spec: ModelSpec, tp: int) -> TPLayout:
    devices = jax.devices()
    if tp > len(devices):
        raise ValueError(f"tensor_parallel_size={tp} exceeds the {len(devices)} devices "
                         f"available ({jax.default_backend()})")
    replicas = kv_replicas(spec, tp)
    return TPLayout(Mesh(np.array(devices[:tp]), (TP_AXIS,)), tp, replicas)


def logits_sharding(mesh: Mesh, vocab_size: int) -> NamedSharding:
    """How a step's logits [S, vocab] leave the model: split by vocabulary where the mesh's size
    divides it (a program's arguments cannot be split unevenly), else whole on every device."""
    return NamedSharding(mesh, P(None, TP_AXIS) if vocab_size % mesh.size == 0 else P())


def replicate_kv_heads(model: Any, replicas: int) -> Any:
    """A copy of the built-in decoder with each KV head repeated ``replicas`` times (its wk/wv
    columns, bk/bv entries and, FP8, the columns' scales): the same function, with num_kv_heads * replicas heads that tp
    splits (the caller's model is left as it was)."""
    if replicas == 1:
        return model
    model = nnx.clone(model)
    cfg = model.cfg
    d = cfg.head_dim
    for layer in model.layers:
        for name in ("wk", "wv", "bk", "bv", "wk_scale", "wv_scale"):  # scales: FP8 weights
            if name in layer:
                w = layer[name][...]
                heads = w.reshape(*w.shape[:-1], cfg.num_kv_heads, d)
                layer[name] = nnx.Param(jnp.repeat(heads, replicas, axis=-2).reshape(
                    *w.shape[:-1], cfg.num_kv_heads * replicas * d))
    model.cfg = dataclasses.replace(cfg, num_kv_heads=cfg.num_kv_heads * replicas)
    return model


def served_module(module: Any, cfg: ModelSpec, tp: TPLayout) -> tuple[Any, ModelSpec]:
    """``module`` as a runner on ``tp``'s mesh serves it, and its config: each KV head
    replicated ``tp.kv_replicas`` times (the built-in decoder only), the vocabulary padded to a
    multiple of tp."""
    if tp.kv_replicas > 1:
        if not isinstance(module, DecoderLM):
            raise ValueError(f"tensor_parallel_size={tp.size} exceeds num_kv_heads="
                             f"{cfg.num_kv_heads}: KV heads are replicated for the built-in "
                             "decoder only")
        module = replicate_kv_heads(module, tp.kv_replicas)
        cfg = module.cfg
    return (pad_vocab(module, tp.size) if isinstance(module, DecoderLM) else module), cfg


def pad_vocab(model: Any, tp: int) -> Any:
    """A copy of the built-in decoder whose embedding rows (and untied LM-head columns) are
    padded with zeros to a multiple of ``tp``, so that both split by vocabulary; the config
    keeps the true vocabulary, no id reaches a padded row, and the head drops the padded
    columns' logits (the caller's model is left as it was)."""
    vocab = model.embed_tokens.shape[0]
    pad = -vocab % tp
    if pad == 0:
        return model
    model = nnx.clone(model)
    model.embed_tokens = nnx.Param(jnp.pad(model.embed_tokens[...], ((0, pad), (0, 0))))
    if not model.cfg.tie_word_embeddings:
        model.lm_head = nnx.Param(jnp.pad(model.lm_head[...], ((0, 0), (0, pad))))
    return model


def param_shardings(model: Any, params: nnx.State, tp: TPLayout) -> list[NamedSharding]:
    """One NamedSharding per leaf of ``jax.tree.leaves(params)``, from the model's specs;
    ValueError for a model that states none, or a split dimension tp does not divide."""
    if not callable(getattr(model, "partition_spec", None)):
        if tp.size == 1:
            return [NamedSharding(tp.mesh, P())] * len(jax.tree.leaves(params))
        raise ValueError(f"tensor_parallel_size={tp.size}: the model states no partition specs "
                         "(a partition_spec(path) method, see minijax_serve.models.protocol); "
                         "it runs at tensor_parallel_size=1 only")
    shardings = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        names = tuple(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))) for k in path)
        names = names[:-1] if names and names[-1] == "value" else names
        spec = model.partition_spec(names) or P()
        for dim, axis in enumerate(spec):
            if axis == TP_AXIS and leaf.shape[dim] % tp.size:
                raise ValueError(f"tensor_parallel_size={tp.size} does not divide dimension {dim} "
                                 f"({leaf.shape[dim]}) of weight {'.'.join(map(str, names))}")
        shardings.append(NamedSharding(tp.mesh, spec))
    return shardings


def replicated(tp: TPLayout) -> NamedSharding:
    return NamedSharding(tp.mesh, P())
