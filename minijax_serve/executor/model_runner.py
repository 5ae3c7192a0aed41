"""ModelRunner: owns the device state (weights, KV pools and an FP8 cache's scales, token
buffer, token counts and logit bias rows) and the compiled programs of a step, on a mesh (of one
device unless tensor parallelism splits weights and pools: :mod:`.tensor_parallel`).

One step is two programs dispatched back to back: the model (gather input ids from the host or
the device token buffer, run the model over the ragged batch, return the logits) and the sampler
(sample on device, write the sampled tokens into the token buffer). The KV pools are donated
into the model and the token buffer into the sampler, each returned updated, so they are never
copied. Programs are compiled once per bucketed :class:`StepShape` (samplers once per number of
rows, greedy or not, sorting or not, plain or penalised) on first use, or all by ``warmup``.
Only a step with a request that asks for them dispatches more:

* penalties and logit bias: the sampler variant that reads each row's token counts and logit
  bias row ([slots + 1, V] each, allocated on first use), adds the bias, applies the penalties
  and adds the sampled tokens to the counts (donated); a request's rows are written when it
  gets its slot;
* logprobs: a third program over the raw logits, the log-softmax of the sampled token and of the
  top ``max_logprobs`` tokens of every sequence ([S, K+1] values and ids);
* prompt logprobs: a model variant (``StepShape.prompt_logprobs``) that computes the logits of
  every new token and returns the same [T, K+1] for the next token of each, given on the host.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from minijax_serve.attention.kv_cache import KVCache
from minijax_serve.core.sampling_params import MAX_LOGIT_BIAS
from minijax_serve.executor.buckets import StepShape
from minijax_serve.executor.forward_batch import (ForwardBatch, empty_forward_batch, pack,
                                                  sampling_size)
from minijax_serve.executor.processes import multi_process, place, to_global, to_local
from minijax_serve.executor.step_functions import (forward_step, jitted, logprobs_step,
                                                   sample_step, sampler_key, set_bias_row,
                                                   set_count_row, static)
from minijax_serve.executor.tensor_parallel import (POOL_SPEC, SCALES_SPEC, TPLayout,
                                                    logits_sharding, param_shardings, replicated)
from minijax_serve.models.config import ModelSpec
from minijax_serve.models.protocol import DecoderModel

Logprobs = tuple[jax.Array, jax.Array]  # (values float32, ids int32), [N, K+1]: chosen, then top K


class StepOutput(NamedTuple):
    """A dispatched step's device results (copies to the host already started)."""

    tokens: jax.Array  # [S] sampled token ids
    logprobs: Logprobs | None  # [S, K+1] of each sampled token, if requested
    prompt_logprobs: Logprobs | None  # [T, K+1] of each new token's next token, if requested
    done_at: float | None = None  # a simulated step: when it ends on the engine's clock


def default_compile_workers() -> int:
    """Programs compiled at once by default: one per CPU this process may use when the programs
    are for an accelerator, one on a CPU backend, whose compiler already spreads one program
    over the cores (side by side gained no more than the noise there: RESULTS.md, "Issue 26 on
    the CPU")."""
    return 1 if jax.default_backend() == "cpu" else len(os.sched_getaffinity(0))


class ModelRunner:
    def __init__(self, model: DecoderModel, cfg: ModelSpec, *, num_pages: int, page_size: int,
                 num_slots: int, kv: KVCache, attention_backend: str, layer_loop: str,
                 max_logprobs: int, context_length: int, tp: TPLayout):
        self.graphdef, params = nnx.split(model)
        # the weights travel as a flat list: flattening the NNX state (a few hundred leaves)
        # on every call cost ~0.6 ms of host time per step
        self.params, self.param_tree = jax.tree.flatten(params)
        self._model_statics = (static(self.graphdef), static(self.param_tree))
        pool_shape = (cfg.num_layers, cfg.num_kv_heads, num_pages, page_size, cfg.head_dim)
        self.mesh = tp.mesh
        self._global = multi_process()  # host inputs become global arrays (processes.py)
        # placed (and committed: the programs' persistent-cache keys depend on it) by the
        # model's partition specs, on a mesh of one device without tensor parallelism
        self.params = [place(p, s) for p, s in zip(self.params, param_shardings(model, params, tp))]
        self.replicated = replicated(tp)
        pools = NamedSharding(tp.mesh, POOL_SPEC)
        self.k_pool, self.v_pool = (jnp.zeros(pool_shape, kv.dtype, device=pools) for _ in "kv")
        self.kv_scales = tuple(place(s, NamedSharding(tp.mesh, SCALES_SPEC)) for s in kv.scales or ())
        self.token_buf = jnp.zeros((num_slots + 1,), jnp.int32,  # + the scratch row
                                   device=self.replicated)
        self.counts_shape = self._replicated((num_slots + 1, cfg.vocab_size), jnp.int32)
        self.bias_shape = self._replicated(self.counts_shape.shape, jnp.float32)
        # both allocated for the first request with a penalty or a logit bias
        self.token_counts: jax.Array | None = None
        self.logit_bias: jax.Array | None = None
        self.context_length = context_length  # the longest sequence whose counts are written
        self.attention_backend = attention_backend
        self.layer_loop = layer_loop
        self.max_logprobs = max_logprobs
        self.vocab_size = cfg.vocab_size
        self._programs: dict[tuple, jax.stages.Compiled] = {}
        self.compile_time_s = 0.0

    def _replicated(self, shape: tuple[int, ...], dtype) -> jax.ShapeDtypeStruct:
        """An input of the small programs (samplers, logprobs, row writers): whole on every
        device, stated so that XLA does not split it after the logits it meets."""
        return jax.ShapeDtypeStruct(shape, dtype, sharding=self.replicated)

    def _host(self, x):
        """A host input of a program: as it is, or a global array when processes share the mesh."""
        return to_global(x, self.replicated) if self._global else x

    @property
    def num_compilations(self) -> int:
        """Programs compiled: step shapes, samplers, logprobs programs, the row writers."""
        return len(self._programs)

    @property
    def step_shapes(self) -> set[StepShape]:
        """The step shapes compiled so far."""
        return {key[1] for key in self._programs if key[0] == "step"}

    def _program(self, key: tuple, lower: Callable[[], jax.stages.Lowered]) -> jax.stages.Compiled:
        """The program of ``key``, lowered and compiled on first use."""
        program = self._programs.get(key)
        if program is None:
            start = time.perf_counter()
            program = self._programs[key] = lower().compile()
            self.compile_time_s += time.perf_counter() - start
        return program

    def _step_lowering(self, shape: StepShape) -> Callable[[], jax.stages.Lowered]:
        def lower():
            targets = (np.zeros(shape.num_tokens, np.int32),) if shape.prompt_logprobs else ()
            return jitted(forward_step, 7, (8, 9)).lower(  # the pools donated
                *self._model_statics, self.attention_backend, self.layer_loop, self.mesh, shape,
                self.max_logprobs, self.params, self.k_pool, self.v_pool, self.kv_scales,
                self.token_buf, pack(empty_forward_batch(shape)), *targets)
        return lower

    def _sampler_lowering(self, num_seqs: int, greedy: bool, penalized: bool,
                          constrained: bool = False,
                          truncated: bool = True) -> Callable[[], jax.stages.Lowered]:
        def lower():
            front = self._replicated((sampling_size(num_seqs),), jnp.int32)
            adjust = (self.counts_shape, self.bias_shape) if penalized else ()
            if constrained:
                adjust += (self._replicated((num_seqs, (self.vocab_size + 31) // 32), jnp.int32),)
            donate = (6, 9) if penalized else (6,)  # the token buffer, the token counts
            return jitted(sample_step, 6, donate, self.replicated).lower(
                num_seqs, greedy, truncated, penalized, constrained, self.replicated,
                self.token_buf, self._logits(num_seqs), front, *adjust)
        return lower

    def _logprobs_lowering(self, num_seqs: int) -> Callable[[], jax.stages.Lowered]:
        return lambda: jitted(logprobs_step, 2).lower(
            self.max_logprobs, self.replicated, self._logits(num_seqs),
            self._replicated((num_seqs,), jnp.int32))

    def _counts_lowering(self) -> jax.stages.Lowered:
        scalar = self._replicated((), jnp.int32)
        return jitted(set_count_row, 0, (0,), self.replicated).lower(
            self.counts_shape, scalar, self._replicated((self.context_length,), jnp.int32),
            scalar)

    def _bias_lowering(self) -> jax.stages.Lowered:
        row = (self._replicated((MAX_LOGIT_BIAS,), t) for t in (jnp.int32, jnp.float32))
        return jitted(set_bias_row, 0, (0,), self.replicated).lower(
            self.bias_shape, self._replicated((), jnp.int32), *row)

    def _logits(self, num_seqs: int) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct((num_seqs, self.vocab_size), jnp.float32,
                                    sharding=logits_sharding(self.mesh, self.vocab_size))

    def compiled(self, shape: StepShape) -> jax.stages.Compiled:
        """The model step compiled for ``shape`` (on first use)."""
        return self._program(("step", shape), self._step_lowering(shape))

    def sampler(self, num_seqs: int, greedy: bool, penalized: bool,
                constrained: bool = False, truncated: bool = True) -> jax.stages.Compiled:
        """The sampler for ``num_seqs`` sequences, all greedy or not, penalised or not, under
        grammars' token masks or not (compiled on first use), sorting for top-k / p or not."""
        args = (num_seqs, greedy, penalized, constrained, truncated or greedy)
        return self._program(sampler_key(*args), self._sampler_lowering(*args))

    def logprobs_program(self, num_seqs: int) -> jax.stages.Compiled:
        """The log-softmax of the sampled and the top ``max_logprobs`` tokens of each sequence."""
        return self._program(("logprobs", num_seqs), self._logprobs_lowering(num_seqs))

    def _lowerings(self, shape: StepShape,
                   constrained: bool) -> dict[tuple, Callable[[], jax.stages.Lowered]]:
        """The step of ``shape`` and every program a step of its number of sequences (tokens, in
        a verify step) can dispatch (``constrained``: grammar-masked samplers too), by key."""
        n = shape.num_tokens if shape.verify else shape.num_seqs  # a verify step: every token
        masks = (False, True) if constrained else (False,)
        return {("step", shape): self._step_lowering(shape),
                **{sampler_key(n, g, p, c, t): self._sampler_lowering(n, g, p, c, t)
                   for g, t in ((True, True), (False, True), (False, False))
                   for p in (False, True) for c in masks},
                ("logprobs", n): self._logprobs_lowering(n),
                ("counts",): self._counts_lowering, ("bias",): self._bias_lowering}

    def compile_all(self, shapes: Iterable[StepShape], workers: int | None = None,
                    constrained: bool = False) -> None:
        """Compile, for every shape, the step and each program a step of its number of
        sequences can dispatch, with ``constrained`` the samplers under grammar masks too (for
        ``warmup``). Programs are lowered one after another, then compiled by ``workers``
        threads at once (default: :func:`default_compile_workers`): XLA releases the GIL."""
        todo: dict[tuple, Callable[[], jax.stages.Lowered]] = {}
        for shape in shapes:
            todo.update((k, f) for k, f in self._lowerings(shape, constrained).items()
                        if k not in self._programs)
        if not todo:
            return
        start = time.perf_counter()
        lowered = {key: lower() for key, lower in todo.items()}
        workers = workers or default_compile_workers()
        with ThreadPoolExecutor(max(1, min(workers, len(lowered)))) as pool:
            self._programs.update(zip(lowered, pool.map(jax.stages.Lowered.compile,
                                                        lowered.values())))
        self.compile_time_s += time.perf_counter() - start

    def set_token_counts(self, slot: int, prompt_ids: list[int], output_ids: list[int]) -> None:
        """Write the token counts of the request taking ``slot`` (1 for a token of its prompt,
        + 2 per occurrence in its output) before its first penalised step: one transfer of its
        token ids, at most the context length."""
        self._allocate_adjust()
        ids = np.full(self.context_length, self.counts_shape.shape[1], np.int32)  # out of range
        n = len(prompt_ids)
        ids[:n] = prompt_ids
        ids[n:n + len(output_ids)] = output_ids
        args = (self._host(x) for x in (np.int32(slot), ids, np.int32(n)))
        writer = self._program(("counts",), self._counts_lowering)
        self.token_counts = writer(self.token_counts, *args)

    def set_logit_bias(self, slot: int, bias: tuple[tuple[int, float], ...]) -> None:
        """Write the logit bias row of the request taking ``slot`` (its ``(token, bias)``
        pairs) before its first step."""
        self._allocate_adjust()
        ids = np.full(MAX_LOGIT_BIAS, self.vocab_size, np.int32)  # out of range
        values = np.zeros(MAX_LOGIT_BIAS, np.float32)
        ids[:len(bias)] = [token for token, _ in bias]
        values[:len(bias)] = [value for _, value in bias]
        args = (self._host(x) for x in (np.int32(slot), ids, values))
        self.logit_bias = self._program(("bias",), self._bias_lowering)(self.logit_bias, *args)

    def _allocate_adjust(self) -> None:
        """The token counts and logit bias rows, zero, on the first request that needs them
        (the penalised sampler reads both)."""
        if self.token_counts is None:
            self.token_counts, self.logit_bias = (
                jnp.zeros(s.shape, s.dtype, device=self.replicated)
                for s in (self.counts_shape, self.bias_shape))

    def run(self, fb: ForwardBatch, shape: StepShape, prompt_targets: np.ndarray | None = None,
            token_mask: Callable[[], np.ndarray] | None = None) -> StepOutput:
        """Launch one step of ``shape``: :meth:`forward`, then :meth:`sample` (``token_mask``:
        called once the model is dispatched, the grammars' allowed tokens as bits, [S, ceil(V /
        32)] int32, filled by the host while the device runs the model)."""
        logits, front, prompt_lps = self.forward(fb, shape, prompt_targets)
        return self.sample(logits, front, fb, shape.num_seqs, token_mask, prompt_lps)

    def forward(self, fb: ForwardBatch, shape: StepShape,
                prompt_targets: np.ndarray | None = None) -> tuple[jax.Array, jax.Array, tuple]:
        """Dispatch the model of ``shape`` over ``fb`` (the pools donated and replaced): its
        logits (:func:`forward_step`), the sampler's front and any prompt logprobs."""
        assert (len(fb.input_ids), len(fb.kv_lens)) == shape[:2], (shape, fb.page_table.shape)
        targets = () if prompt_targets is None else (self._host(prompt_targets),)
        self.k_pool, self.v_pool, logits, front, *prompt_lps = self.compiled(shape)(
            self.params, self.k_pool, self.v_pool, self.kv_scales, self.token_buf,
            self._host(pack(fb)), *targets)
        return logits, front, tuple(prompt_lps)

    def sample(self, logits: jax.Array, front: jax.Array | np.ndarray, fb: ForwardBatch,
               num_rows: int, token_mask: Callable[[], np.ndarray] | None = None,
               prompt_lps: tuple = ()) -> StepOutput:
        """Sample a token per row of ``logits`` by the sampler fields of ``front`` (device or
        host), with the program ``fb``'s flags pick (greedy or not, penalised or not: no device
        branch makes the host wait); tokens and logprobs start copying to the host."""
        penalized = fb.penalized
        sampler = self.sampler(num_rows, fb.all_greedy, penalized, token_mask is not None,
                               fb.truncated)
        adjust = (self.token_counts, self.logit_bias) if penalized else ()
        if token_mask is not None:
            adjust += (self._host(token_mask()),)
        front = self._host(front) if isinstance(front, np.ndarray) else front
        if penalized:
            self.token_buf, tokens, self.token_counts = sampler(self.token_buf, logits, front,
                                                                *adjust)
        else:
            self.token_buf, tokens = sampler(self.token_buf, logits, front, *adjust)
        logprobs = self.logprobs_program(num_rows)(logits, tokens) if fb.logprobs else None
        tokens, logprobs, prompt_lps = (
            to_local(tokens), None if logprobs is None else tuple(map(to_local, logprobs)),
            tuple(map(to_local, prompt_lps)) if prompt_lps else None)
        for x in (tokens, *(logprobs or ()), *(prompt_lps or ())):
            x.copy_to_host_async()
        return StepOutput(tokens, logprobs, prompt_lps)
