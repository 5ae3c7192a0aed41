"""Weights in place, on the runner's side: the served model's weights as callers see them and
as the :class:`~minijax_serve.executor.model_runner.ModelRunner` holds them, new weights checked
and placed on the mesh, and the KV pools released and rebuilt (``Engine.sleep`` / ``wake_up``).

Callers see the model they gave (or the checkpoint's): its NNX state, named like the load
cache's weights (``"embed_tokens"``, ``"layers.0.wq"``, ...). The runner holds the same arrays
as a flat list placed by the model's partition specs; only where tensor parallelism transformed
the built-in decoder (KV heads replicated beyond their count, a vocabulary padded to a multiple
of tp: :mod:`minijax_serve.executor.tensor_parallel`) do the two differ, and arrays move
between the forms by slicing or padding (copies). New weights of the same names, shapes and
dtypes run the programs already compiled: nothing recompiles.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from minijax_serve.executor.processes import place
from minijax_serve.executor.tensor_parallel import pad_vocab, replicate_kv_heads
from minijax_serve.models.config import ModelSpec
from minijax_serve.models.decoder import DecoderLM


def _key(entry: Any) -> str:
    return str(getattr(entry, "key", getattr(entry, "name", getattr(entry, "idx", entry))))


def named_leaves(tree: Any) -> dict[str, Any]:
    """The arrays of a model's weights by name (``"layers.0.wq"``): ``tree`` is an NNX module,
    its state, a nested dict of arrays (``nnx.to_pure_dict``) or a flat ``{name: array}``."""
    if isinstance(tree, nnx.Module):
        tree = nnx.state(tree)
    if isinstance(tree, nnx.State):
        tree = nnx.to_pure_dict(tree)
    if not isinstance(tree, Mapping):
        raise ValueError(f"params must be the model's weights (an NNX state, a nested dict or a "
                         f"{{name: array}} dict), got {type(tree).__name__}")
    named = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        names = [_key(entry) for entry in path]
        named[".".join(names[:-1] if names[-1:] == ["value"] else names)] = leaf
    return named


def _names(tree: Any) -> list[str]:
    """The weights' names in ``jax.tree.leaves(tree)`` order (``tree``: an NNX state)."""
    names = []
    for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]:
        keys = [_key(entry) for entry in path]
        names.append(".".join(keys[:-1] if keys[-1:] == ["value"] else keys))
    return names


class WeightLayout:
    """The served model's weights (its form) over a runner's (TP's form), for checking,
    placing and viewing them."""

    def __init__(self, runner: Any, spec: ModelSpec, kv_replicas: int):
        self.runner, self.spec, self.kv_replicas = runner, spec, kv_replicas
        self.shardings = [p.sharding for p in runner.params]
        module = self.runner_module()
        self.transformed = isinstance(module, DecoderLM) and (
            kv_replicas > 1 or module.embed_tokens.shape[0] != spec.vocab_size)
        served = nnx.eval_shape(lambda: self.served(module)) if self.transformed else module
        self.served_graphdef, state = nnx.split(served)
        self._served_tree = jax.tree.structure(state)
        assert self.transformed or self._served_tree == runner.param_tree
        self.expected = {name: jax.ShapeDtypeStruct(np.shape(x), x.dtype)
                         for name, x in zip(_names(state), jax.tree.leaves(state))}

    def runner_module(self) -> nnx.Module:
        """The model as the runner runs it, over the runner's own arrays."""
        runner = self.runner
        return nnx.merge(runner.graphdef, jax.tree.unflatten(runner.param_tree, runner.params))

    def served(self, module: nnx.Module) -> nnx.Module:
        """``module`` (the runner's form) in the served model's form: itself unless TP
        transformed it, else a copy without the replicated KV heads and the padded rows."""
        if not self.transformed:
            return module
        model, r = nnx.clone(module), self.kv_replicas
        cfg, vocab = model.cfg, self.spec.vocab_size
        kv = cfg.num_kv_heads // r
        model.embed_tokens = nnx.Param(model.embed_tokens[...][:vocab])
        if not cfg.tie_word_embeddings:
            model.lm_head = nnx.Param(model.lm_head[...][:, :vocab])
        for layer in model.layers if r > 1 else ():
            for name in ("wk", "wv", "bk", "bv"):
                if name in layer:
                    w = layer[name][...]
                    heads = w.reshape(*w.shape[:-1], kv * r, cfg.head_dim)[..., ::r, :]
                    layer[name] = nnx.Param(heads.reshape(*w.shape[:-1], kv * cfg.head_dim))
        model.cfg = dataclasses.replace(cfg, num_kv_heads=kv)
        return model

    def check(self, params: Any) -> list[Any]:
        """``params``' arrays in the served model's order; ValueError naming the first weight
        missing, unexpected, or of another shape or dtype than the served model's."""
        given = named_leaves(params)
        for name, want in self.expected.items():
            if name not in given:
                raise ValueError(f"params: weight {name!r} is missing (the model's weights "
                                 f"are {len(self.expected)}, named as in nnx.state(engine.model))")
            got = given[name]
            if tuple(np.shape(got)) != want.shape:
                raise ValueError(f"params: weight {name!r} has shape {tuple(np.shape(got))}, "
                                 f"the served model's is {want.shape}")
            dtype = getattr(got, "dtype", type(got).__name__)
            if dtype != want.dtype:
                raise ValueError(f"params: weight {name!r} has dtype {dtype}, the served "
                                 f"model's is {want.dtype}")
        extra = [name for name in given if name not in self.expected]
        if extra:
            raise ValueError(f"params: unexpected weight {extra[0]!r}: the served model has "
                             "no weight of that name")
        return [given[name] for name in self.expected]

    def placed(self, leaves: list[Any]) -> list[jax.Array]:
        """Checked leaves (the served order) in the runner's form, each placed by the
        runner's sharding: an array placed so already is taken as it is (no copy)."""
        if self.transformed:
            module = nnx.merge(self.served_graphdef, jax.tree.unflatten(self._served_tree, leaves))
            module = pad_vocab(replicate_kv_heads(module, self.kv_replicas), self.runner.mesh.size)
            leaves, tree = jax.tree.flatten(nnx.state(module))
            assert tree == self.runner.param_tree, "the TP transforms changed the weights' tree"
        return [place(x, s) for x, s in zip(leaves, self.shardings)]


class PoolSpec(NamedTuple):
    """What the released KV pools were, to rebuild them alike (so the programs still fit)."""

    shape: tuple[int, ...]
    dtype: Any
    sharding: jax.sharding.Sharding


def release_pools(runner: Any) -> PoolSpec:
    """Delete the runner's KV pools (and its token counts and logit bias rows, allocated again
    on first use): their device memory is free once this returns."""
    pool = runner.k_pool
    spec = PoolSpec(pool.shape, pool.dtype, pool.sharding)
    for x in (runner.k_pool, runner.v_pool, runner.token_counts, runner.logit_bias):
        if x is not None:
            x.delete()
    runner.k_pool = runner.v_pool = runner.token_counts = runner.logit_bias = None
    return spec


def restore_pools(runner: Any, spec: PoolSpec) -> None:
    """New zero KV pools like the released ones (same shape, dtype and sharding)."""
    runner.k_pool, runner.v_pool = (jnp.zeros(spec.shape, spec.dtype, device=spec.sharding)
                                    for _ in range(2))
