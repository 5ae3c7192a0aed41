"""Engine: tokenizer + scheduler + model runner, behind a generate / step API."""

from __future__ import annotations

import dataclasses
import itertools
import os
import time
from pathlib import Path
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from minijax_serve.config import EngineConfig
from minijax_serve.detokenizer import Detokenizer
from minijax_serve.executor.buckets import Buckets
from minijax_serve.executor.forward_batch import lower
from minijax_serve.executor.model_runner import ModelRunner
from minijax_serve.memory import NoPrefixCache, PageAllocator, RadixCache, RequestSlots, SlotTable
from minijax_serve.memory.slot_table import MAX_BANNED_TOKENS
from minijax_serve.models.attention import pallas_kernels_run
from minijax_serve.models.loader import load_model
from minijax_serve.models.registry import resolve_model
from minijax_serve.request import Req, RequestOutput, SamplingParams
from minijax_serve.scheduler import ScheduleBatch, Scheduler, SchedulerLimits
from minijax_serve.scheduler.policy import SchedulePolicy
from minijax_serve.scheduler.retract import NewTokenRatio
from pallas_kernels.ragged_paged_attention import check_shapes

Prompt = str | Sequence[int]


def _attention_backend(config: EngineConfig, cfg: Any) -> str:
    """"pallas" or "xla". "auto" takes the kernels only where they run and support the model's
    shapes; an explicit "pallas" raises ValueError for shapes the kernels do not support."""
    backend = config.resolved_attention_backend(jax.default_backend())
    if backend == "pallas":
        try:
            check_shapes(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, config.page_size)
        except ValueError:
            if config.attention_backend != "auto":
                raise
            return "xla"
        if config.attention_backend == "auto" and not pallas_kernels_run():
            return "xla"
    return backend


def _default_dtype(name: str):
    if name == "auto":
        return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    return jnp.dtype(name)


def _free_device_bytes() -> int:
    stats = jax.devices()[0].memory_stats()
    if stats and "bytes_limit" in stats:
        return stats["bytes_limit"] - stats.get("bytes_in_use", 0)
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def load_tokenizer(path: Path):
    """The HF tokenizer of a model directory (offline, no remote code)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    if not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        raise FileNotFoundError(
            f"{path}: no tokenizer.json or tokenizer_config.json; pass skip_tokenizer_init=True "
            "to use token ids only"
        )
    return AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)


class Engine:
    """Serves many requests at once from a fixed, paged KV-cache pool.

    >>> engine = Engine("smollm2-135m", max_total_tokens=32768)
    >>> engine.generate(["The capital of France is"], SamplingParams(max_new_tokens=8))[0].text
    """

    def __init__(self, model: str | Path, config: EngineConfig | None = None, **overrides: Any):
        config = dataclasses.replace(config or EngineConfig(), **overrides)
        config.validate()
        resolved = resolve_model(model)
        load_format = "dummy" if resolved.dummy else config.load_format
        self.config = config
        self.dtype = _default_dtype(config.dtype)
        loaded = load_model(resolved.path, dtype=self.dtype, load_format=load_format, seed=config.seed)
        self.model_config = cfg = loaded.config
        self.load_time_s = loaded.load_time_s
        skip_tok = config.skip_tokenizer_init or resolved.dummy
        self.tokenizer = None if skip_tok else load_tokenizer(resolved.path)
        self._detok = None if skip_tok else Detokenizer(self.tokenizer)

        self.context_length = config.context_length or cfg.max_position_embeddings
        if self.context_length > cfg.max_position_embeddings:
            raise ValueError(
                f"context_length={self.context_length} exceeds the model's "
                f"max_position_embeddings={cfg.max_position_embeddings}"
            )
        ps = config.page_size
        max_tokens = config.max_total_tokens or self._pool_tokens_from_memory()
        num_pages = max_tokens // ps + 1  # + the scratch page
        self.allocator = PageAllocator(num_pages, ps)
        self.slots = RequestSlots(config.max_running_requests)
        self.chunked_prefill_size = config.resolved_chunked_prefill_size(jax.default_backend())
        step_tokens = max(config.max_prefill_tokens, self.context_length)  # one prompt runs whole
        if self.chunked_prefill_size is not None:
            mixed_decoders = config.max_running_requests if config.enable_mixed_chunk else 0
            step_tokens = min(self.chunked_prefill_size, step_tokens + mixed_decoders)
        self.attention_backend = backend = _attention_backend(config, cfg)
        self.buckets = Buckets.build(
            max_step_tokens=step_tokens,
            max_running_requests=config.max_running_requests,
            context_length=self.context_length, page_size=ps,
            min_token_bucket=config.min_token_bucket, min_seq_bucket=config.min_seq_bucket,
            min_kv_bucket=config.min_kv_bucket, split_decode=backend == "pallas",
        )
        self.runner = ModelRunner(loaded.model, num_pages=num_pages, page_size=ps,
                                  num_slots=config.max_running_requests, dtype=self.dtype,
                                  attention_backend=backend,
                                  layer_loop=config.resolved_layer_loop(jax.default_backend()))
        radix = config.enable_radix_cache  # without it, in-batch dedup would only delay requests
        self.prefix_cache = (RadixCache if radix else NoPrefixCache)(self.allocator)
        policy = SchedulePolicy(config.schedule_policy, self.prefix_cache,
                                lpm_max_queue=config.lpm_max_queue, seed=config.seed)
        limits = SchedulerLimits(
            max_running=config.max_running_requests, max_prefill_tokens=config.max_prefill_tokens,
            chunk_tokens=self.chunked_prefill_size, mixed=config.enable_mixed_chunk,
            in_batch_prefix_threshold=config.in_batch_prefix_threshold if radix else 0,
            retract_policy=config.retract_policy, force_retract_every=config.force_retract_every,
            exact_ignore_eos=config.exact_ignore_eos_admission)
        init_ratio = min(config.init_new_token_ratio * config.schedule_conservativeness, 1.0)
        ratio = NewTokenRatio(init_ratio, min(init_ratio * config.min_new_token_ratio_factor, 1.0),
                              config.new_token_ratio_decay_steps, config.retract_decode_steps)
        self.slot_table = SlotTable(config.max_running_requests, self.buckets.pages[-1])
        self.scheduler = Scheduler(allocator=self.allocator, slots=self.slots, table=self.slot_table,
                                   cache=self.prefix_cache, policy=policy, limits=limits,
                                   ratio=ratio, eos_ids=cfg.eos_token_ids)
        self._rng = np.random.default_rng(config.seed)
        self._ids = itertools.count()
        self._reqs: dict[str, Req] = {}
        self._stats = dict.fromkeys(
            ["prompt_tokens", "prefill_tokens_computed", "generated_tokens", "prefill_steps",
             "decode_steps", "mixed_steps", "chunked_steps", "peak_kv_tokens_used"], 0)
        self._stats.update(host_time_s=0.0, blocked_time_s=0.0)
        self._usage_sum = 0.0  # KV usage summed over steps, for its mean
        self._queued_steps, self._queued_usage_sum = 0, 0.0  # the same over steps with a queue
        self._wall_s = self._idle_bound_s = 0.0  # ticks' wall time, device-idle upper bound
        self._in_flight: tuple[ScheduleBatch, jax.Array] | None = None

    def _pool_tokens_from_memory(self) -> int:
        per_token = self.model_config.kv_bytes_per_token(jnp.dtype(self.dtype).itemsize)
        tokens = int(_free_device_bytes() * self.config.mem_fraction_static) // per_token
        return max(self.config.page_size,
                   min(tokens, self.config.max_running_requests * self.context_length))

    @property
    def kv_pool_tokens(self) -> int:
        return self.allocator.total_pages * self.allocator.page_size

    @property
    def kv_tokens_used(self) -> int:
        """KV pool tokens held by requests (their own pages and the cached pages they lock);
        evictable prefix-cache pages count as available, as in SGLang."""
        held_pages = self.allocator.total_pages - self.allocator.num_free
        return held_pages * self.allocator.page_size - self.prefix_cache.evictable_size

    # -- requests -------------------------------------------------------------------------

    def _prompt_ids(self, prompt: Any) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt: text prompts need a tokenizer (skip_tokenizer_init=True)")
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple, np.ndarray)) and all(
            isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in prompt
        ):
            ids = [int(t) for t in prompt]
        else:
            raise ValueError(f"prompt must be a str or a list of token ids, got {type(prompt).__name__}")
        if not ids:
            raise ValueError("prompt is empty: it must have at least 1 token")
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})")
        return ids

    def _validate(self, ids: list[int], params: SamplingParams) -> None:
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
        params.validate()
        total = len(ids) + params.max_new_tokens
        if total > self.context_length:
            raise ValueError(
                f"prompt ({len(ids)} tokens) + max_new_tokens ({params.max_new_tokens}) = {total} "
                f"exceeds the context length {self.context_length}"
            )
        if self.allocator.pages_for(total) > self.allocator.total_pages:
            raise ValueError(
                f"prompt ({len(ids)} tokens) + max_new_tokens ({params.max_new_tokens}) = {total} "
                f"exceeds the KV pool ({self.kv_pool_tokens} tokens)"
            )
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in params.stop_token_ids):
            raise ValueError(f"stop_token_ids must be in [0, {vocab})")
        banned = len(set(self.model_config.eos_token_ids) | set(params.stop_token_ids))
        if params.min_new_tokens > 0 and banned > MAX_BANNED_TOKENS:
            raise ValueError(
                f"stop_token_ids: with min_new_tokens > 0 at most {MAX_BANNED_TOKENS} stop and EOS "
                f"tokens can be masked, got {banned}"
            )
        if params.stop and self.tokenizer is None:
            raise ValueError("stop: stop strings need a tokenizer (skip_tokenizer_init=True)")

    def _make_req(self, prompt: Prompt, params: SamplingParams, request_id: str | None) -> Req:
        ids = self._prompt_ids(prompt)
        self._validate(ids, params)
        rid = str(next(self._ids)) if request_id is None else str(request_id)
        if rid in self._reqs:
            raise ValueError(f"request_id {rid!r} is already in use")
        seed = params.seed if params.seed is not None else int(self._rng.integers(2**32))
        return Req(rid, ids, params, seed, time.perf_counter())

    def _enqueue(self, req: Req) -> None:
        self._reqs[req.rid] = req
        self._stats["prompt_tokens"] += len(req.prompt_ids)
        self.scheduler.add(req)

    def add_request(self, prompt: Prompt, sampling_params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Validate and queue one request; returns its id. Raises ValueError on bad input."""
        req = self._make_req(prompt, sampling_params or SamplingParams(), request_id)
        self._enqueue(req)
        return req.rid

    def has_unfinished(self) -> bool:
        """Requests are queued or running, or a dispatched step's tokens are not taken yet."""
        return self.scheduler.has_unfinished() or self._in_flight is not None

    def step(self) -> list[RequestOutput]:
        """Run one scheduler tick; returns the requests whose new tokens reached the host.

        With ``enable_overlap`` the tick dispatches the next step first and then takes the
        previous step's tokens (blocking only if the device has not finished it), so the host's
        work hides behind the device's and outputs trail the device by one step.
        """
        start = time.perf_counter()
        launched = self._launch()
        if self.config.enable_overlap:
            done, self._in_flight = self._in_flight, launched
        else:
            done = launched
        blocked = 0.0
        outputs: list[RequestOutput] = []
        if done is not None:
            outputs, blocked = self._process(*done)
        if launched is not None or done is not None:
            self._stats["host_time_s"] += time.perf_counter() - start - blocked
            self._stats["blocked_time_s"] += blocked
            wall = time.perf_counter() - start
            self._wall_s += wall
            # the device may have idled during the host's work when the host did not wait
            # for it (an upper bound); without overlap it idles through all of the host's work
            if not self.config.enable_overlap or blocked < 1e-4:
                self._idle_bound_s += wall - blocked
        return outputs

    def _launch(self) -> tuple[ScheduleBatch, jax.Array] | None:
        """Schedule, lower and dispatch one step (asynchronously); None if nothing to run."""
        batch = self.scheduler.schedule()
        if batch is None:
            return None
        used = self.kv_tokens_used
        self._stats["peak_kv_tokens_used"] = max(self._stats["peak_kv_tokens_used"], used)
        self._usage_sum += used / self.kv_pool_tokens
        if self.scheduler.waiting:  # requests left waiting: the pool is the limit
            self._queued_steps += 1
            self._queued_usage_sum += used / self.kv_pool_tokens
        num_pages = int(self.slot_table.num_pages[batch.slots].max())
        if batch.is_prefill:
            shape = self.buckets.prefill_shape(sum(batch.new_tokens), num_pages)
        else:
            shape = self.buckets.decode_shape(len(batch.reqs), num_pages)
        fb = lower(batch, self.slot_table, shape, self.allocator.page_size, self.slots.scratch_slot)
        tokens = self.runner.run(fb, shape)
        self._count_step(batch)
        self.scheduler.launched(batch)
        return batch, tokens

    def _process(self, batch: ScheduleBatch, tokens: jax.Array) -> tuple[list[RequestOutput], float]:
        """Take a launched step's tokens: stop checks, detokenization, freeing; returns the
        outputs and the seconds spent waiting for the device."""
        wait = time.perf_counter()
        host_tokens = np.asarray(tokens)
        now = time.perf_counter()
        got_token = self.scheduler.process(batch, host_tokens, now)
        self._stats["generated_tokens"] += len(got_token)
        outputs = []
        for req in got_token:
            if self._detok is not None:
                self._detok.update(req)
                if req.finished:
                    self.scheduler.release(req, now)
            outputs.append(req.output())
            if req.finished:
                del self._reqs[req.rid]
        return outputs, now - wait

    def _count_step(self, batch: ScheduleBatch) -> None:
        kind = "mixed_steps" if batch.is_mixed else "prefill_steps" if batch.is_prefill else "decode_steps"
        self._stats[kind] += 1
        self._stats["prefill_tokens_computed"] += sum(batch.new_tokens[:batch.num_prefill])
        chunked = self.scheduler.chunked  # before processing: also the one on its last chunk
        if chunked is not None and chunked in batch.reqs[:batch.num_prefill]:
            self._stats["chunked_steps"] += 1

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 ) -> list[RequestOutput]:
        """Generate for every prompt (continuous batching); outputs in the order of the prompts.

        Every prompt is validated before any is queued.
        """
        if isinstance(prompts, str) or (
            isinstance(prompts, (list, tuple)) and prompts and isinstance(prompts[0], (int, np.integer))
        ):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise ValueError(f"prompts must be a list of prompts, got {type(prompts).__name__}")
        params = SamplingParams() if sampling_params is None else sampling_params
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        elif not isinstance(params, (list, tuple)):
            raise ValueError(f"sampling_params must be SamplingParams or a list of them, got "
                             f"{type(params).__name__}")
        if len(params) != len(prompts):
            raise ValueError(f"sampling_params: got {len(params)} for {len(prompts)} prompts")
        reqs = [self._make_req(p, sp, None) for p, sp in zip(prompts, params)]
        for req in reqs:
            self._enqueue(req)
        while any(not r.finished for r in reqs):
            self.step()
        if not self.scheduler.has_unfinished():
            self.step()  # take the last dispatched step (its tokens belong to finished requests)
        return [r.output() for r in reqs]

    # -- introspection --------------------------------------------------------------------

    def warmup(self) -> int:
        """Compile every step shape the configuration can produce; returns how many."""
        shapes = self.buckets.all_shapes()
        for shape in shapes:
            self.runner.compiled(shape)
        return len(shapes)

    def stats(self) -> dict[str, float]:
        """Counters since the engine started, and the current state of the pool and the ratio.

        ``cached_tokens``: tokens admissions took from the prefix cache instead of computing;
        ``prefill_tokens_computed``: tokens prefilled (re-prefills after a retract included);
        ``cache_hit_rate``: the cached share of both; ``evicted_tokens``: prefix-cache tokens
        evicted to make room. KV usage counts pages held by requests, not evictable cached ones:
        ``kv_tokens_used`` now, ``peak_kv_tokens_used``, ``token_usage`` (now, over the pool) and
        ``mean_token_usage`` (its mean over the steps run; ``mean_token_usage_queued`` over the
        steps that left requests waiting, when admission is what limits the batch). ``chunked_steps``: steps carrying a
        chunk of a prompt prefilled over several steps; ``mixed_steps``: prefill steps that also
        decoded; ``num_retracted``: requests sent back to the queue to free KV.

        Host and device: ``host_time_s`` (scheduling, lowering, dispatch, processing results),
        ``blocked_time_s`` (the host waiting for a step's tokens), their means per step, and
        ``device_idle_fraction``, an upper-bound estimate of the share of the ticks' wall time
        the device had nothing to do: without overlap all of the host's time; with overlap the
        host's time in the ticks where it never waited for the device."""
        cached, computed = self.scheduler.cached_tokens, self._stats["prefill_tokens_computed"]
        steps = self._stats["prefill_steps"] + self._stats["decode_steps"] + self._stats["mixed_steps"]
        return {
            **self._stats,
            "cached_tokens": cached,
            "cache_hit_rate": cached / (cached + computed) if cached + computed else 0.0,
            "evicted_tokens": self.scheduler.evicted_pages * self.allocator.page_size,
            "num_compilations": self.runner.num_compilations,
            "compile_time_s": self.runner.compile_time_s,
            "kv_pool_tokens": self.kv_pool_tokens,
            "kv_tokens_used": self.kv_tokens_used,
            "token_usage": self.kv_tokens_used / self.kv_pool_tokens,
            "mean_token_usage": self._usage_sum / steps if steps else 0.0,
            "mean_token_usage_queued": (self._queued_usage_sum / self._queued_steps
                                        if self._queued_steps else 0.0),
            "num_retracted": self.scheduler.num_retracted,
            "new_token_ratio": self.scheduler.new_token_ratio,
            "mean_host_ms_per_step": 1e3 * self._stats["host_time_s"] / steps if steps else 0.0,
            "mean_blocked_ms_per_step": 1e3 * self._stats["blocked_time_s"] / steps if steps else 0.0,
            "device_idle_fraction": self._idle_bound_s / self._wall_s if self._wall_s else 0.0,
        }

    def flush_cache(self) -> None:
        """Free every page of the prefix cache (SGLang's flush_cache). Raises RuntimeError while
        requests are waiting or running."""
        self.scheduler.flush_cache()

    def check_invariants(self) -> None:
        """Raise AssertionError if a page or request slot is leaked or owned twice, or a prefix
        cache lock is held by no request (or a request reads cached pages it has not locked)."""
        self.scheduler.check_invariants()
