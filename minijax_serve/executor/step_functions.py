"""The functions a step's programs trace: the model over a packed batch (:func:`forward_step`),
the sampler (:func:`sample_step`), the logprobs (:func:`logprobs_step`) and a request's rows
of the token counts for penalties (:func:`set_count_row`) and of its logit bias
(:func:`set_bias_row`).
:class:`~minijax_serve.executor.model_runner.ModelRunner` lowers and compiles them per shape
through :func:`jitted`, and dispatches them."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from minijax_serve.attention.layer import AttentionMetadata, PagedAttention
from minijax_serve.executor.forward_batch import sampling_size, unpack, unpack_sampling
from minijax_serve.executor.sampler import SamplingArrays, apply_penalties, sample, top_logprobs
from minijax_serve.executor.tensor_parallel import POOL_SPEC, logits_sharding
from minijax_serve.models.protocol import forward


@functools.cache
def jitted(fn, num_static: int, donate: tuple[int, ...] = (), out_shardings=None):
    """``fn`` under ``jax.jit``, its first ``num_static`` arguments static: one wrapper per
    function and options for the whole process. JAX keys its traces, lowerings and compiled
    programs by the wrapper and the static arguments' values (the model's graph definition and
    parameter tree through :func:`static`, the backend, the mesh, the shape), so a second engine
    of the same configuration reuses the first one's programs instead of tracing, lowering and
    compiling them again (a tiny Llama's second engine: 0.70 → 0.10 s to its first tokens;
    benchmarks/RESULTS.md, "Engines of one configuration share their programs"). The programs
    stay in JAX's caches, which are bounded, after their engines are gone."""
    options = {} if out_shardings is None else dict(out_shardings=out_shardings)
    return jax.jit(fn, static_argnums=tuple(range(num_static)), donate_argnums=donate, **options)


class Unhashable:
    """A static argument that does not hash (the graph definition of a model of one's own
    holding a dict, say), equal only to itself: its engine keeps programs of its own."""

    def __init__(self, value):
        self.value = value


def static(value):
    """``value`` as a static argument of :func:`jitted`'s programs: itself where it hashes (equal
    values share programs), else wrapped in :class:`Unhashable`."""
    try:
        hash(value)
    except TypeError:
        return Unhashable(value)
    return value


def forward_step(graphdef, param_tree, backend, layer_loop, mesh, shape, num_logprobs, param_leaves,
                 k_pool, v_pool, kv_scales, token_buf, packed_fb, *targets):
    """The model over one batch: updated pools, the float32 logits [S, V] of each sequence's
    last new token ([T, V] of every new token with ``shape.verify``), and the front of the
    packed batch that the sampler reads (``kv_scales``: FP8 pools' K and V scales, or ()). With
    ``shape.prompt_logprobs``, also the logprobs of ``targets`` [T] (each new token's next
    token) and the top ones, from every new token's logits."""
    graphdef, param_tree = (x.value if isinstance(x, Unhashable) else x
                            for x in (graphdef, param_tree))
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
    rows = jnp.arange(t) if shape.prompt_logprobs or shape.verify else last_token
    scales = dict(zip(("k_scale", "v_scale"), kv_scales))
    attn = PagedAttention(k_pool, v_pool, meta, backend=backend, decode=shape.decode, mesh=mesh,
                          **scales)
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):  # the model may place activations
        logits, attn = forward(model, input_ids, attn, rows, layer_loop)
    split = logits_sharding(mesh, logits.shape[1])
    logits = jax.lax.with_sharding_constraint(logits, split)
    k_pool, v_pool = attn.k_pool, attn.v_pool
    # the pools leave as they came, split over KV heads, to be donated again
    k_pool, v_pool = (jax.lax.with_sharding_constraint(p, NamedSharding(mesh, POOL_SPEC))
                      for p in (k_pool, v_pool))
    front = packed_fb[:sampling_size(shape.num_seqs)]
    if shape.prompt_logprobs:
        whole = NamedSharding(mesh, PartitionSpec())
        return (k_pool, v_pool, jax.lax.with_sharding_constraint(logits[last_token], split), front,
                *logprobs_step(num_logprobs, whole, logits, targets[0]))
    return k_pool, v_pool, logits, front


def logprobs_step(k, whole, logits, chosen):
    """:func:`~minijax_serve.executor.sampler.top_logprobs` of ``logits`` gathered ``whole``
    first (a replicated sharding): the values of a single device's log-softmax, on every
    device."""
    values, ids = top_logprobs(jax.lax.with_sharding_constraint(logits, whole), chosen, k)
    return (jax.lax.with_sharding_constraint(values, whole),
            jax.lax.with_sharding_constraint(ids, whole))


def sampler_key(num_seqs: int, greedy: bool, penalized: bool, constrained: bool,
                truncated: bool) -> tuple:
    """The program key of :func:`sample_step`'s variant (a greedy one is never ``truncated``
    False: it sorts nothing either way)."""
    return (("sampler", num_seqs, greedy, penalized) + (("constrained",) if constrained else ())
            + (() if truncated else ("whole",)))


def sample_step(num_seqs, all_greedy, truncated, penalized, constrained, whole, token_buf,
                logits, sampling_fb, *adjust):
    """Sample each sequence's token, write it into the token buffer; returns the buffer and the
    tokens (and, ``penalized``, the token counts with the new tokens added).
    ``logits`` may be split by vocabulary over the mesh: a greedy sampler reduces them where
    they are, others first gather them ``whole`` (a replicated sharding; one gather, where
    XLA's sort over a split vocabulary would gather twice).
    ``sampling_fb``: the front of the packed batch, the sampler's fields; ``adjust``: with
    ``penalized`` the token counts and the logit bias rows, [slots + 1, V] each, then with
    ``constrained`` the grammars' token bitmask [S, ceil(V / 32)] int32 (bit t % 32 of word
    t // 32: token t allowed)."""
    f = unpack_sampling(sampling_fb, num_seqs)
    slots = f["sample_slots"]
    if not all_greedy:
        logits = jax.lax.with_sharding_constraint(logits, whole)
    if penalized:
        counts, bias = adjust[:2]
        p = f["penalties"]
        logits = logits + p[:, 3:] * bias[slots]  # before the penalties, as HF and vLLM
        logits = apply_penalties(logits, counts[slots], p[:, 0], p[:, 1], p[:, 2])
    if constrained:
        v = jnp.arange(logits.shape[1])
        allowed = (adjust[-1][:, v // 32] >> (v % 32)) & 1
        logits = jnp.where(allowed == 1, logits, -jnp.inf)
    tokens = sample(ban(logits, f["banned"]), sampling_arrays(f), all_greedy=all_greedy,
                    truncated=truncated)
    if penalized:
        return token_buf.at[slots].set(tokens), tokens, counts.at[slots, tokens].add(2)
    return token_buf.at[slots].set(tokens), tokens


def ban(logits, banned):
    """``logits`` [S, V] with each row's ``banned`` token ids [S, B] (-1: none) at -inf."""
    rows = jnp.arange(logits.shape[0])[:, None]
    banned = jnp.where(banned >= 0, banned, logits.shape[1])  # out of range: dropped
    return logits.at[rows, banned].set(-jnp.inf, mode="drop")


def sampling_arrays(f) -> SamplingArrays:
    """The :class:`SamplingArrays` of the sampler's fields ``f`` (:func:`unpack_sampling`): the
    position a row samples is its ``kv_lens``."""
    return SamplingArrays(f["temperature"], f["top_k"], f["top_p"], f["min_p"], f["seed"],
                          f["kv_lens"])


def set_count_row(counts, slot, ids, num_prompt):
    """Row ``slot`` of the token counts from a sequence's ``ids`` (padded with out-of-range
    ids): 1 for a token of its first ``num_prompt`` (the prompt), + 2 per output occurrence."""
    is_prompt = jnp.arange(ids.shape[0]) < num_prompt
    row = jnp.zeros(counts.shape[1], jnp.int32)
    row = row.at[ids].max(is_prompt.astype(jnp.int32), mode="drop")
    row = row.at[ids].add(jnp.where(is_prompt, 0, 2), mode="drop")
    return counts.at[slot].set(row)


def set_bias_row(bias, slot, ids, values):
    """Row ``slot`` of the logit bias rows: ``values`` at ``ids`` (padded with out-of-range
    ids), zero elsewhere."""
    row = jnp.zeros(bias.shape[1], jnp.float32).at[ids].set(values, mode="drop")
    return bias.at[slot].set(row)
