"""The built-in decoder, for the Llama / Mistral / Qwen2 / Qwen3 family: the first user of the
model protocol (:mod:`minijax_serve.models.protocol`).

``embed``, ``layer`` and ``head`` are the whole model; the engine runs the layer loop and passes
the attention object that owns the paged KV pools. The model holds no cache state. Linear
weights are stored ``[in, out]`` and multiplied as ``x @ w`` (under the engine's scan, a
:class:`~minijax_serve.models.protocol.LayerWeight`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec

from minijax_serve.attention.layer import TP_AXIS
from minijax_serve.models import quantize
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


def rope_tables(positions: jax.Array, inv_freq, dtype) -> tuple[jax.Array, jax.Array]:
    """cos and sin [T, D] of the rotary angles (``inv_freq`` [D/2], each frequency twice)."""
    freqs = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq)[None]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb).astype(dtype), jnp.sin(emb).astype(dtype)


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


class DecoderLM(nnx.Module):
    """Causal LM: embeddings, decoder layers (``layers[i]``: that layer's weights), final norm,
    LM head. ``quantization`` ("fp8", "fp8_w8a8"): the layers' linear weights in FP8, each with
    a per-output-channel scale ``<name>_scale`` (:mod:`minijax_serve.models.quantize`)."""

    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, rngs: nnx.Rngs,
                 quantization: str | None = None):
        quantize.check_method(quantization)
        self.cfg = cfg
        self.quantization = quantization
        init = nnx.initializers.normal(0.02)
        self.embed_tokens = nnx.Param(init(rngs.params(), (cfg.vocab_size, cfg.hidden_size), dtype))

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
        if quantization is not None:
            quantize.quantize_layers(self.layers)
        self.final_norm = nnx.Param(jnp.ones((cfg.hidden_size,), dtype))
        if not cfg.tie_word_embeddings:
            self.lm_head = nnx.Param(init(rngs.params(), (cfg.hidden_size, cfg.vocab_size), dtype))

    def partition_spec(self, path: tuple) -> PartitionSpec:
        """Megatron-style tensor parallelism: q/k/v and gate/up split by output (heads,
        intermediate), o and down by input (one all-reduce after each); FP8 weights' scales
        with their output columns; the embedding and the LM head split by vocabulary (vLLM's
        vocab-parallel layers; the logits stay split); the norms replicated."""
        name = path[-1]
        if isinstance(name, str) and name.endswith(quantize.SCALE):  # a scale per output column
            split = name[:-len(quantize.SCALE)] in ("wq", "wk", "wv", "w_gate", "w_up")
            return PartitionSpec(TP_AXIS) if split else PartitionSpec()
        if name == "embed_tokens":
            return PartitionSpec(TP_AXIS, None)
        if name == "lm_head":
            return PartitionSpec(None, TP_AXIS)
        if name in ("wq", "wk", "wv", "w_gate", "w_up"):
            return PartitionSpec(None, TP_AXIS)
        if name in ("wo", "w_down"):
            return PartitionSpec(TP_AXIS, None)
        if name in ("bq", "bk", "bv", "b_gate", "b_up"):
            return PartitionSpec(TP_AXIS)
        return PartitionSpec()

    def embed(self, ids: jax.Array, positions: jax.Array) -> jax.Array:
        return self.embed_tokens[...][ids]

    def layer(self, p, h: jax.Array, attn):
        """One decoder layer: pre-norm attention (GQA, rotary, optional q/k norms and biases),
        then the SwiGLU MLP, each added to the residual."""
        cfg, eps, t = self.cfg, self.cfg.rms_norm_eps, h.shape[0]

        def linear(x, name):
            y = quantize.linear(x, p[name], p.get(quantize.scale_name(name)), self.quantization)
            bias = "b" + name[1:]  # wq -> bq, w_gate -> b_gate
            return y + p[bias] if bias in p else y

        a = rms_norm(h, p["attn_norm"], eps)
        q = linear(a, "wq").reshape(t, cfg.num_heads, cfg.head_dim)
        k = linear(a, "wk").reshape(t, cfg.num_kv_heads, cfg.head_dim)
        v = linear(a, "wv").reshape(t, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            q, k = rms_norm(q, p["q_norm"], eps), rms_norm(k, p["k_norm"], eps)
        cos, sin = rope_tables(attn.positions, cfg.rope_inv_freq(), h.dtype)
        o, attn = attn(rotate(q, cos, sin), rotate(k, cos, sin), v)
        h = h + linear(o.reshape(t, cfg.q_size), "wo")
        m = rms_norm(h, p["mlp_norm"], eps)
        return h + linear(jax.nn.silu(linear(m, "w_gate")) * linear(m, "w_up"), "w_down"), attn

    def head(self, h: jax.Array, indices: jax.Array) -> jax.Array:
        x = rms_norm(h[indices], self.final_norm[...], self.cfg.rms_norm_eps)
        w = self.embed_tokens[...].T if self.cfg.tie_word_embeddings else self.lm_head[...]
        logits = jnp.dot(x, w, preferred_element_type=jnp.float32)
        if TP_AXIS in jax.sharding.get_abstract_mesh().axis_names:
            # each device its own columns, from its own rows of w
            logits = jax.lax.with_sharding_constraint(logits, PartitionSpec(None, TP_AXIS))
        return logits[:, :self.cfg.vocab_size]  # without the columns of a padded vocabulary
