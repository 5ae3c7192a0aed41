"""ModelRunner: owns the device state (weights, KV pools, token buffer) and the compiled steps.

One step = gather input ids (from the host or the device token buffer), run the model over the
ragged batch, sample on device, write the sampled tokens into the token buffer. The KV pools and
the token buffer are donated into every step and returned updated, so they are never copied.
Steps are compiled ahead of time, once per bucketed :class:`StepShape`.
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
from flax import nnx

from minijax_serve.executor.buckets import StepShape
from minijax_serve.executor.forward_batch import ForwardBatch, empty_forward_batch, pack, unpack
from minijax_serve.executor.sampler import SamplingArrays, sample
from minijax_serve.models.attention import AttentionMetadata
from minijax_serve.models.decoder import DecoderLM


def _step(graphdef, param_tree, backend, shape, param_leaves, k_pool, v_pool, token_buf, packed_fb):
    model = nnx.merge(graphdef, jax.tree.unflatten(param_tree, param_leaves))
    fb = unpack(packed_fb, shape)
    t = fb.input_ids.shape[0]
    from_buf = token_buf[jnp.maximum(fb.buf_index, 0)]
    input_ids = jnp.where(fb.buf_index >= 0, from_buf, fb.input_ids)
    seq_ids = jnp.searchsorted(fb.cu_q_lens, jnp.arange(t), side="right") - 1
    seq_ids = jnp.clip(seq_ids, 0, fb.kv_lens.shape[0] - 1)
    meta = AttentionMetadata(fb.positions, seq_ids, fb.slot_mapping, fb.cu_q_lens, fb.page_table,
                             fb.kv_lens)
    last_token = jnp.maximum(fb.cu_q_lens[1:] - 1, 0)
    logits, k_pool, v_pool = model(input_ids, meta, last_token, k_pool, v_pool, backend)
    rows = jnp.arange(logits.shape[0])[:, None]
    banned = jnp.where(fb.banned >= 0, fb.banned, logits.shape[1])  # out of range: dropped
    logits = logits.at[rows, banned].set(-jnp.inf, mode="drop")
    params_s = SamplingArrays(fb.temperature, fb.top_k, fb.top_p, fb.min_p, fb.seed, fb.kv_lens)
    tokens = jax.lax.cond(
        fb.all_greedy,
        lambda: sample(logits, params_s, all_greedy=True),
        lambda: sample(logits, params_s, all_greedy=False),
    )
    token_buf = token_buf.at[fb.sample_slots].set(tokens)
    return k_pool, v_pool, token_buf, tokens


class ModelRunner:
    def __init__(self, model: DecoderLM, *, num_pages: int, page_size: int, num_slots: int,
                 dtype, attention_backend: str = "xla"):
        cfg = model.cfg
        self.graphdef, params = nnx.split(model)
        # the weights travel as a flat list: flattening the NNX state (a few hundred leaves)
        # on every call cost ~0.6 ms of host time per step
        self.params, self.param_tree = jax.tree.flatten(params)
        pool_shape = (cfg.num_layers, cfg.num_kv_heads, num_pages, page_size, cfg.head_dim)
        self.k_pool = jnp.zeros(pool_shape, dtype)
        self.v_pool = jnp.zeros(pool_shape, dtype)
        self.token_buf = jnp.zeros((num_slots + 1,), jnp.int32)  # + the scratch row
        self.attention_backend = attention_backend
        self._compiled: dict[StepShape, jax.stages.Compiled] = {}
        self.compile_time_s = 0.0

    @property
    def num_compilations(self) -> int:
        return len(self._compiled)

    @property
    def pool_bytes(self) -> int:
        return self.k_pool.nbytes + self.v_pool.nbytes

    def compiled(self, shape: StepShape) -> jax.stages.Compiled:
        """The step compiled for ``shape``, compiling it on first use."""
        if shape not in self._compiled:
            start = time.perf_counter()
            step = functools.partial(_step, self.graphdef, self.param_tree, self.attention_backend,
                                     shape)
            lowered = jax.jit(step, donate_argnums=(1, 2, 3)).lower(
                self.params, self.k_pool, self.v_pool, self.token_buf, pack(empty_forward_batch(shape)))
            self._compiled[shape] = lowered.compile()
            self.compile_time_s += time.perf_counter() - start
        return self._compiled[shape]

    def run(self, fb: ForwardBatch) -> jax.Array:
        """Launch one step; returns the sampled tokens [S] (a copy to host is already started).
        The batch goes to the device as one packed vector (one transfer, not one per field)."""
        step = self.compiled(fb.shape)
        self.k_pool, self.v_pool, self.token_buf, tokens = step(
            self.params, self.k_pool, self.v_pool, self.token_buf, pack(fb)
        )
        tokens.copy_to_host_async()
        return tokens
