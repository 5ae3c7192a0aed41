"""The model protocol: what a decoder provides so that the engine can serve it.

The engine keeps the layer loop (see :func:`forward`); a model provides three pure pieces:

* ``embed(ids, positions) -> h``: the hidden states [T, hidden] of T new tokens;
* ``layer(params, h, attn) -> (h, attn)``: one decoder layer. ``params``: that layer's weights
  (a pytree of arrays, ``model.layers[i]``'s state as a pure dict); ``attn``: a functional
  attention object (:mod:`minijax_serve.attention.layer`) the layer calls exactly once,
  ``o, attn = attn(q, k, v)``, and returns; ``attn.positions`` are the tokens' positions;
* ``head(h, indices) -> logits``: float32 logits [len(indices), vocab] of the rows ``indices``
  of ``h`` (the engine asks only for the rows it samples from);

and ``layers``: a sequence of the per-layer weights (NNX modules, ``nnx.Dict`` s or pytrees of
arrays), one structure for every layer. Any NNX module with these is a :class:`DecoderModel`.
For tensor parallelism it also states how its weights split: ``partition_spec(path) ->
PartitionSpec`` over the mesh axis ``"tp"`` (``path``: the weight's place in
``nnx.state(model)``, e.g. ``("layers", 0, "wq")``); without it, it runs on one device. The
engine traces the model under the mesh's abstract mesh, so the model may place an activation
with ``jax.lax.with_sharding_constraint(x, PartitionSpec(...))``; the logits leave the step
split by vocabulary where tp divides it, else whole (the engine places them either way).

Under the ``"scan"`` layer loop (the CPU default) one compiled body serves every layer, and a
weight of two or more dimensions reaches ``layer`` as a :class:`LayerWeight`: ``x @ w`` runs a
``lax.switch`` over the layers that multiplies by that layer's matrix where it lies (slicing
matrices stacked along a layer axis copied them every layer of every step). Use such weights
as the right operand of ``@`` only; vectors (norms, biases) arrive as arrays. Under
``"unroll"`` (the GPU default) every layer reads its own arrays.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Protocol, Sequence, runtime_checkable

import jax
import jax.numpy as jnp
from flax import nnx

from minijax_serve.attention.layer import DenseAttention, PagedAttention

Params = Any  # a pytree of arrays (or LayerWeight s)


@runtime_checkable
class DecoderModel(Protocol):
    """What the engine serves: ``embed``, one ``layer`` per entry of ``layers``, ``head``."""

    layers: Sequence[Any]

    def embed(self, ids: jax.Array, positions: jax.Array) -> jax.Array:
        """The hidden states [T, hidden] of T new tokens ``ids`` at ``positions``."""

    def layer(self, params: Params, h: jax.Array, attn: Any) -> tuple[jax.Array, Any]:
        """One decoder layer with weights ``params``; calls ``attn(q, k, v)`` once and returns
        (its output h, the attention object that call returned)."""

    def head(self, h: jax.Array, indices: jax.Array) -> jax.Array:
        """Float32 logits [len(indices), vocab] of the rows ``indices`` of ``h``."""


class LayerWeight:
    """Layer ``index``'s matrix among ``per_layer`` (one per layer), inside the scan: ``x @ w``
    multiplies by it in place, through a ``lax.switch`` over the layers."""

    def __init__(self, index: jax.Array, per_layer: Sequence[jax.Array]):
        self.index, self.per_layer = index, list(per_layer)
        self.shape, self.dtype = per_layer[0].shape, per_layer[0].dtype
        self.ndim = len(self.shape)

    def apply(self, fn, x: jax.Array) -> jax.Array:
        """``fn(w, x)`` with this layer's matrix ``w``, through the switch over the layers (an
        FP8 weight's product, :func:`minijax_serve.models.quantize.linear`)."""
        branches = [functools.partial(fn, w) for w in self.per_layer]
        return jax.lax.switch(self.index, branches, x)

    def __rmatmul__(self, x: jax.Array) -> jax.Array:
        return self.apply(lambda w, x: x @ w, x)

    def __repr__(self) -> str:
        return (f"LayerWeight({self.shape}, {self.dtype}): a layer's weight matrix under the "
                "engine's scan over layers; use it as the right operand of `x @ w`")


def layer_params(model: DecoderModel) -> list[Params]:
    """Each layer's weights as a pytree of arrays (an NNX module's state as a pure dict)."""
    def arrays(layer):
        if isinstance(layer, nnx.Pytree):
            return nnx.to_pure_dict(nnx.state(layer))
        return layer
    return [arrays(layer) for layer in model.layers]


def forward(model: DecoderModel, ids: jax.Array, attn: PagedAttention, indices: jax.Array,
            layer_loop: str = "scan") -> tuple[jax.Array, PagedAttention]:
    """The engine's model step: embed, every layer (``"scan"``: one compiled body, the pools in
    its carry; ``"unroll"``: the layers written out), head. Returns the logits of the rows
    ``indices`` and the attention object holding the updated pools."""
    if layer_loop not in ("scan", "unroll"):
        raise ValueError(f"layer_loop must be 'scan' or 'unroll', got {layer_loop!r}")
    params = layer_params(model)
    h = model.embed(ids, attn.positions)
    if layer_loop == "unroll":
        for i, p in enumerate(params):
            h, attn = model.layer(p, h, dataclasses.replace(attn, layer=i))
        return model.head(h, indices), attn
    leaves, treedef = zip(*(jax.tree.flatten(p) for p in params))
    big = [jnp.ndim(x) >= 2 for x in leaves[0]]
    small = [jnp.stack([layer[j] for layer in leaves]) for j in range(len(big)) if not big[j]]

    def body(carry, xs):
        h, k_pool, v_pool = carry
        index, vectors = xs
        vectors = iter(vectors)
        flat = [LayerWeight(index, [layer[j] for layer in leaves]) if big[j] else next(vectors)
                for j in range(len(big))]
        layer_attn = dataclasses.replace(attn, k_pool=k_pool, v_pool=v_pool, layer=index)
        h, out = model.layer(jax.tree.unflatten(treedef[0], flat), h, layer_attn)
        return (h, out.k_pool, out.v_pool), None

    (h, k_pool, v_pool), _ = jax.lax.scan(body, (h, attn.k_pool, attn.v_pool),
                                          (jnp.arange(len(params)), small))
    return model.head(h, indices), dataclasses.replace(attn, k_pool=k_pool, v_pool=v_pool)


def dense_forward(model: DecoderModel, ids: jax.Array) -> jax.Array:
    """The model's own reference forward over one sequence: its layers in a Python loop with
    :class:`DenseAttention` (no cache, full causal attention); float32 logits [T, vocab]."""
    ids = jnp.asarray(ids, jnp.int32)
    positions = jnp.arange(ids.shape[0], dtype=jnp.int32)
    attn = DenseAttention(positions)
    h = model.embed(ids, positions)
    for p in layer_params(model):
        h, attn = model.layer(p, h, attn)
    return model.head(h, positions)


def dense_greedy(model: DecoderModel, prompts: Sequence[Sequence[int]],
                 max_new_tokens: int) -> list[list[int]]:
    """``max_new_tokens`` greedy tokens of each prompt from :func:`dense_forward` (a reference
    to check the engine's tokens against, not a server). Every sequence is padded to the
    longest final length, so one compiled forward serves every token: causal attention keeps
    the padding out of the rows before it."""
    length = max(map(len, prompts)) + max_new_tokens
    run = jax.jit(lambda padded, row: dense_forward(model, padded)[row])
    outs = []
    for prompt in prompts:
        ids = list(prompt)
        for _ in range(max_new_tokens):
            padded = jnp.asarray(ids + [0] * (length - len(ids)), jnp.int32)
            ids.append(int(jnp.argmax(run(padded, len(ids) - 1))))
        outs.append(ids[len(prompt):])
    return outs
