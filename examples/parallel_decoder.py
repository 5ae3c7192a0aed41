"""A decoder of a family the built-in model does not cover, served through the model protocol:
GPT-J / GPT-NeoX-style blocks (attention and MLP in parallel from one LayerNorm, both added to
the residual), a fused QKV projection, partial rotary (only the first ``rotary_dim`` of each
head's dimensions rotate), a GELU MLP, biases everywhere, an untied head.

    from minijax_serve import Engine
    model = ParallelDecoder(ParallelConfig(), rngs=nnx.Rngs(0))
    engine = Engine(model, model_config=model.spec())
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from minijax_serve import ModelSpec


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    vocab_size: int = 256
    hidden_size: int = 64
    num_heads: int = 4
    num_layers: int = 2
    rotary_dim: int = 8  # of head_dim = 16
    max_positions: int = 512
    rope_theta: float = 10000.0
    eps: float = 1e-5
    init_std: float = 0.15  # large enough that the greedy choice is clear of float32 noise

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


def layer_norm(x: jax.Array, w: jax.Array, b: jax.Array, eps: float) -> jax.Array:
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + eps) * w + b


def partial_rotary(x: jax.Array, positions: jax.Array, rotary_dim: int, theta: float) -> jax.Array:
    """NeoX rotary (rotate-half) on the first ``rotary_dim`` dims of x [T, heads, D]."""
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    inv = 1.0 / theta ** (jnp.arange(0, rotary_dim, 2, dtype=jnp.float32) / rotary_dim)
    angles = positions.astype(jnp.float32)[:, None] * inv[None]
    cos, sin = (jnp.concatenate([f(angles)] * 2, -1)[:, None, :] for f in (jnp.cos, jnp.sin))
    half = rotary_dim // 2
    rotated = jnp.concatenate([-rot[..., half:], rot[..., :half]], -1)
    return jnp.concatenate([rot * cos + rotated * sin, rest], -1)


class ParallelDecoder(nnx.Module):
    def __init__(self, cfg: ParallelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        h, v = cfg.hidden_size, cfg.vocab_size
        normal = lambda *shape: nnx.Param(cfg.init_std * jax.random.normal(rngs.params(), shape))  # noqa: E731
        self.embed_tokens = normal(v, h)
        self.layers = nnx.List([nnx.Dict(
            ln_w=nnx.Param(jnp.ones(h)), ln_b=normal(h),
            w_qkv=normal(h, 3 * h), b_qkv=normal(3 * h), w_o=normal(h, h), b_o=normal(h),
            w_in=normal(h, 4 * h), b_in=normal(4 * h), w_out=normal(4 * h, h), b_out=normal(h),
        ) for _ in range(cfg.num_layers)])
        self.final_ln_w, self.final_ln_b = nnx.Param(jnp.ones(h)), normal(h)
        self.lm_head = normal(h, v)

    def spec(self, eos_token_ids: tuple[int, ...] = ()) -> ModelSpec:
        cfg = self.cfg
        return ModelSpec(vocab_size=cfg.vocab_size, num_layers=cfg.num_layers,
                         num_heads=cfg.num_heads, num_kv_heads=cfg.num_heads,
                         head_dim=cfg.head_dim, max_position_embeddings=cfg.max_positions,
                         eos_token_ids=eos_token_ids)

    def embed(self, ids: jax.Array, positions: jax.Array) -> jax.Array:
        return self.embed_tokens[...][ids]

    def layer(self, p, h: jax.Array, attn):
        cfg, t = self.cfg, h.shape[0]
        x = layer_norm(h, p["ln_w"], p["ln_b"], cfg.eps)
        q, k, v = jnp.split(x @ p["w_qkv"] + p["b_qkv"], 3, axis=-1)
        q, k, v = (y.reshape(t, cfg.num_heads, cfg.head_dim) for y in (q, k, v))
        q, k = (partial_rotary(y, attn.positions, cfg.rotary_dim, cfg.rope_theta) for y in (q, k))
        o, attn = attn(q, k, v)
        attn_out = o.reshape(t, cfg.hidden_size) @ p["w_o"] + p["b_o"]
        mlp_out = jax.nn.gelu(x @ p["w_in"] + p["b_in"]) @ p["w_out"] + p["b_out"]
        return h + attn_out + mlp_out, attn

    def head(self, h: jax.Array, indices: jax.Array) -> jax.Array:
        x = layer_norm(h[indices], self.final_ln_w[...], self.final_ln_b[...], self.cfg.eps)
        return jnp.dot(x, self.lm_head[...], preferred_element_type=jnp.float32)
