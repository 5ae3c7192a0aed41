"""EngineConfig: every knob of the engine, with defaults (SGLang's where they apply)."""

from __future__ import annotations

import dataclasses

from minijax_serve.config.names import (ATTENTION_BACKENDS, KV_CACHE_DTYPES, POLICY_NAMES,
                                        QUANTIZATIONS, RETRACT_POLICIES, SIMULATED_DEVICES,
                                        SIMULATED_HOST_TIMES, SPECULATIVE_METHODS)
from minijax_serve.core.sampling_params import MAX_LOGPROBS, MAX_SEED, _float, _int

# int field -> (least, most) value; one typed ``int | None`` may also be None. A context
# holds at least a prompt token and a new one.
INT_LIMITS = {
    "page_size": (1, None), "max_total_tokens": (1, None), "context_length": (2, None),
    "max_running_requests": (1, None), "max_prefill_tokens": (1, None),
    "min_token_bucket": (1, None), "min_seq_bucket": (1, None), "min_kv_bucket": (1, None),
    "seed": (0, MAX_SEED), "lpm_max_queue": (1, None), "chunked_prefill_size": (-1, None),
    "new_token_ratio_decay_steps": (1, None), "retract_decode_steps": (0, None),
    "force_retract_every": (0, None), "max_logprobs": (0, MAX_LOGPROBS),
    "tensor_parallel_size": (1, None), "num_speculative_tokens": (1, None),
    "speculative_draft_layers": (1, None), "speculative_ngram_min": (1, None),
    "speculative_ngram_max": (1, None),
}


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Configuration of an :class:`~minijax_serve.Engine`; every field is a keyword of ``Engine``.
    Checked when made (:meth:`validate`), as :class:`~minijax_serve.SamplingParams` is; what an
    attention backend can run (page sizes, shapes, dtypes) is checked by its registry
    (:mod:`minijax_serve.attention.registry`) when an engine is made, before any weight loads.

    Bucket sets: steps are compiled for padded shapes only. New-token counts of prefill steps are
    powers of two from ``min_token_bucket`` up to the most a step can carry (the chunk size under
    chunked prefill; else ``max_prefill_tokens`` or the context length, whichever is larger);
    sequence counts of decode steps are powers of two and their 1.5× midpoints (8, 12, 16, 24,
    ...) from ``min_seq_bucket`` up to ``max_running_requests`` (a decode step of a few sequences
    is bound by reading the weights, so padding it to 8 costs nothing measurable, while a wide
    one is bound by its matmuls, so padding 33 to 64 would nearly double it); page-table widths are powers of two (in tokens) from ``min_kv_bucket``
    up to the context length. ``min_kv_bucket=None`` (the default) keeps one width, the whole
    context: the reference attention's loops stop at the longest sequence actually in the batch,
    so a wide page table costs nothing measurable either, and every width bucket would multiply
    the compilations (see benchmarks/RESULTS.md).

    Layer loop: ``layer_loop="scan"`` runs the decoder layers in one ``jax.lax.scan`` (compiled
    once) whose body picks each layer's weight matrices with a ``jax.lax.switch``; ``"unroll"``
    writes the layers out one after another (no branch; compile time grows with the depth). On
    a GPU, XLA copies a branch's index to the host and waits for it, so a switch in every layer
    makes each step's launch wait for the device; on CPU a branch is free and unrolling SmolLM2
    took ~5× the compile time. ``"auto"``: scan on CPU, unroll elsewhere (docs/kernels.md "GPU").

    Prefix cache (docs/scheduler.md "Prefix cache (RadixAttention)"): ``enable_radix_cache`` keeps the KV of
    finished and running requests' prefixes in a radix tree for later requests to reuse (False:
    nothing is shared). ``schedule_policy`` orders the waiting queue: ``fcfs``, ``lpm`` (longest
    cached prefix first; fcfs above ``lpm_max_queue`` waiting requests), ``dfs-weight``, ``lof``
    (longest max_new_tokens first), ``random`` (seeded by ``seed``). Requests admitted in the
    same step share a prefix too: the whole pages one of them computes join the cache before
    the step runs, and the others borrow them.

    Limits sized from the device (:mod:`minijax_serve.engine.limits`, docs/scheduler.md
    "Limits"): left None, ``max_total_tokens``, ``max_running_requests``, ``chunked_prefill_size``,
    ``max_prefill_tokens`` and ``enable_mixed_chunk`` take SGLang's rules on an accelerator (the
    pool ``mem_fraction_static`` of the free memory, the running requests from the pool and the
    context, the chunk by the device's memory: 8192 tokens on an H100 or H200, the prefill
    budget 16384, unified steps) and modest defaults on a CPU (a pool of at most 4 GiB or
    ``max_running_requests`` (64) × the context, whichever is smaller; chunks of 512 tokens,
    4096 prefill tokens, prefill and decode steps apart); the engine's startup line says what
    it chose.

    Chunked prefill and admission (docs/scheduler.md "Chunked prefill, mixed batches and retract"):
    ``chunked_prefill_size`` bounds the new tokens of one step; a longer prompt is prefilled in
    page-aligned chunks over several steps (-1: off, a prompt then runs whole; a chosen size
    is a multiple of ``page_size``). ``enable_mixed_chunk`` makes every step one ragged batch:
    the running requests' decode tokens and as many prompt tokens (whole prompts or chunks) as
    the chunk leaves (vLLM V1's and tpu-inference's unified step; SGLang's mixed chunk,
    generalised), so that arriving prompts ride along with the decode batch; needs chunking.
    Admission reserves ``new_token_ratio`` × remaining max_new_tokens of KV for every
    request: the ratio starts at ``min(init_new_token_ratio × schedule_conservativeness, 1)``,
    decays linearly to ``min_new_token_ratio_factor`` × that over ``new_token_ratio_decay_steps``
    decode steps, is raised after a retract to the running batch's decoded share plus
    ``retract_decode_steps`` tokens per request, and resets when the engine is idle (init = min =
    1.0 reserves every request's whole max_new_tokens: no over-commit, no retract). An
    ``ignore_eos`` request writes exactly its max_new_tokens, so with
    ``exact_ignore_eos_admission`` (default) it is admitted only if the pool holds everyone's
    known future instead (SGLang does so only with the radix cache off). When a decode
    step cannot get its pages even after evicting the cache, requests are retracted in
    ``retract_policy`` order (``length``: fewest generated tokens first, ties longest prompt;
    ``fcfs``: latest arrival first) and re-prefilled later. ``force_retract_every`` (decode steps;
    0 off) retracts one request on that period, to test the path; a request retracted before is
    forced again only once one more of its tokens has reached the host, so every request advances.

    Overlap scheduling (docs/scheduler.md "Overlap scheduling"): with ``enable_overlap`` (default) each tick
    dispatches the next step before taking the previous step's tokens, so the host's scheduling
    and result processing run while the device computes.

    ``max_logprobs``: the top log-probabilities computed per token for requests that ask for
    logprobs (their programs are compiled at this width; a request may ask for up to it).
    ``record_steps``: keep a :class:`~minijax_serve.engine.trace.StepRecord` per dispatched step
    (``Engine.step_records``; docs/scheduler.md "Step trace").

    ``tensor_parallel_size``: split the model over this many devices (a mesh with one axis,
    ``"tp"``; docs/parallel_and_simulator.md "Tensor parallelism"): heads and the MLP's intermediate size over devices,
    the KV pools over KV heads; the scheduler is unchanged.

    ``simulate``: run no model; the real scheduler is driven by a cost model of the named
    device profile (``"h200"``, ``"h100"``, ``"cpu"``; docs/parallel_and_simulator.md "Simulated accelerator"): no
    weights are loaded, the KV pool is sized from the profile's memory, the tokens are dummies
    (never an EOS) and every time the engine stamps is on a virtual clock. With
    ``tensor_parallel_size``, a group of that many simulated devices. ``simulated_host_time``:
    ``"measured"`` (default) counts the host's real time (the real scheduler's, as this machine
    runs it) beside the profile's dispatch cost; ``"modeled"`` counts the dispatch cost alone,
    so a simulated run gives the same figures on every run and machine, however loaded.

    FP8 (docs/quantization.md): ``quantization="fp8"`` stores the decoder layers' linear weights in
    float8_e4m3fn with one float32 scale per output channel, quantized when loaded (an FP8
    checkpoint, ``quant_method: "fp8"`` in its config.json, is read as it is stored; its
    scales are required), and multiplies them dequantised in the matmul; ``"fp8_w8a8"`` also
    quantizes each token's activations to FP8 (a scale per token) and multiplies FP8 by FP8
    (which of the two is faster awaits a GPU measurement). The embedding and the LM head stay
    in ``dtype``. ``kv_cache_dtype="fp8_e4m3"`` keeps the KV pools in float8_e4m3fn with a
    static scale per layer and KV head (calibrated when the engine starts), so the pool sized
    from free memory holds about twice the tokens; every attention backend dequantises in its
    loads ("auto": the model's ``dtype``).

    Speculative decoding (docs/speculative.md): ``speculative_method`` ``"ngram"`` (prompt
    lookup: the tokens that followed the longest earlier match, ``speculative_ngram_min`` to
    ``speculative_ngram_max`` tokens long, of the sequence's suffix) or ``"draft"`` (a draft model
    of the same vocabulary, ``speculative_draft_model``, by default the target itself, cut to its
    first ``speculative_draft_layers`` layers if given) proposes up to
    ``num_speculative_tokens`` tokens per running request; the target verifies them in one ragged
    step. Greedy outputs are unchanged; sampled ones keep the target's distribution (rejection
    sampling). A simulated engine's tokens are dummies, so its proposals are too: each is
    accepted with probability ``speculative_simulated_acceptance``.

    ``compilation_cache``: turn on JAX's persistent compilation cache when the engine is created
    (in ``$MINIJAX_SERVE_CACHE/jax``, every program; a directory configured already is kept), so
    a later engine of the same shapes, in this process or another, loads its programs instead of
    compiling them. False (or ``MINIJAX_SERVE_COMPILATION_CACHE=0``) leaves JAX's settings as
    they are (:mod:`minijax_serve.engine.compilation_cache`).
    """

    dtype: str = "auto"  # "auto": float32 on CPU, bfloat16 on GPU/TPU
    load_format: str = "auto"  # "auto" (safetensors + Orbax cache), "safetensors", "dummy"
    page_size: int = 16
    max_total_tokens: int | None = None  # KV pool size in tokens; None: from the device
    mem_fraction_static: float = 0.85
    context_length: int | None = None  # None: the model's context limit (ModelSpec.context_limit)
    max_running_requests: int | None = None  # None: from the pool (accelerators), 64 (CPU)
    max_prefill_tokens: int | None = None  # None: 16384 (accelerators), 4096 (CPU)
    min_token_bucket: int = 32
    min_seq_bucket: int = 8
    min_kv_bucket: int | None = None  # None: one page-table width, the whole context
    # "auto": "pallas" on GPU, "xla" (the jnp reference) elsewhere; "pallas_mgpu": opt-in
    attention_backend: str = "auto"
    layer_loop: str = "auto"  # "auto": "scan" on CPU, "unroll" elsewhere
    skip_tokenizer_init: bool = False
    seed: int = 0  # in [0, 2**32): the random schedule policy, unseeded requests, dummy weights
    enable_radix_cache: bool = True
    schedule_policy: str = "lpm"  # fcfs, lpm, dfs-weight, lof, random
    lpm_max_queue: int = 128  # lpm falls back to fcfs above this many waiting requests
    chunked_prefill_size: int | None = None  # None: from the device (engine/limits.py); -1: off
    enable_mixed_chunk: bool | None = None  # None: unified steps on accelerators, not on CPU
    schedule_conservativeness: float = 1.0
    init_new_token_ratio: float = 0.7
    min_new_token_ratio_factor: float = 0.14
    new_token_ratio_decay_steps: int = 600
    retract_decode_steps: int = 20
    exact_ignore_eos_admission: bool = True
    retract_policy: str = "length"  # length, fcfs
    force_retract_every: int = 0  # decode steps; 0: off (a test switch)
    enable_overlap: bool = True
    max_logprobs: int = 20  # most top log-probabilities a request may ask for (vLLM's default)
    record_steps: bool = False  # one StepRecord per dispatched step (Engine.step_records)
    compilation_cache: bool = True  # persistent JAX compilation cache (compilation_cache.py)
    tensor_parallel_size: int = 1  # devices the model is split over (executor/tensor_parallel.py)
    simulate: str | None = None  # a device profile (h200, h100, cpu): no device (simulate/)
    simulated_host_time: str = "measured"  # or "modeled": the profile's dispatch cost alone
    quantization: str | None = None  # None, "fp8", "fp8_w8a8" (models/quantize.py)
    kv_cache_dtype: str = "auto"  # "auto" (= dtype) or "fp8_e4m3" (attention/kv_cache.py)
    speculative_method: str | None = None  # None (off), "ngram" or "draft" (speculative/)
    num_speculative_tokens: int = 4  # tokens proposed per request and step (k)
    speculative_draft_model: str | None = None  # "draft": an alias or directory; None: the target
    speculative_draft_layers: int | None = None  # "draft": keep the draft's first N layers
    speculative_ngram_min: int = 1  # "ngram": shortest suffix matched
    speculative_ngram_max: int = 4  # "ngram": longest suffix matched
    speculative_simulated_acceptance: float = 0.7  # simulate: chance a proposed token is accepted

    def __post_init__(self):
        self.validate()

    def resolved_attention_backend(self, backend: str) -> str:
        """"pallas", "pallas_mgpu" or "xla" on ``backend`` (jax.default_backend()); Pallas on
        CPU is interpreted."""
        if self.attention_backend == "auto":
            return "pallas" if backend == "gpu" else "xla"
        return self.attention_backend

    def resolved_layer_loop(self, backend: str) -> str:
        """"scan" or "unroll" on ``backend`` (jax.default_backend())."""
        if self.layer_loop == "auto":
            return "scan" if backend == "cpu" else "unroll"
        return self.layer_loop

    def validate(self) -> None:
        """Raise ValueError naming the field and its limit if a field has the wrong type (a
        bool is not an int), is out of range or clashes with another; numbers are stored as
        int and float (numpy's are taken). Runs when the config is made."""
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.type == "bool" and not isinstance(value, bool):
                raise ValueError(f"{f.name} must be True or False, got {value!r}")
            if f.type == "bool | None" and not isinstance(value, (bool, type(None))):
                raise ValueError(f"{f.name} must be True, False or None, got {value!r}")
            if f.type == "float":
                object.__setattr__(self, f.name, _float(f.name, value))
            elif f.type in ("int", "int | None") and (value is not None or f.type == "int"):
                object.__setattr__(self, f.name, _int(f.name, value, *INT_LIMITS[f.name]))
        if self.max_total_tokens is not None and self.max_total_tokens < self.page_size:
            raise ValueError(
                f"max_total_tokens must be >= page_size={self.page_size}, got {self.max_total_tokens}"
            )
        if not 0.0 < self.mem_fraction_static < 1.0:
            raise ValueError(f"mem_fraction_static must be in (0, 1), got {self.mem_fraction_static}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, "
                             f"got {self.attention_backend!r}")
        if self.layer_loop not in ("auto", "scan", "unroll"):
            raise ValueError(f"layer_loop must be 'auto', 'scan' or 'unroll', got {self.layer_loop!r}")
        if self.load_format not in ("auto", "safetensors", "dummy"):
            raise ValueError(f"load_format must be auto, safetensors or dummy, got {self.load_format!r}")
        if self.schedule_policy not in POLICY_NAMES:
            raise ValueError(
                f"schedule_policy must be one of {', '.join(POLICY_NAMES)}, got {self.schedule_policy!r}"
            )
        chunk = self.chunked_prefill_size
        if chunk is not None and chunk != -1 and (chunk < self.page_size or chunk % self.page_size):
            raise ValueError(
                f"chunked_prefill_size must be -1 (off) or a positive multiple of "
                f"page_size={self.page_size}, got {chunk}"
            )
        if self.enable_mixed_chunk and chunk == -1:
            raise ValueError("enable_mixed_chunk=True needs chunked prefill, but "
                             "chunked_prefill_size=-1 (off)")
        for name in ("init_new_token_ratio", "min_new_token_ratio_factor"):
            if not 0.0 < getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in (0, 1], got {getattr(self, name)}")
        if self.schedule_conservativeness <= 0:
            raise ValueError(f"schedule_conservativeness must be > 0, got {self.schedule_conservativeness}")
        if self.retract_policy not in RETRACT_POLICIES:
            names = " or ".join(map(repr, RETRACT_POLICIES))
            raise ValueError(f"retract_policy must be {names}, got {self.retract_policy!r}")
        if self.simulated_host_time not in SIMULATED_HOST_TIMES:
            raise ValueError(f"simulated_host_time must be {' or '.join(SIMULATED_HOST_TIMES)}, "
                             f"got {self.simulated_host_time!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be None, 'fp8' or 'fp8_w8a8', got "
                             f"{self.quantization!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be 'auto' or 'fp8_e4m3', got "
                             f"{self.kv_cache_dtype!r}")
        if self.simulate is not None and self.simulate not in SIMULATED_DEVICES:
            raise ValueError(f"simulate must be one of {', '.join(SIMULATED_DEVICES)} or None, "
                             f"got {self.simulate!r}")
        self._validate_speculative()

    def _validate_speculative(self) -> None:
        method = self.speculative_method
        if method is not None and method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_method must be None, 'ngram' or 'draft', got {method!r}")
        for name in ("speculative_draft_model", "speculative_draft_layers"):
            if getattr(self, name) is not None and method != "draft":
                raise ValueError(f"{name} needs speculative_method='draft', got "
                                 f"speculative_method={method!r}")
        if self.speculative_ngram_max < self.speculative_ngram_min:
            raise ValueError(f"speculative_ngram_max must be >= speculative_ngram_min="
                             f"{self.speculative_ngram_min}, got {self.speculative_ngram_max}")
        if not 0.0 <= self.speculative_simulated_acceptance <= 1.0:
            raise ValueError(f"speculative_simulated_acceptance must be in [0, 1], got "
                             f"{self.speculative_simulated_acceptance}")
        if method == "draft" and self.simulate is not None:
            raise ValueError("speculative_method='draft' cannot be simulated (no draft model "
                             "runs); simulate speculative_method='ngram'")
        if method == "draft" and self.kv_cache_dtype != "auto":
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r} with speculative_method="
                             "'draft' is not supported (the draft model's KV is the model's "
                             "dtype); use kv_cache_dtype='auto' or speculative_method='ngram'")
