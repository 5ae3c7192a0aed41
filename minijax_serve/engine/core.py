"""EngineCore: the parts of an engine and its tick (schedule, lower, dispatch, take results).

A tick schedules one step, lowers it, dispatches it to the device and takes a step's results:
the one just dispatched, or with overlap the previous one. Taking results appends tokens and
logprobs, checks stop conditions, detokenizes and frees what finished; it returns the requests
whose output changed, for :class:`~minijax_serve.Engine` to hand to their callers.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import logging
from typing import Any

import jax
import numpy as np

from minijax_serve.attention.registry import (attention_backend, check_before_loading, get_backend,
                                              ragged_decodes)
from minijax_serve.config import EngineConfig
from minijax_serve.core.clock import VirtualClock, WallClock
from minijax_serve.core.request import FinishReason, Req
from minijax_serve.core.sampling_params import SamplingParams
from minijax_serve.engine.compilation_cache import enable_compilation_cache
from minijax_serve.engine.device_runner import build_device_runner
from minijax_serve.engine.model_source import ModelArg, served_model
from minijax_serve.engine.setup import build_scheduler, default_dtype, device_kind, step_tokens
from minijax_serve.engine.simulated import simulated_model, simulated_runner
from minijax_serve.engine.speculation import load_draft, make_speculator
from minijax_serve.engine.stats import EngineStats
from minijax_serve.engine.trace import StepRecord, step_fields
from minijax_serve.executor.buckets import Buckets
from minijax_serve.executor.forward_batch import lower, pack
from minijax_serve.executor.model_runner import StepOutput
from minijax_serve.executor.processes import agree, multi_process
from minijax_serve.frontend.detokenizer import Detokenizer
from minijax_serve.frontend.grammar import GrammarCompiler
from minijax_serve.frontend.outputs import logprob_dicts
from minijax_serve.memory import PageAllocator, RequestSlots, SlotTable
from minijax_serve.models.config import ModelSpec
from minijax_serve.scheduler import ScheduleBatch
from minijax_serve.simulate.profiles import device_profile

logger = logging.getLogger(__name__)
InFlight = tuple[ScheduleBatch, StepOutput]
AGREE_EVERY_STEPS = 64  # with several processes: how often they compare the lowered batch


class EngineCore:
    def __init__(self, model: ModelArg, config: EngineConfig, model_config: ModelSpec | None = None,
                 tokenizer: Any = None):
        self.config = config
        sim = self.profile = None if config.simulate is None else device_profile(config.simulate)
        platform = jax.default_backend() if sim is None else sim.platform
        check_before_loading(config, platform, sim is not None)  # page size, KV cache dtype
        if sim is None:
            enable_compilation_cache(config.compilation_cache)
        self.platform = platform
        self.clock = (WallClock() if sim is None
                      else VirtualClock(follow_wall=config.simulated_host_time == "measured"))
        self.dtype = default_dtype(config.dtype, platform)
        layer_loop = config.resolved_layer_loop(platform)
        served = (served_model(model, config, self.dtype, layer_loop, model_config, tokenizer)
                  if sim is None else simulated_model(model, config, model_config, tokenizer))
        self.model_config = cfg = served.config
        self.load_time_s = served.load_time_s
        self.tokenizer = served.tokenizer
        self._detok = None if self.tokenizer is None else Detokenizer(self.tokenizer)
        limit, why = cfg.context_limit()
        self.context_length = limit if config.context_length is None else config.context_length
        if self.context_length > limit:
            raise ValueError(f"context_length={self.context_length} exceeds the model's {why}")
        self._multi_process = multi_process()
        ps, tp = config.page_size, config.tensor_parallel_size
        self.attention_backend = backend = attention_backend(config, cfg, platform, self.dtype)
        draft = load_draft(config, served, self.dtype, layer_loop, self.context_length)
        if sim is None:
            self.runner, self.tp, sizing = build_device_runner(
                config, served, self.dtype, backend, layer_loop, self.context_length, draft)
            self.num_devices = self.tp.mesh.size
        else:
            self.runner, sizing = simulated_runner(config, cfg, sim, self.dtype, tp, self.clock,
                                                   self.tokenizer, self.context_length)
            self.num_devices = tp
        self.config = config = dataclasses.replace(  # what the device left open, resolved
            config, max_total_tokens=sizing.pool_tokens,
            max_running_requests=sizing.max_running_requests,
            chunked_prefill_size=sizing.chunked_prefill_size or -1,
            max_prefill_tokens=sizing.max_prefill_tokens, enable_mixed_chunk=sizing.mixed)
        logger.info("%s: %s", "simulated " + sim.name if sim else platform, sizing.describe())
        num_pages = sizing.pool_tokens // ps + 1  # + scratch
        self.allocator = PageAllocator(num_pages, ps)
        kernels = get_backend(backend)
        self.slots = RequestSlots(config.max_running_requests)
        self.buckets = Buckets.build(
            max_step_tokens=step_tokens(sizing, self.context_length),
            max_running_requests=config.max_running_requests,
            context_length=self.context_length, page_size=ps,
            min_token_bucket=config.min_token_bucket, min_seq_bucket=config.min_seq_bucket,
            min_kv_bucket=config.min_kv_bucket, split_decode=kernels.decode_kernel and not (
                sizing.mixed and ragged_decodes(backend, device_kind(sim), self.dtype, cfg, ps,
                                                tp)), unified=sizing.mixed)
        self.slot_table = SlotTable(config.max_running_requests, self.buckets.pages[-1])
        self.scheduler = build_scheduler(config, sizing, cfg, self.allocator, self.slots,
                                         self.slot_table)
        self.prefix_cache = self.scheduler.cache
        self._stats = EngineStats()
        self._in_flight: InFlight | None = None
        self._records: list[StepRecord] = []  # with config.record_steps
        self._pending: dict | None = None  # the record of the step dispatched in this tick
        self._grammars = GrammarCompiler(self.tokenizer, cfg.vocab_size, self.scheduler.eos_ids)
        self.speculator = make_speculator(self, draft, num_pages, layer_loop)

    @property
    def kv_pool_tokens(self) -> int:
        return self.allocator.total_pages * self.allocator.page_size

    @property
    def kv_tokens_used(self) -> int:
        """KV pool tokens held by requests (their own pages and the cached pages they lock);
        evictable prefix-cache pages count as available, as in SGLang."""
        held_pages = self.allocator.total_pages - self.allocator.num_free
        return held_pages * self.allocator.page_size - self.prefix_cache.evictable_size

    def has_unfinished(self) -> bool:
        """Requests are queued or running, or a dispatched step's tokens are not taken yet."""
        return self.scheduler.has_unfinished() or self._in_flight is not None

    def check_grammar(self, params: SamplingParams) -> None:
        """Raise ValueError if ``params`` has a grammar this engine cannot run (for a caller
        that queues the request later, from another thread: the server). The grammar compiled
        here is kept, and the request's matcher copied from it."""
        self._grammar(params)

    def _grammar(self, params: SamplingParams) -> Any:
        """A matcher of ``params``' grammar (None without one); ValueError if it is bad."""
        if params.grammar is None:
            return None
        if self.config.simulate is not None:
            raise ValueError(f"{params.grammar[0]}: a simulated engine samples dummy tokens, "
                             "which no grammar can constrain")
        return self._grammars.matcher(params)

    def _tick(self) -> list[Req]:
        """One scheduler tick; returns the requests that got a token."""
        start = self.clock.now()
        taken: list[tuple[list[Req], float]] = []  # (requests that got a token, seconds blocked)
        early, spec = self._in_flight, self.speculator  # a speculating request's tokens first
        if early is not None and spec is not None and spec.needs_sync(early[0]):
            self._in_flight = None
            taken.append(self._process(*early))
        launched = self._launch(taken)
        if self.config.enable_overlap and (launched is None or launched[0].drafts is None):
            done, self._in_flight = [self._in_flight], launched
        else:  # a verify's tokens are taken at once: the next proposals start from them
            done, self._in_flight = [self._in_flight, launched], None
        taken += [self._process(*d) for d in done if d is not None]
        changed = [req for reqs, _ in taken for req in reqs]
        if launched is not None or taken:
            blocked = sum(wait for _, wait in taken)
            wall = self.clock.now() - start
            self._stats.on_tick(wall, blocked, self.config.enable_overlap)
            if self._pending is not None:
                self._records.append(StepRecord(
                    index=len(self._records), start_s=start, host_ms=1e3 * (wall - blocked),
                    blocked_ms=1e3 * blocked, **self._pending))
                self._pending = None
        return changed

    def _abort(self, req: Req) -> None:
        """Finish ``req`` as aborted wherever it is; its held-back text becomes final."""
        self.scheduler.abort(req, self.clock.now())
        if self._detok is not None:
            self._detok.update(req)
            req.finish_reason = FinishReason.ABORT  # even if the last text completes a stop string
        self._stats.counts["num_aborted"] += 1

    def _launch(self, taken: list[tuple[list[Req], float]]) -> InFlight | None:
        """Schedule, lower and dispatch one step (asynchronously); None if nothing to run. A step
        in flight whose tokens this step's grammar masks need is taken (into ``taken``) once
        this step's model is dispatched, before its sampler."""
        sched = self.scheduler
        before = (sched.cached_tokens, sched.evicted_pages, sched.num_retracted)
        batch = self.scheduler.schedule()
        if batch is None:
            return None
        verify = batch.drafts is not None  # the drafts of speculative decoding
        if verify:
            self.speculator.fill(batch)
        num_pages = int(self.slot_table.num_pages[batch.slots].max())
        if verify:
            shape = self.speculator.verify_shape(sum(batch.new_tokens), num_pages, self.buckets)
        elif batch.is_prefill:
            shape = self.buckets.prefill_shape(sum(batch.new_tokens), num_pages)
        else:
            shape = self.buckets.decode_shape(len(batch.reqs), num_pages)
        targets = batch.prompt_targets(shape.num_tokens)
        if targets is not None:
            shape = shape._replace(prompt_logprobs=True)
        for req in batch.admitted:
            if req.params.penalized:
                self.runner.set_token_counts(req.slot, req.prompt_ids, req.output_ids)
            if req.params.logit_bias:
                self.runner.set_logit_bias(req.slot, req.params.logit_bias)
        fb = lower(batch, self.slot_table, shape, self.allocator.page_size, self.slots.scratch_slot)
        if self._multi_process and self._stats.steps % AGREE_EVERY_STEPS == 0:
            agree(f"the lowered batch of step {self._stats.steps}", pack(fb).tobytes())

        def masks() -> np.ndarray:  # the ledgers first: taking the step in flight may free slots
            self._launched(batch, shape, before)
            early = self._in_flight
            if early is not None and early[0].constrained:
                self._in_flight = None
                taken.append(self._process(*early))
            return self._grammars.masks(batch.reqs, batch.samples, shape.num_seqs)

        if self.speculator is not None:
            self.speculator.mirror(fb, shape)
        run = functools.partial(self.speculator.verify, batch) if verify else self.runner.run
        if batch.constrained:
            return batch, run(fb, shape, targets, masks)
        out = run(fb, shape, targets)
        self._launched(batch, shape, before)
        return batch, out

    def _launched(self, batch: ScheduleBatch, shape, before: tuple[int, int, int]) -> None:
        """The stats and ledgers of ``batch``, once its model is on the device (not if its
        dispatch failed)."""
        sched = self.scheduler
        chunked = sched.chunked  # before launched(): also the one on its last chunk
        kind = "mixed_steps" if batch.is_mixed else "prefill_steps" if batch.is_prefill else "decode_steps"
        self._stats.on_launch(kind, self.kv_tokens_used, self.kv_pool_tokens, bool(sched.waiting),
                              sum(batch.new_tokens[:batch.num_prefill]),
                              chunked is not None and chunked in batch.reqs[:batch.num_prefill],
                              sum(batch.new_tokens), shape.num_tokens)
        sched.launched(batch)
        if self.config.record_steps:
            self._pending = step_fields(self, batch, shape, kind, before)

    def _process(self, batch: ScheduleBatch, out: StepOutput) -> tuple[list[Req], float]:
        """Take a launched step's results: logprobs, stop checks, detokenization, freeing;
        returns the requests that got a token and the seconds spent waiting for the device."""
        wait = self.clock.now()
        if out.done_at is not None:
            self.clock.wait_until(out.done_at)
        tokens = np.asarray(out.tokens)
        lps = None if out.logprobs is None else [np.asarray(x) for x in out.logprobs]
        prompt_lps = None if out.prompt_logprobs is None else [np.asarray(x) for x in out.prompt_logprobs]
        now = self.clock.now()
        if prompt_lps is not None:
            for i, offset, start, end in batch.prompt_rows():
                req = batch.reqs[i]
                if req.epoch == batch.epochs[i] and not req.finished and start == len(req.prompt_logprobs):
                    rows = slice(offset, offset + end - start)
                    req.prompt_logprobs += logprob_dicts(prompt_lps[0][rows], prompt_lps[1][rows],
                                                         req.params.prompt_logprobs)
        verify = batch.drafts is not None  # several tokens per request, from its first row
        runs = self.speculator.runs(batch, out) if verify else tokens
        first = (np.cumsum(batch.new_tokens) - batch.new_tokens).tolist() if verify else None
        before = [len(r.output_ids) for r in batch.reqs] if verify else None
        detok = self._detok
        # a verify's runs are detokenized token by token (a stop string may cut a run short);
        # other steps' requests together, after their tokens
        on_token = detok.update if detok is not None and verify else lambda r: None
        rows = self.scheduler.process(batch, runs, now, on_token)
        changed = [batch.reqs[i] for i in rows]
        if verify:  # decoders only: each took its run
            counts = [len(req.output_ids) - before[i] for i, req in zip(rows, changed)]
            offsets = [first[i] for i in rows]
            self._stats.on_tokens(sum(counts), len(rows), sum(counts))
        else:  # a token each; rows ascend, the prefills' first
            counts, offsets = [1] * len(rows), rows
            decoders = len(rows) - bisect.bisect_left(rows, batch.num_prefill)
            self._stats.on_tokens(len(rows), decoders, decoders)
        if lps is not None:
            for req, o, m in zip(changed, offsets, counts):
                if req.logprobs is not None:
                    req.logprobs += logprob_dicts(lps[0][o:o + m], lps[1][o:o + m],
                                                  req.params.logprobs)
        if detok is not None and not verify:
            detok.update_all(changed)  # a stop string may finish a request
            for req in changed:
                if req.finished:
                    self.scheduler.release(req, now)
        if verify and self._pending is not None:
            self._pending["accepted_tokens"] = sum(len(run) - 1 for run in runs)
        return changed, now - wait

    def _drain(self) -> None:
        """Take the last dispatched step when nothing else runs (its tokens belong to finished
        requests), so that ``has_unfinished()`` is False afterwards."""
        if self._in_flight is not None and not self.scheduler.has_unfinished():
            self._tick()
