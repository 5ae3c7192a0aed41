"""One Flax NNX decoder for the Llama / Mistral / Qwen2 / Qwen3 family.

The layers run in a ``jax.lax.scan`` over the layer index, so the attention (loops and all) is
compiled once, not once per layer. Each layer's weights are separate arrays, and the scan body
picks the layer's dense parts (projections, MLP) with ``jax.lax.switch``: weights stacked along a
layer axis and sliced by the scan would be copied out of the stack every layer of every step
(on CPU that copy cost ~40 ms of a 150–400 ms SmolLM2 decode step). The KV pools are explicit
arguments threaded through the scan as carry (updated in place) and returned, so the engine can
donate them; the model holds no cache state. Linear weights are stored ``[in, out]``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from minijax_serve.models.attention import AttentionMetadata, paged_attention, write_kv
from minijax_serve.models.config import ModelConfig


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * x32.astype(x.dtype)


def rotate(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """HF's ``rotate_half`` rotary embedding; x [T, heads, D], cos/sin [T, D]."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return (x * cos[:, None, :] + rotated * sin[:, None, :]).astype(x.dtype)


def layer_param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Per-layer parameter shapes (without the leading layer axis), by name."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    shapes = {
        "attn_norm": (h,),
        "wq": (h, cfg.q_size),
        "wk": (h, cfg.kv_size),
        "wv": (h, cfg.kv_size),
        "wo": (cfg.q_size, h),
        "mlp_norm": (h,),
        "w_gate": (h, i),
        "w_up": (h, i),
        "w_down": (i, h),
    }
    if cfg.qkv_bias:
        shapes |= {"bq": (cfg.q_size,), "bk": (cfg.kv_size,), "bv": (cfg.kv_size,)}
    if cfg.o_bias:
        shapes["bo"] = (h,)
    if cfg.mlp_bias:
        shapes |= {"b_gate": (i,), "b_up": (i,), "b_down": (h,)}
    if cfg.qk_norm:
        shapes |= {"q_norm": (cfg.head_dim,), "k_norm": (cfg.head_dim,)}
    return shapes


def _linear(x: jax.Array, p: dict[str, jax.Array], w: str, b: str) -> jax.Array:
    y = x @ p[w]
    return y + p[b] if b in p else y


class DecoderLM(nnx.Module):
    """Causal LM: embeddings, decoder layers (``layers[i]``: that layer's weights), final norm,
    LM head."""

    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.cfg = cfg
        init = nnx.initializers.normal(0.02)
        self.embed = nnx.Param(init(rngs.params(), (cfg.vocab_size, cfg.hidden_size), dtype))

        def layer_params() -> nnx.Dict:
            params = {}
            for name, shape in layer_param_shapes(cfg).items():
                if name.endswith("norm"):
                    params[name] = nnx.Param(jnp.ones(shape, dtype))
                elif name.startswith("b"):
                    params[name] = nnx.Param(jnp.zeros(shape, dtype))
                else:
                    params[name] = nnx.Param(init(rngs.params(), shape, dtype))
            return nnx.Dict(params)

        self.layers = nnx.List([layer_params() for _ in range(cfg.num_layers)])
        self.final_norm = nnx.Param(jnp.ones((cfg.hidden_size,), dtype))
        if not cfg.tie_word_embeddings:
            self.lm_head = nnx.Param(init(rngs.params(), (cfg.hidden_size, cfg.vocab_size), dtype))

    def __call__(
        self,
        input_ids: jax.Array,
        meta: AttentionMetadata,
        logits_indices: jax.Array,
        k_pool: jax.Array,
        v_pool: jax.Array,
        attention_backend: str = "xla",
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Run the new tokens through the model.

        Returns float32 logits [len(logits_indices), vocab] of the selected token rows, and the
        updated pools.
        """
        cfg = self.cfg
        t = input_ids.shape[0]
        x = self.embed[...][input_ids]
        freqs = meta.positions.astype(jnp.float32)[:, None] * jnp.asarray(cfg.rope_inv_freq())[None]
        emb = jnp.concatenate([freqs, freqs], axis=-1)
        cos, sin = jnp.cos(emb).astype(x.dtype), jnp.sin(emb).astype(x.dtype)
        scale = cfg.head_dim**-0.5
        eps = cfg.rms_norm_eps

        def project(p, h):
            a = rms_norm(h, p["attn_norm"], eps)
            q = _linear(a, p, "wq", "bq").reshape(t, cfg.num_heads, cfg.head_dim)
            k = _linear(a, p, "wk", "bk").reshape(t, cfg.num_kv_heads, cfg.head_dim)
            v = _linear(a, p, "wv", "bv").reshape(t, cfg.num_kv_heads, cfg.head_dim)
            if cfg.qk_norm:
                q, k = rms_norm(q, p["q_norm"], eps), rms_norm(k, p["k_norm"], eps)
            return rotate(q, cos, sin), rotate(k, cos, sin), v

        def finish(p, h, o):
            h = h + _linear(o.reshape(t, cfg.q_size), p, "wo", "bo")
            m = rms_norm(h, p["mlp_norm"], eps)
            gate = jax.nn.silu(_linear(m, p, "w_gate", "b_gate"))
            return h + _linear(gate * _linear(m, p, "w_up", "b_up"), p, "w_down", "b_down")

        params = [{name: value[...] for name, value in layer.items()} for layer in self.layers]
        projects = [functools.partial(project, p) for p in params]
        finishes = [functools.partial(finish, p) for p in params]

        def layer(carry, idx):
            h, k_pool, v_pool = carry
            q, k, v = jax.lax.switch(idx, projects, h)
            k_pool = write_kv(k_pool, idx, meta.slot_mapping, k)
            v_pool = write_kv(v_pool, idx, meta.slot_mapping, v)
            o = paged_attention(q, k, v, k_pool, v_pool, idx, meta, scale, attention_backend)
            return (jax.lax.switch(idx, finishes, h, o), k_pool, v_pool), None

        (x, k_pool, v_pool), _ = jax.lax.scan(layer, (x, k_pool, v_pool), jnp.arange(cfg.num_layers))
        x = rms_norm(x[logits_indices], self.final_norm[...], eps)
        head = self.embed[...].T if cfg.tie_word_embeddings else self.lm_head[...]
        logits = jnp.dot(x, head, preferred_element_type=jnp.float32)
        return logits, k_pool, v_pool
