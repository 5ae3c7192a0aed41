"""On-device token sampling: greedy, temperature, top-k, top-p and min-p, batch-invariant;
repetition / frequency / presence penalties; log-probabilities of the chosen and top tokens.

``sample`` is traced into the engine's sampler programs (one per number of sequences, greedy and
not; see :mod:`minijax_serve.executor.model_runner`). Every row is sampled independently: its
random key is ``fold_in(key(seed), position)``, so a row's token depends only on its own seed,
position, logits and parameters, never on which other rows share the batch.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class SamplingArrays(NamedTuple):
    """Per-sequence sampling parameters, each of shape [S] (device or numpy arrays).

    temperature: float32, 0 means greedy (argmax).
    top_k: int32, -1 (or 0) means off.
    top_p: float32, 1.0 means off.
    min_p: float32, 0.0 means off.
    seed: uint32, the request's seed.
    position: int32, position of the token being sampled; folded into the row's key.
    """

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    min_p: jax.Array
    seed: jax.Array
    position: jax.Array


def _fmix32(h: jax.Array) -> jax.Array:
    """MurmurHash3's 32-bit finaliser: a bijective, well-mixing hash of uint32 values."""
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def _gumbel_noise(seed: jax.Array, position: jax.Array, vocab: int) -> jax.Array:
    """Gumbel noise [S, V] that is a pure function of (seed, position, token index).

    A counter-based hash rather than ``jax.random``: vmapped threefry keys cost ~0.5 s of
    compile time in every step shape, while this compiles to a few integer ops.
    """
    row = _fmix32(seed.astype(jnp.uint32) ^ _fmix32(position.astype(jnp.uint32) + jnp.uint32(0x9E3779B9)))
    col = _fmix32(jnp.arange(vocab, dtype=jnp.uint32) * jnp.uint32(0x27D4EB2F) + jnp.uint32(0x165667B1))
    bits = _fmix32(row[:, None] ^ col[None, :])
    u = ((bits >> 8).astype(jnp.float32) + 0.5) * jnp.float32(2.0**-24)
    # (2**24 - 1) + 0.5 rounds to 2**24 in float32: u would be 1 and the noise +inf, which
    # picks its token whatever its logit (-inf + inf is NaN, the argmax) about once per row in
    # 340 steps of a 49k vocabulary; the largest float32 below 1 instead
    u = jnp.minimum(u, jnp.float32(1.0 - 2.0**-24))  # in (0, 1)
    return -jnp.log(-jnp.log(u))


def _keep_mask(sorted_logits: jax.Array, params: SamplingArrays) -> jax.Array:
    """Which vocabulary ranks survive top-k, then top-p, then min-p; [S, V] bool, sorted order.

    ``sorted_logits`` holds each row's temperature-scaled logits in descending order. Top-p is
    measured on the distribution renormalised after top-k; min-p compares each probability with
    the top one, a ratio that renormalisation does not change. The top token is always kept.
    """
    vocab = sorted_logits.shape[-1]
    rank = jnp.arange(vocab, dtype=jnp.int32)[None, :]
    # Unnormalised probabilities relative to the top token (which gets exactly 1).
    rel = jnp.exp(sorted_logits - sorted_logits[:, :1])

    k = params.top_k.astype(jnp.int32)[:, None]
    keep_k = (k <= 0) | (rank < k)

    mass = jnp.where(keep_k, rel, 0.0)
    total = jnp.sum(mass, axis=-1, keepdims=True)
    before = (jnp.cumsum(mass, axis=-1) - mass) / total  # probability mass ranked above
    top_p = params.top_p.astype(jnp.float32)[:, None]
    keep_p = (top_p >= 1.0) | (before < top_p)

    keep_min = rel >= params.min_p.astype(jnp.float32)[:, None]
    return (keep_k & keep_p & keep_min) | (rank == 0)


def sample(logits: jax.Array, params: SamplingArrays, all_greedy: bool,
           truncated: bool = True) -> jax.Array:
    """Sample one token per row: logits [S, V] float32 -> token ids [S] int32.

    ``all_greedy`` is a static Python bool: when True, return the argmax only (no sort, no RNG).
    Otherwise rows with temperature 0 take the argmax (ties: lowest index) and the others sample
    from softmax(logits / temperature) restricted by top-k, top-p and min-p, using the Gumbel-max
    trick over one descending sort of the row. ``truncated``, static too, False when no row
    uses top-k, top-p or min-p (the host knows): the same draw without the sort, which cost
    1.7 s a step for 128 rows of SmolLM2's 49,152 tokens on a 2-core CPU (RESULTS.md).
    """
    logits = logits.astype(jnp.float32)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if all_greedy:
        return greedy

    temperature = params.temperature.astype(jnp.float32)
    is_greedy = temperature <= 0.0
    scaled = logits / jnp.where(is_greedy, 1.0, temperature)[:, None]
    gumbel = _gumbel_noise(params.seed, params.position, scaled.shape[-1])
    if not truncated:  # every token kept: the argmax of the noisy logits, unsorted
        return jnp.where(is_greedy, greedy, jnp.argmax(scaled + gumbel, axis=-1).astype(jnp.int32))

    sorted_logits, sorted_ids = jax.lax.top_k(scaled, scaled.shape[-1])
    keep = _keep_mask(sorted_logits, params)
    gumbel = jnp.take_along_axis(gumbel, sorted_ids, axis=-1)  # noise follows the token id
    score = jnp.where(keep, sorted_logits + gumbel, -jnp.inf)
    choice = jnp.argmax(score, axis=-1)
    sampled = jnp.take_along_axis(sorted_ids, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)
    return jnp.where(is_greedy, greedy, sampled)


def probabilities(logits: jax.Array, params: SamplingArrays) -> jax.Array:
    """The distribution :func:`sample` draws each non-greedy row from, [S, V] float32: the
    softmax of the temperature-scaled logits over the tokens top-k, top-p and min-p keep."""
    scaled = logits.astype(jnp.float32) / jnp.maximum(params.temperature, 1e-6)[:, None]
    sorted_logits, sorted_ids = jax.lax.top_k(scaled, scaled.shape[-1])
    kept = jnp.where(_keep_mask(sorted_logits, params), sorted_logits, -jnp.inf)
    rows = jnp.arange(scaled.shape[0])[:, None]
    return jnp.zeros_like(scaled).at[rows, sorted_ids].set(jax.nn.softmax(kept, axis=-1))


def gumbel_argmax(log_weights: jax.Array, seed: jax.Array, position: jax.Array) -> jax.Array:
    """A token per row drawn from softmax(``log_weights``) [S, V] with the noise :func:`sample`
    uses for that (seed, position): [S] int32."""
    noise = _gumbel_noise(seed, position, log_weights.shape[-1])
    return jnp.argmax(log_weights + noise, axis=-1).astype(jnp.int32)


def uniform(seed: jax.Array, position: jax.Array) -> jax.Array:
    """A number in (0, 1) per row, a pure function of (seed, position) and independent of the
    row's Gumbel noise: [S] float32."""
    mixed = _fmix32(position.astype(jnp.uint32) * jnp.uint32(0x2C1B3C6D) + jnp.uint32(0x297A2D39))
    h = _fmix32(seed.astype(jnp.uint32) ^ mixed)
    return ((h >> 8).astype(jnp.float32) + 0.5) * jnp.float32(2.0**-24)


def apply_penalties(logits: jax.Array, counts: jax.Array, repetition: jax.Array,
                    frequency: jax.Array, presence: jax.Array) -> jax.Array:
    """Penalised logits [S, V] from each row's token counts [S, V] (int32: twice the token's
    count in the output, plus 1 if it is in the prompt) and its penalties [S].

    Repetition (HuggingFace's ``RepetitionPenaltyLogitsProcessor``, over prompt and output): a
    seen token's logit is divided by the penalty where positive, multiplied where negative.
    Frequency and presence (OpenAI's, over the output): ``count × frequency + (count > 0) ×
    presence`` is subtracted. Neutral rows (1, 0, 0) are left exactly as they are.
    """
    rep = repetition[:, None]
    penalised = jnp.where(logits > 0, logits / rep, logits * rep)
    logits = jnp.where((counts > 0) & (rep != 1.0), penalised, logits)
    out = (counts >> 1).astype(jnp.float32)
    return logits - frequency[:, None] * out - presence[:, None] * (out > 0)


def top_logprobs(logits: jax.Array, chosen: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """Log-softmax of ``logits`` [N, V] at ``chosen`` [N] and at each row's top ``k`` tokens:
    (values [N, k+1] float32, ids [N, k+1] int32), the chosen token in column 0, the top k
    after it in descending order (ties: lowest id first)."""
    lp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    top_v, top_i = jax.lax.top_k(lp, k)
    chosen = jnp.clip(chosen, 0, lp.shape[-1] - 1).astype(jnp.int32)
    chosen_v = jnp.take_along_axis(lp, chosen[:, None], axis=-1)
    return (jnp.concatenate([chosen_v, top_v], axis=1),
            jnp.concatenate([chosen[:, None], top_i.astype(jnp.int32)], axis=1))
