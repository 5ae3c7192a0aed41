"""The Speculator: speculative decoding's part in the engine's tick.

* Scheduling (:meth:`Speculator.propose`, the scheduler's ``propose``): each decoding request
  that may speculate gets up to ``k`` drafts, no more than its remaining tokens less one
  allow (the scheduler then gives them pages, cutting drafts the free pages
  cannot hold). A request speculates unless it opted out (``SamplingParams.speculate``), has a
  grammar, a penalty or a logit bias, or its last token is still on the device.
* The step: the draft model draws its drafts (:meth:`fill`), then the target runs a ragged step
  of every sequence's last token and drafts with the logits of every token (:meth:`verify`);
  each token is a sampling row (:mod:`minijax_serve.speculative.rows`), judged on the device
  by the rejection sampler where the drafts came from a sampling draft model
  (:mod:`minijax_serve.speculative.rejection`). With the draft model, every target step is
  mirrored on the draft's pool (:meth:`mirror`).
* Results (:meth:`runs`): each sequence's accepted drafts and the token after them.

The host needs a verify's tokens to propose again, so a step holding a request that may
speculate is taken before the next step is scheduled (:meth:`needs_sync`): such steps do not
overlap the host's work; the others keep overlap scheduling's device token relay.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import numpy as np

from minijax_serve.core.request import Req
from minijax_serve.executor.buckets import Buckets, StepShape, pick, pow2_range
from minijax_serve.executor.forward_batch import ForwardBatch
from minijax_serve.executor.model_runner import StepOutput
from minijax_serve.memory.slot_table import SlotTable
from minijax_serve.scheduler import ScheduleBatch
from minijax_serve.simulate.runner import SimulatedRunner
from minijax_serve.speculative.draft import DraftRunner, Drafts, q_inputs
from minijax_serve.speculative.rejection import verify_rows
from minijax_serve.speculative.rows import row_masks, row_sampling

COUNTERS = ("spec_verify_steps", "spec_verified_seqs", "spec_proposed_tokens",
            "spec_accepted_tokens")


class Verified(NamedTuple):
    """A verify step's device results: a token per row (the rejection sampler's where it
    judged, else the plain sampler's), their logprobs, and which drafts it accepted (None:
    a row's draft is accepted iff its token is the draft)."""

    tokens: jax.Array
    logprobs: tuple[jax.Array, jax.Array] | None
    prompt_logprobs: None = None
    done_at: float | None = None
    accepted: jax.Array | None = None


def speculates(req: Req) -> bool:
    """``req`` may verify drafts once its last token is on the host."""
    p = req.params
    return p.speculate and p.grammar is None and not p.adjusts_logits


def spec_stats(counts: dict[str, int] | None) -> dict[str, float]:
    """The counters (zeros without speculation) and their ratios: ``spec_acceptance_rate``
    (accepted over proposed drafts) and ``spec_accept_length`` (tokens a verifying sequence
    took per step: its accepted drafts and the token after them)."""
    c = counts or dict.fromkeys(COUNTERS, 0)
    seqs, proposed, accepted = (c[k] for k in COUNTERS[1:])
    return {**c, "spec_acceptance_rate": accepted / proposed if proposed else 0.0,
            "spec_accept_length": (accepted + seqs) / seqs if seqs else 0.0}


class Speculator:
    """``proposer(req, k)``: up to ``k`` drafts of a request (the n-gram lookup, the simulated
    proposals), or None with ``draft``: the draft model draws them before the step."""

    def __init__(self, *, k: int, max_running: int, runner: Any, table: SlotTable,
                 scratch_slot: int, proposer: Callable[[Req, int], list[int]] | None = None,
                 draft: DraftRunner | None = None):
        self.k = k
        # a verify step's own token buckets: k + 1 tokens per sequence, doubling
        self.verify_tokens = pow2_range(k + 1, max_running * (k + 1))
        self.runner, self.table, self.scratch_slot = runner, table, scratch_slot
        self.proposer, self.draft = proposer, draft
        self.simulated = isinstance(runner, SimulatedRunner)  # its tokens: one per row
        self.counts = dict.fromkeys(COUNTERS, 0)
        self._drafts: Drafts | None = None

    def propose(self, reqs: list[Req]) -> list[list[int]]:
        """Each decoding request's drafts (the draft model's: placeholders, drawn by
        :meth:`fill`)."""
        out = []
        for req in reqs:
            k = min(self.k, req.remaining_new_tokens - 1)
            if k < 1 or req.num_pending or not speculates(req):
                out.append([])
            else:
                out.append(self.proposer(req, k) if self.proposer else [-1] * k)
        return out

    def needs_sync(self, batch: ScheduleBatch) -> bool:
        """``batch`` holds a request that may speculate in the next step: take its tokens
        before scheduling that step."""
        return any(not r.finished and speculates(r) for r in batch.reqs)

    def fill(self, batch: ScheduleBatch) -> None:
        """Draw the draft model's drafts into ``batch.drafts`` (before the step is lowered)."""
        if self.draft is not None:
            self._drafts = self.draft.propose(batch, self.runner.token_buf)
            for placeholders, tokens in zip(batch.drafts, self._drafts.tokens):
                placeholders[:] = tokens

    def mirror(self, fb: ForwardBatch, shape: StepShape) -> None:
        """Run a target step's batch on the draft model too (before the target's step)."""
        if self.draft is not None:
            self.draft.mirror(fb, shape, self.runner.token_buf)

    def verify(self, batch: ScheduleBatch, fb: ForwardBatch, shape: StepShape,
               prompt_targets: None = None,
               token_mask: Callable[[], np.ndarray] | None = None) -> StepOutput | Verified:
        """Dispatch a verify step (``shape.verify``): the target's logits of every new token,
        a token sampled per row and, where the drafts came from a sampling draft model, the
        rejection sampler's tokens and verdicts."""
        if self.simulated:
            return self.runner.run(fb, shape)
        rows, front = row_sampling(batch, fb, shape, self.table, self.scratch_slot)
        t = shape.num_tokens
        masks = None if token_mask is None else (
            lambda: row_masks(token_mask(), batch.new_tokens, t))
        logits, _, _ = self.runner.forward(fb, shape)
        drafts, self._drafts = self._drafts, None
        greedy = self.table.greedy[batch.slots]
        use_q, q_index = (q_inputs(batch, drafts, greedy, t) if drafts is not None
                          else (np.zeros(t, bool), None))
        if not use_q.any():
            return self.runner.sample(logits, front, rows, t, masks)
        sampled = self.runner.sample(logits, front, rows._replace(logprobs=False), t, masks)
        draft_rows = np.full(t, -1, np.int32)
        offsets = np.cumsum(batch.new_tokens) - batch.new_tokens
        for offset, d in zip(offsets.tolist(), batch.drafts):
            draft_rows[offset:offset + len(d)] = d
        tokens, accepted = verify_rows(t, logits, front, draft_rows, use_q, q_index,
                                       sampled.tokens, *drafts.q_steps)
        logprobs = self.runner.logprobs_program(t)(logits, tokens) if rows.logprobs else None
        for x in (tokens, accepted, *(logprobs or ())):
            x.copy_to_host_async()
        return Verified(tokens, logprobs, accepted=accepted)

    def runs(self, batch: ScheduleBatch, out: StepOutput | Verified) -> list[list[int]]:
        """Each sequence's tokens from a verify step: its accepted drafts (a prefix) and the
        token after them."""
        tokens = np.asarray(out.tokens)
        verdicts = getattr(out, "accepted", None)
        verdicts = None if verdicts is None else np.asarray(verdicts)
        runs, offset, c = [], 0, self.counts
        for n, d in zip(batch.new_tokens, batch.drafts):
            x = tokens[offset:offset + n]
            ok = x[:len(d)] == np.array(d, np.int32) if verdicts is None else \
                verdicts[offset:offset + len(d)]
            accepted = len(d) if ok.all() else int(np.argmin(ok))
            runs.append(x[:accepted + 1].tolist())
            if d:
                c["spec_verified_seqs"] += 1
                c["spec_proposed_tokens"] += len(d)
                c["spec_accepted_tokens"] += accepted
            offset += n
        c["spec_verify_steps"] += 1
        return runs

    def verify_shape(self, num_tokens: int, num_pages: int, buckets: Buckets) -> StepShape:
        """The compiled shape of a verify step of ``num_tokens`` new tokens whose longest
        sequence has ``num_pages`` pages: a bucket of :attr:`verify_tokens` (a verify of a few
        sequences is not padded to a prompt's bucket), the widths of ``buckets``."""
        t = pick(self.verify_tokens, num_tokens)
        return StepShape(t, min(t, buckets.seqs[-1]), pick(buckets.pages, num_pages), verify=True)

    def verify_shapes(self, buckets: Buckets) -> list[StepShape]:
        """Every verify step's shape (for warm-up): a verify bucket by a page-table width."""
        return sorted({self.verify_shape(t, w, buckets) for t in self.verify_tokens
                       for w in buckets.pages})

    def compile_draft(self, shapes: list[StepShape], workers: int | None = None) -> None:
        """Compile the draft model's steps: the target's ``shapes`` and its verify steps'
        (mirrors, draft steps)."""
        if self.draft is not None:
            mirrors = [s._replace(verify=False) for s in self.verify_shapes(self.draft.buckets)]
            self.draft.runner.compile_all(list(shapes) + mirrors, workers)
