"""The served model for training: its full-sequence forward, differentiable, over a batch.

A trainer in the engine's process takes ``engine.model`` (the served model as a plain NNX
module, over the engine's own arrays), computes a loss from :func:`token_logprobs` under
``nnx.value_and_grad``, steps an optimizer and serves the result with
``engine.update_weights(nnx.state(model))`` (docs/rl.md). The forward is the model's own layer
code under :class:`~minijax_serve.DenseAttention` (:func:`~minijax_serve.dense_forward`): one
definition for serving and training.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from minijax_serve.models.protocol import DecoderModel, dense_forward


def token_logprobs(model: DecoderModel, ids: jax.Array) -> jax.Array:
    """Float32 log-probabilities [B, T - 1] of the tokens ``ids[:, 1:]``, each given the tokens
    before it (``ids`` [B, T], one sequence per row). Attention is causal, so padding after a
    sequence's end changes none of its own entries: mask those positions in the loss."""
    def one(seq: jax.Array) -> jax.Array:
        logprobs = jax.nn.log_softmax(dense_forward(model, seq)[:-1], axis=-1)
        return jnp.take_along_axis(logprobs, seq[1:, None], axis=-1)[:, 0]

    return jax.vmap(one)(jnp.asarray(ids, jnp.int32))
