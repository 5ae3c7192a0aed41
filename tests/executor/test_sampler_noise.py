"""The sampler's Gumbel noise is finite for every hash value: the largest one (its top 24 bits
all set) once rounded to u = 1 in float32, made the noise +inf and picked its token whatever
its logit, a token masked out by a grammar too (-inf + inf = NaN wins the argmax): about once
per row in 340 steps of a 49k vocabulary (found by benchmarks/soak.py's structured output)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from minijax_serve.executor.sampler import SamplingArrays, _gumbel_noise, sample

M32 = 2**32 - 1


def _inverse_fmix32(h: int) -> int:
    """The inverse of MurmurHash3's 32-bit finaliser (each of its steps is a bijection)."""
    h ^= h >> 16
    h = h * pow(0xC2B2AE35, -1, 2**32) & M32
    h ^= (h >> 13) ^ (h >> 26)
    h = h * pow(0x85EBCA6B, -1, 2**32) & M32
    return h ^ (h >> 16)


def _fmix32(h: int) -> int:
    h ^= h >> 16
    h = h * 0x85EBCA6B & M32
    h ^= h >> 13
    h = h * 0xC2B2AE35 & M32
    return h ^ (h >> 16)


def _seed_of_largest_hash(token: int, position: int) -> int:
    """The seed whose noise hash at (position, token) is 0xFFFFFFFF (as _gumbel_noise hashes)."""
    col = _fmix32((token * 0x27D4EB2F + 0x165667B1) & M32)
    row = _inverse_fmix32(M32) ^ col
    return _inverse_fmix32(row) ^ _fmix32((position + 0x9E3779B9) & M32)


def test_the_largest_hash_gives_finite_noise_and_a_masked_token_is_never_sampled():
    vocab, token, position = 64, 5, 7
    seed = _seed_of_largest_hash(token, position)
    noise = np.asarray(_gumbel_noise(jnp.array([seed], jnp.uint32),
                                     jnp.array([position], jnp.int32), vocab))
    assert np.isfinite(noise).all() and noise[0].argmax() == token  # the largest, finite
    logits = jnp.zeros((1, vocab), jnp.float32).at[0, token].set(-jnp.inf)  # masked out
    params = SamplingArrays(jnp.array([1.0]), jnp.array([-1]), jnp.array([1.0]),
                            jnp.array([0.0]), jnp.array([seed], jnp.uint32),
                            jnp.array([position], jnp.int32))
    chosen = int(sample(logits, params, all_greedy=False)[0])
    assert chosen != token and 0 <= chosen < vocab
