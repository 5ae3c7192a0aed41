"""Engine: the request API (add / abort / step / generate / stream / chat) over the core."""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Iterator, Sequence

import numpy as np

from minijax_serve.config import EngineConfig
from minijax_serve.core.request import Req, RequestOutput, sample_seed
from minijax_serve.core.sampling_params import SamplingParams
from minijax_serve.engine.core import EngineCore
from minijax_serve.engine.model_source import ModelArg
from minijax_serve.engine.stats import engine_stats
from minijax_serve.engine.trace import StepRecord
from minijax_serve.engine.weights import InPlaceWeights
from minijax_serve.executor.processes import agree
from minijax_serve.frontend.inputs import (Message, Prompt, RequestLimits, chat_prompt_ids,
                                           check_request, checked_requests, conversation_list,
                                           naming, params_list, prompt_ids)
from minijax_serve.frontend.outputs import OutputRouter
from minijax_serve.models.config import ModelSpec


class Engine(InPlaceWeights, EngineCore):
    """Serves many requests at once from a fixed, paged KV-cache pool.

    >>> engine = Engine("smollm2-135m", max_total_tokens=32768)
    >>> engine.generate(["The capital of France is"], SamplingParams(max_new_tokens=8))[0].text

    ``model``: an alias (``"smollm2-135m"``), an HF-format directory, or a model object of one's
    own (an NNX module following :mod:`minijax_serve.models.protocol`, or a zero-argument
    factory of one) with ``model_config`` (a :class:`~minijax_serve.ModelSpec`) and, for text
    in and out, ``tokenizer`` (a HuggingFace tokenizer; without one, token ids only). Other
    keywords override fields of ``config`` (:class:`~minijax_serve.EngineConfig`).

    ``simulate="h200"`` (or ``"h100"``, ``"cpu"``) runs no model: the same scheduler, driven by a
    cost model of that device, on a virtual clock (docs/parallel_and_simulator.md "Simulated accelerator").

    Every caller shares one loop: ``step()`` runs one scheduler tick; ``generate``, ``stream``
    and ``chat`` drive it until their own requests finish, and the outputs of other requests
    produced meanwhile wait for the next ``step()`` (or ``get_output``).
    """

    def __init__(self, model: ModelArg, config: EngineConfig | None = None, *,
                 model_config: ModelSpec | None = None, tokenizer: Any = None, **overrides: Any):
        super().__init__(model, dataclasses.replace(config or EngineConfig(), **overrides),
                         model_config, tokenizer)
        self.limits = RequestLimits(
            self.context_length, self.kv_pool_tokens, self.model_config.vocab_size,
            self.model_config.eos_token_ids, self.config, self.tokenizer is not None)
        self._rng = np.random.default_rng(self.config.seed)
        self._ids = itertools.count()
        self._router = OutputRouter()

    # -- requests -------------------------------------------------------------------------

    def _new_id(self, n: int) -> str:
        """A free parent id whose n sample ids are free too (a caller may have used any)."""
        while True:
            rid = str(next(self._ids))
            samples = [f"{rid}-{i}" for i in range(n)] if n > 1 else []
            if not any(self._router.in_use(r) for r in (rid, *samples)):
                return rid

    def _samples(self, ids: list[int], params: SamplingParams,
                 request_id: str | None) -> tuple[str, list[Req]]:
        """(parent id, one Req per sample) of a checked prompt; ids ``f"{parent}-{i}"`` when
        n > 1; sample i of a seeded request draws from ``sample_seed(seed, i)``."""
        n = params.n
        parent = self._new_id(n) if request_id is None else str(request_id)
        rids = [parent] if n == 1 else [f"{parent}-{i}" for i in range(n)]
        for rid in dict.fromkeys([parent, *rids]):
            if self._router.in_use(rid):
                raise ValueError(f"request_id {rid!r} is already in use")
        matcher = self._grammar(params)  # a bad grammar raises before the seeds are drawn
        if params.seed is None:
            seeds = [int(s) for s in self._rng.integers(2**32, size=n)]
        else:
            seeds = [sample_seed(params.seed, i) for i in range(n)]
        now = self.clock.now()
        reqs = [Req(rid, ids, params, seed, now, index=i, weights_version=self.weights_version)
                for i, (rid, seed) in enumerate(zip(rids, seeds))]
        for req in reqs if matcher is not None else ():
            req.grammar = matcher if req.index == 0 else matcher.deep_copy()
        if n > 1:
            for req in reqs:
                req.siblings = tuple(reqs)
        return parent, reqs

    def _submit(self, prompts: Any, sampling_params: Any) -> list[tuple[str, list[Req]]]:
        """Check every prompt (before any is queued) and make its samples, not queued yet."""
        groups = []
        for ids, params, owner in checked_requests(prompts, sampling_params, self.tokenizer,
                                                   self.limits):
            with naming(owner):  # a bad grammar
                groups.append(self._samples(ids, params, None))
        return groups

    def _enqueue(self, groups: list[tuple[str, list[Req]]]) -> list[Req]:
        self._check_awake("adding requests")
        if self._multi_process:
            agree("the submitted requests", repr([(r.rid, r.prompt_ids, r.params, r.seed)
                                                  for _, samples in groups for r in samples]).encode())
        reqs = []
        for parent, samples in groups:
            self._router.add(parent, samples)
            for req in samples:
                self._stats.counts["prompt_tokens"] += len(req.prompt_ids)
                self.scheduler.add(req)
            reqs += samples
        return reqs

    def add_request(self, prompt: Prompt, sampling_params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Check and queue one prompt; returns its id (with ``n`` > 1, the parent id: sample
        i's outputs have ``request_id == f"{parent}-{i}"``). Raises ValueError on bad input."""
        params = params_list(sampling_params, 1)[0]
        ids = prompt_ids(prompt, "prompt", self.tokenizer, self.model_config.vocab_size)
        check_request(ids, params, self.limits)
        parent, reqs = self._samples(ids, params, request_id)
        self._enqueue([(parent, reqs)])
        return parent

    def abort(self, request_id: str) -> bool:
        """Abort a request (or, by its parent id, all its samples) at any point of its life:
        its slot and pages are released at once, it is never scheduled again, and its final
        output (``finish_reason == "abort"``) is handed out like any other. False for an
        unknown, finished or malformed id."""
        if not isinstance(request_id, str):
            return False
        aborted = False
        for req in self._router.lookup(request_id):
            if not req.finished:
                self._abort(req)
                self._router.mark([req])
                aborted = True
        return aborted

    def get_output(self, request_id: str) -> RequestOutput | None:
        """The latest output of a request still known (unfinished, or finished and not read
        yet; with n > 1, a sample's id), handed over as by ``step``; None for an unknown id. At most
        ``outputs.MAX_UNREAD_FINISHED`` finished requests wait to be read; the oldest go first."""
        req = self._router.reqs.get(request_id) if isinstance(request_id, str) else None
        return None if req is None else self._router.take(req)

    def has_unfinished(self) -> bool:
        """Requests are queued or running, a dispatched step's tokens are not taken yet, or
        outputs wait for ``step()`` to hand them over: ``while engine.has_unfinished():
        engine.step()`` sees every output of the requests it added."""
        return super().has_unfinished() or self._router.has_unowned()

    # -- the loop -------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one scheduler tick; returns an output for every request whose new tokens (or
        abort) reached the host since the last time its output was handed over, except those
        a running ``generate`` / ``stream`` call takes.

        With ``enable_overlap`` the tick dispatches the next step first and then takes the
        previous step's tokens (blocking only if the device has not finished it), so the host's
        work hides behind the device's and outputs trail the device by one step.
        """
        self._tick()
        return self._router.take_unowned()

    def _tick(self) -> list[Req]:
        changed = super()._tick()
        self._router.mark(changed)
        return changed

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 ) -> list[RequestOutput]:
        """Generate for one prompt or many (continuous batching); returns the final outputs in
        prompt order, a prompt's ``n`` samples one after another. Every prompt is checked
        before any is queued. If interrupted, its unfinished requests are aborted."""
        reqs = self._enqueue(self._submit(prompts, sampling_params))
        self._router.own(reqs)
        try:
            while any(not r.finished for r in reqs):
                self._tick()
            self._drain()
            return [self._router.take(r) for r in reqs]
        except BaseException:
            self._abandon(reqs)
            raise
        finally:
            self._router.disown(reqs)

    def stream(self, prompts: Prompt | Sequence[Prompt],
               sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
               ) -> Iterator[RequestOutput]:
        """Generate for one prompt or many, yielding each request's output as its new tokens
        reach the host (``new_token_ids`` / ``new_text``: what it adds), until all are finished.
        The prompts are checked now and queued when iteration starts; closing the generator
        early aborts its unfinished requests."""
        return self._stream(self._submit(prompts, sampling_params))

    def _stream(self, groups: list[tuple[str, list[Req]]]) -> Iterator[RequestOutput]:
        reqs = self._enqueue(groups)
        self._router.own(reqs)
        try:
            while True:
                for req in self._router.ready(reqs):
                    yield self._router.take(req)
                if not all(r.finished for r in reqs):
                    self._tick()
                elif not self._router.ready(reqs):  # (the caller may abort one as they come out)
                    break
            self._drain()
        finally:
            self._abandon(reqs)

    def _abandon(self, reqs: list[Req]) -> None:
        """Abort ``reqs``' unfinished requests and drop their unread outputs."""
        for req in reqs:
            if not req.finished:
                self.abort(req.rid)
        self._router.forget(reqs)

    def chat(self, conversations: Sequence[Message] | Sequence[Sequence[Message]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             ) -> list[RequestOutput]:
        """``generate`` for one conversation (a list of ``{"role", "content"}`` messages) or a
        list of them, each through the model's chat template with the generation prompt. To
        stream a conversation: ``engine.stream(engine.chat_prompt(messages), params)``."""
        return self.generate([self.chat_prompt(c) for c in conversation_list(conversations)],
                             sampling_params)

    def chat_prompt(self, messages: Sequence[Message]) -> list[int]:
        """The token ids of one conversation through the model's chat template, ending with
        the generation prompt. Raises ValueError on a malformed conversation."""
        conversations = conversation_list(messages)
        if len(conversations) != 1:
            raise ValueError(f"messages must be one conversation (a list of messages), got a "
                             f"list of {len(conversations)} conversations")
        return chat_prompt_ids(self.tokenizer, conversations[0])

    # -- introspection --------------------------------------------------------------------

    def warmup(self, workers: int | None = None, grammars: bool = False) -> int:
        """Compile every program the configuration can run (each step shape, and for each
        number of sequences its samplers, with ``grammars`` those under grammar masks too, and
        its logprobs program; speculative decoding's verify steps and draft model; the
        prompt-logprobs variants of prefill steps are compiled on first use), ``workers``
        compilations at a time (default: one per CPU for an accelerator, one on CPU); returns
        how many programs of the target it compiled."""
        before = self.runner.num_compilations
        shapes = self.buckets.all_shapes()
        if self.speculator is not None:  # the draft's programs, and the verify steps'
            self.speculator.compile_draft(shapes, workers)
            shapes += self.speculator.verify_shapes(self.buckets)
        self.runner.compile_all(shapes, workers, grammars)
        return self.runner.num_compilations - before

    def stats(self) -> dict[str, float]:
        """Counters since the engine started, and the current state of the pool and the ratio
        (every key: :func:`minijax_serve.engine.stats.engine_stats`)."""
        return engine_stats(self)

    def step_records(self) -> list[StepRecord]:
        """One :class:`~minijax_serve.engine.trace.StepRecord` per step dispatched since the engine
        started, with ``record_steps=True`` (else none): what each step carried, the bucket it
        ran in, the queues and the KV pool after it, its host and blocked time."""
        return list(self._records)

    def flush_cache(self) -> None:
        """Free every page of the prefix cache (SGLang's flush_cache). Raises RuntimeError while
        requests are waiting or running."""
        self.scheduler.flush_cache()

    def check_invariants(self) -> None:
        """Raise AssertionError if a page or request slot is leaked or owned twice, or a prefix
        cache lock is held by no request (or a request reads cached pages it has not locked)."""
        self.scheduler.check_invariants()
