"""One Flax NNX decoder for the Llama / Mistral / Qwen2 / Qwen3 family.

Two ways to run the layers (``layer_loop``, chosen per backend by ``EngineConfig``):

* ``"scan"``: a ``jax.lax.scan`` over the layer index, so the attention (loops and all) is
  compiled once, not once per layer. Each layer's weight matrices are separate arrays, which the
  scan body multiplies by through a ``jax.lax.switch`` over the layers (``_layer_dots``): matrices
  stacked along a layer axis and sliced by the scan were copied out of the stack every layer of
  every step, 12–17 % of a SmolLM2 decode step on CPU. The small vectors (norms, biases) are
  stacked and sliced, which costs nothing worth a branch.
* ``"unroll"``: the layers written out, each reading its own arrays; no branch (on a GPU, XLA
  makes the host wait for the device at every branch), at the price of a compile time that
  grows with the depth.

The KV pools are explicit arguments threaded through the layers (as the scan's carry: updated
in place) and returned, so the engine can donate them; the model holds no cache state. Linear
weights are stored ``[in, out]``."""

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


def _layer_dots(params: list[dict[str, jax.Array]], idx: jax.Array, x: jax.Array,
                *names: str) -> tuple[jax.Array, ...]:
    """``x @ W`` for each named weight matrix of layer ``idx``.

    A switch over the layers whose branches hold only these matmuls: each branch reads its
    layer's arrays in place (slicing a stacked array copies the slice), and there is little in
    the branches to compile.
    """
    branches = [functools.partial(lambda p, x: tuple(x @ p[n] for n in names), p) for p in params]
    return jax.lax.switch(idx, branches, x)


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
        *,
        layer_loop: str = "scan",
        decode: bool = False,
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Run the new tokens through the model.

        ``layer_loop``: ``"scan"`` (one compiled layer body, weights picked by a switch) or
        ``"unroll"`` (the layers written out: no branch, for GPUs). ``decode``: every sequence
        has exactly one new token (static), which the Pallas backend runs with its decode kernel.
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

        def layer(h, k_pool, v_pool, p, idx, dots):
            """One decoder layer; ``p``: its norms and biases; ``dots(x, *names)``: x @ W."""
            def linear(x, *names):
                biases = ("b" + n[1:] for n in names)  # wq -> bq, w_gate -> b_gate
                return [y + p[b] if b in p else y for y, b in zip(dots(x, *names), biases)]

            a = rms_norm(h, p["attn_norm"], eps)
            q, k, v = linear(a, "wq", "wk", "wv")
            q = q.reshape(t, cfg.num_heads, cfg.head_dim)
            k = k.reshape(t, cfg.num_kv_heads, cfg.head_dim)
            v = v.reshape(t, cfg.num_kv_heads, cfg.head_dim)
            if cfg.qk_norm:
                q, k = rms_norm(q, p["q_norm"], eps), rms_norm(k, p["k_norm"], eps)
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)
            k_pool = write_kv(k_pool, idx, meta.slot_mapping, k)
            v_pool = write_kv(v_pool, idx, meta.slot_mapping, v)
            o = paged_attention(q, k, v, k_pool, v_pool, idx, meta, scale, attention_backend,
                                decode=decode)
            h = h + linear(o.reshape(t, cfg.q_size), "wo")[0]
            m = rms_norm(h, p["mlp_norm"], eps)
            gate, up = linear(m, "w_gate", "w_up")
            return h + linear(jax.nn.silu(gate) * up, "w_down")[0], k_pool, v_pool

        matrices = [{n: w[...] for n, w in layer.items() if w.ndim == 2} for layer in self.layers]
        vectors = [{n: w[...] for n, w in layer.items() if w.ndim == 1} for layer in self.layers]
        if layer_loop not in ("scan", "unroll"):
            raise ValueError(f"layer_loop must be 'scan' or 'unroll', got {layer_loop!r}")
        if layer_loop == "unroll":
            for i, (mats, vecs) in enumerate(zip(matrices, vectors)):
                dots = functools.partial(lambda m, x, *names: tuple(x @ m[n] for n in names), mats)
                x, k_pool, v_pool = layer(x, k_pool, v_pool, vecs, i, dots)
        else:
            def body(carry, xs):
                p, idx = xs
                return layer(*carry, p, idx, functools.partial(_layer_dots, matrices, idx)), None

            stacked = {n: jnp.stack([v[n] for v in vectors]) for n in vectors[0]}
            (x, k_pool, v_pool), _ = jax.lax.scan(
                body, (x, k_pool, v_pool), (stacked, jnp.arange(cfg.num_layers)))
        x = rms_norm(x[logits_indices], self.final_norm[...], eps)
        head = self.embed[...].T if cfg.tie_word_embeddings else self.lm_head[...]
        logits = jnp.dot(x, head, preferred_element_type=jnp.float32)
        return logits, k_pool, v_pool
