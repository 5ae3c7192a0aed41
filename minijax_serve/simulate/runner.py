"""SimulatedRunner: stands in for :class:`~minijax_serve.executor.model_runner.ModelRunner`.

It runs no model: each dispatched step's tokens are ready at once (dummy ids, never an EOS, so
every request runs to its ``max_new_tokens`` as with ``ignore_eos``), and its duration comes from
the :class:`~minijax_serve.simulate.cost_model.CostModel`. Dispatching it costs the host the
profile's ``dispatch_s`` (as launching the real programs does). A device timeline on the engine's
:class:`~minijax_serve.core.clock.VirtualClock` orders the steps: one starts when it is dispatched or
when the previous one ends, whichever is later, and its output says when it ends
(``StepOutput.done_at``), which is when the engine's host may take its tokens. With overlap the
host schedules the next step while one runs, so a tick lasts max(host, device); without, their
sum.
"""

from __future__ import annotations

from typing import Callable, Iterable

import numpy as np

from minijax_serve.core.clock import VirtualClock
from minijax_serve.executor.buckets import StepShape
from minijax_serve.executor.forward_batch import ForwardBatch
from minijax_serve.executor.model_runner import StepOutput
from minijax_serve.simulate.cost_model import CostModel


class SimulatedRunner:
    """What the engine needs of a model runner (``run``, ``set_token_counts``,
    ``set_logit_bias``, ``compile_all``, the compilation counters), for ``cost``'s device on
    ``clock``; dummy ids are drawn below ``token_range`` (the vocabulary, or a smaller
    tokenizer's size)."""

    def __init__(self, cost: CostModel, clock: VirtualClock, token_range: int,
                 eos_token_ids: tuple[int, ...], max_logprobs: int):
        self.cost = cost
        self.clock = clock
        self.token_range = token_range
        self.eos = np.array(sorted(set(eos_token_ids)), np.int64)
        if np.isin(np.arange(token_range), self.eos).all():
            raise ValueError("simulate: every token id below the vocabulary is an EOS")
        self.max_logprobs = max_logprobs
        self.free_at = -np.inf  # when the simulated device finishes its last step
        self.device_time_s = 0.0  # simulated device time of every step so far
        self.compile_time_s = 0.0  # nothing is compiled
        self.num_compilations = 0
        self.step_shapes: set[StepShape] = set()

    def compile_all(self, shapes: Iterable[StepShape], workers: int | None = None,
                    constrained: bool = False) -> None:
        """Nothing to compile (``Engine.warmup`` is free)."""

    def set_token_counts(self, slot: int, prompt_ids: list[int], output_ids: list[int]) -> None:
        """Nothing to write: penalties change no dummy token."""

    def set_logit_bias(self, slot: int, bias: tuple[tuple[int, float], ...]) -> None:
        """Nothing to write: a logit bias changes no dummy token."""

    def dummy_tokens(self, positions: np.ndarray) -> np.ndarray:
        """The ids sampled at ``positions``: deterministic, varying with the position, none an
        EOS."""
        ids = (positions.astype(np.int64) * 7919 + 13) % self.token_range
        while (hit := np.isin(ids, self.eos)).any():
            ids[hit] = (ids[hit] + 1) % self.token_range
        return ids.astype(np.int32)

    def run(self, fb: ForwardBatch, shape: StepShape, prompt_targets: np.ndarray | None = None,
            token_mask: Callable[[], np.ndarray] | None = None) -> StepOutput:
        """Cost one step, put it on the device timeline; its dummy tokens (and zero logprobs,
        if asked for) are returned with the time the step ends. A verify step
        (``shape.verify``) computes the logits of every new token and samples one per token."""
        self.clock.sleep(self.cost.profile.dispatch_s)  # the host's time, before the step starts
        q_lens = np.diff(fb.cu_q_lens)
        rows = shape.num_tokens if prompt_targets is not None or shape.verify else shape.num_seqs
        logprobs_program = fb.logprobs or prompt_targets is not None
        cost = self.cost.step(shape.num_tokens, q_lens, fb.kv_lens, rows, logprobs_program,
                              fb.all_greedy)
        start = max(self.clock.now(), self.free_at)
        self.free_at = start + cost.total_s
        self.device_time_s += cost.total_s
        tokens = self.dummy_tokens(fb.positions + 1 if shape.verify else fb.kv_lens)
        k = self.max_logprobs + 1

        def logprobs(n: int, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            """Zeros, the chosen id first and then distinct others."""
            top = (ids[:, None].astype(np.int64) + np.arange(k)) % self.token_range
            return np.zeros((n, k), np.float32), top.astype(np.int32)

        return StepOutput(
            tokens, logprobs(len(tokens), tokens) if fb.logprobs else None,
            None if prompt_targets is None else logprobs(len(prompt_targets), prompt_targets),
            done_at=self.free_at)
