"""Rejection sampling of drafts (Leviathan et al. 2023, Chen et al. 2023), on the device.

A draft ``d`` drawn from the draft model's distribution ``q`` is accepted with probability
``min(1, p(d) / q(d))``, ``p`` the target's distribution at that position (temperature, top-k,
top-p, min-p and banned tokens applied, as the plain sampler draws from); at the first rejection
the token is drawn from the residual ``max(p - q, 0)``, renormalised; after the last accepted
draft the next token is drawn from ``p``. The output then has exactly the target's distribution.
Each row's randomness is a pure function of the request's seed and the position (the uniform,
and the residual's Gumbel noise, which is the plain sampler's noise for that position; the
draft was drawn with noise of another seed), so a seeded request repeats.

A point-mass proposal (an n-gram's, or a greedy draft) is the case ``q = δ_d``: accept ``d``
with probability ``p(d)``, else draw from ``p`` without ``d``. Drawing the position's token ``x``
with the plain sampler and accepting ``d`` iff ``x = d`` does exactly that; that is the rule
for those rows, and their tokens are then the plain sampler's, token for token.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from minijax_serve.executor.forward_batch import unpack_sampling
from minijax_serve.executor.sampler import gumbel_argmax, probabilities, uniform
from minijax_serve.executor.step_functions import ban, sampling_arrays


def target_probabilities(num_rows: int, logits: jax.Array, front: jax.Array) -> jax.Array:
    """The distribution each of ``num_rows`` rows samples from (its fields in ``front``, a
    packed sampling front), [num_rows, V] float32."""
    f = unpack_sampling(front, num_rows)
    return probabilities(ban(logits, f["banned"]), sampling_arrays(f))


@jax.jit(static_argnums=0)
def verify_rows(num_rows: int, logits: jax.Array, front: jax.Array, drafts: jax.Array,
                use_q: jax.Array, q_index: jax.Array, sampled: jax.Array,
                *q_steps: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(token, accepted) per row of a verify step: ``drafts`` [T] the draft each row's
    distribution judges (-1: none, the row after a sequence's last draft), ``sampled`` [T] the
    plain sampler's token of each row; rows with ``use_q`` [T] judge their draft by rejection
    against ``q_steps[i][j]`` (the draft step ``i``'s distribution of sequence ``j``, ``q_index``
    [T, 2]), the others by ``sampled == draft``. The token of a row is its draft if accepted,
    else the residual's (``use_q``) or the sampled one."""
    f = unpack_sampling(front, num_rows)
    p = target_probabilities(num_rows, logits, front)
    q = jnp.stack(q_steps)[q_index[:, 0], q_index[:, 1]]
    has = drafts >= 0
    d = jnp.maximum(drafts, 0)[:, None]
    p_d, q_d = (jnp.take_along_axis(x, d, axis=1)[:, 0] for x in (p, q))
    judged = uniform(f["seed"], f["kv_lens"]) * q_d < p_d
    accepted = has & jnp.where(use_q, judged, sampled == drafts)
    residual = gumbel_argmax(jnp.log(jnp.maximum(p - q, 0.0)), f["seed"], f["kv_lens"])
    token = jnp.where(has & use_q, jnp.where(accepted, drafts, residual), sampled)
    return token, accepted
