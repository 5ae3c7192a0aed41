"""ModelRunner: owns the device state (weights, KV pools, token buffer) and the compiled steps.

One step is two programs dispatched back to back: the model (gather input ids from the host or
the device token buffer, run the model over the ragged batch, return the logits) and the sampler
(sample on device, write the sampled tokens into the token buffer). The KV pools are donated
into the model and the token buffer into the sampler, each returned updated, so they are never
copied. Steps are compiled ahead of time, once per bucketed :class:`StepShape`; samplers once per
number of sequences, greedy (an argmax) and not (a sort of the vocabulary).
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
from flax import nnx

from minijax_serve.executor.buckets import StepShape
from minijax_serve.executor.forward_batch import (ForwardBatch, empty_forward_batch, pack,
                                                   sampling_size, unpack, unpack_sampling)
from minijax_serve.executor.sampler import SamplingArrays, sample
from minijax_serve.models.attention import AttentionMetadata
from minijax_serve.models.decoder import DecoderLM


def _forward(graphdef, param_tree, backend, layer_loop, shape, param_leaves, k_pool, v_pool,
             token_buf, packed_fb):
    """The model over one batch: updated pools, the float32 logits [S, V] of each sequence's
    last new token, and the front of the packed batch that the sampler reads."""
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
    logits, k_pool, v_pool = model(input_ids, meta, last_token, k_pool, v_pool, backend,
                                   layer_loop=layer_loop, decode=shape.decode)
    return k_pool, v_pool, logits, packed_fb[:sampling_size(shape.num_seqs)]


def _sample(num_seqs, all_greedy, token_buf, logits, sampling_fb):
    """Sample each sequence's token, write it into the token buffer; returns both.
    ``sampling_fb``: the front of the packed batch, the sampler's fields."""
    f = unpack_sampling(sampling_fb, num_seqs)
    rows = jnp.arange(logits.shape[0])[:, None]
    banned = jnp.where(f["banned"] >= 0, f["banned"], logits.shape[1])  # out of range: dropped
    logits = logits.at[rows, banned].set(-jnp.inf, mode="drop")
    params = SamplingArrays(f["temperature"], f["top_k"], f["top_p"], f["min_p"], f["seed"],
                            f["kv_lens"])
    tokens = sample(logits, params, all_greedy=all_greedy)
    return token_buf.at[f["sample_slots"]].set(tokens), tokens


class ModelRunner:
    def __init__(self, model: DecoderLM, *, num_pages: int, page_size: int, num_slots: int,
                 dtype, attention_backend: str, layer_loop: str):
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
        self.layer_loop = layer_loop
        self._compiled: dict[StepShape, jax.stages.Compiled] = {}
        self._samplers: dict[tuple[int, bool], jax.stages.Compiled] = {}
        self.compile_time_s = 0.0

    @property
    def num_compilations(self) -> int:
        """Step shapes compiled (each with its sampler programs)."""
        return len(self._compiled)

    def compiled(self, shape: StepShape) -> jax.stages.Compiled:
        """The model step compiled for ``shape``, compiling it (and the samplers for its number
        of sequences, greedy and not) on first use."""
        if shape not in self._compiled:
            start = time.perf_counter()
            packed = pack(empty_forward_batch(shape))
            forward = functools.partial(_forward, self.graphdef, self.param_tree,
                                        self.attention_backend, self.layer_loop, shape)
            lowered = jax.jit(forward, donate_argnums=(1, 2)).lower(
                self.params, self.k_pool, self.v_pool, self.token_buf, packed)
            self._compiled[shape] = compiled = lowered.compile()
            logits, front = compiled.out_info[2:]
            for greedy in (True, False):
                if (shape.num_seqs, greedy) not in self._samplers:
                    sampler = functools.partial(_sample, shape.num_seqs, greedy)
                    self._samplers[shape.num_seqs, greedy] = jax.jit(
                        sampler, donate_argnums=0).lower(self.token_buf, logits, front).compile()
            self.compile_time_s += time.perf_counter() - start
        return self._compiled[shape]

    def run(self, fb: ForwardBatch, shape: StepShape) -> jax.Array:
        """Launch one step of ``shape``; returns the sampled tokens [S] (a copy to host is
        already started). The batch goes to the device once, as one packed vector.

        The model and the sampler are two programs, the sampler chosen on the host (greedy or
        not), so that no device-side branch makes the host wait for the device.
        """
        assert (len(fb.input_ids), len(fb.kv_lens)) == shape[:2], (shape, fb.page_table.shape)
        forward = self.compiled(shape)
        self.k_pool, self.v_pool, logits, front = forward(
            self.params, self.k_pool, self.v_pool, self.token_buf, pack(fb))
        sampler = self._samplers[shape.num_seqs, bool(fb.all_greedy)]
        self.token_buf, tokens = sampler(self.token_buf, logits, front)
        tokens.copy_to_host_async()
        return tokens
