"""The draft model: a second :class:`~minijax_serve.executor.model_runner.ModelRunner` with its
own KV pool, page for page the target's.

The draft pool has as many pages as the target's and every step of the target is mirrored on
it (:meth:`DraftRunner.mirror`: the same lowered batch, so the same pages and input ids, those
relayed through the target's token buffer too), so a page holds the draft's KV of exactly the
tokens whose target KV it holds: the prefix cache, chunked prefill, retracts and aborts need
nothing more, and a verify's rejected positions are overwritten by both models alike. Before a
verify step the draft runs ``k`` one-token steps over the verifying sequences
(:meth:`DraftRunner.propose`), each drawing its token from the draft's distribution ``q`` (the
request's temperature, top-k, top-p and min-p; greedy requests take the argmax) with noise of a
seed of its own, and keeping ``q`` on the device for the rejection sampler.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import numpy as np
from flax import nnx

from minijax_serve.executor.buckets import Buckets, StepShape
from minijax_serve.executor.forward_batch import ForwardBatch, empty_forward_batch, unpack_sampling
from minijax_serve.executor.model_runner import ModelRunner
from minijax_serve.executor.sampler import sample
from minijax_serve.executor.step_functions import sampling_arrays
from minijax_serve.memory.page_allocator import SCRATCH_PAGE
from minijax_serve.memory.slot_table import SlotTable
from minijax_serve.models.config import ModelSpec
from minijax_serve.models.decoder import DecoderLM
from minijax_serve.scheduler import ScheduleBatch
from minijax_serve.speculative.rejection import target_probabilities

DRAFT_SEED_SALT = 0x6A09E667  # the draft samples with seed ^ this: noise apart from the target's


def first_layers(module: Any, num_layers: int) -> Any:
    """A copy of the built-in decoder keeping its first ``num_layers`` layers (with its
    embedding, final norm and head): a self-draft."""
    if not isinstance(module, DecoderLM):
        raise ValueError("speculative_draft_layers: only the built-in decoder's layers can be "
                         f"cut, the draft model is a {type(module).__name__}")
    if num_layers > module.cfg.num_layers:
        raise ValueError(f"speculative_draft_layers={num_layers} exceeds the draft model's "
                         f"{module.cfg.num_layers} layers")
    module = nnx.clone(module)
    module.layers = nnx.List(list(module.layers)[:num_layers])
    module.cfg = dataclasses.replace(module.cfg, num_layers=num_layers)
    return module


def check_draft(target: ModelSpec, draft: ModelSpec, target_tokenizer: Any, draft_tokenizer: Any,
                context_length: int) -> None:
    """ValueError naming ``speculative_draft_model`` unless the draft shares the target's
    vocabulary (size, and tokens when both tokenizers are loaded) and serves its context."""
    if draft.vocab_size != target.vocab_size:
        raise ValueError(f"speculative_draft_model: its vocabulary of {draft.vocab_size} tokens "
                         f"is not the target's {target.vocab_size}")
    if (target_tokenizer is not None and draft_tokenizer is not None
            and draft_tokenizer.get_vocab() != target_tokenizer.get_vocab()):
        raise ValueError("speculative_draft_model: its tokenizer's vocabulary is not the "
                         "target's (the same ids must mean the same tokens)")
    limit, why = draft.context_limit()
    if limit < context_length:
        raise ValueError(f"speculative_draft_model: its context ({why}) is shorter than the "
                         f"engine's context_length={context_length}")


@jax.jit(static_argnums=(0, 1))
def draft_sample(num_rows: int, greedy: bool, logits: jax.Array,
                 front: jax.Array) -> tuple[jax.Array, jax.Array | None]:
    """A draft step's token per row and, unless every row is greedy, its distribution ``q``."""
    tokens = sample(logits, sampling_arrays(unpack_sampling(front, num_rows)), all_greedy=greedy)
    return tokens, None if greedy else target_probabilities(num_rows, logits, front)


class Drafts(NamedTuple):
    """What :meth:`DraftRunner.propose` made: each sequence's drafts, and the ``q`` of each
    draft step (none when every sequence is greedy) with the row of each sequence in them."""

    tokens: list[list[int]]
    q_steps: list[jax.Array]
    q_rows: dict[int, int]  # batch row -> its row in the draft steps


class DraftRunner:
    """A draft model's runner, driven beside the target's."""

    def __init__(self, runner: ModelRunner, buckets: Buckets, table: SlotTable, page_size: int):
        self.runner, self.buckets, self.table, self.page_size = runner, buckets, table, page_size

    def _forward(self, fb: ForwardBatch, shape: StepShape, token_buf: jax.Array):
        self.runner.token_buf = token_buf  # relayed input ids: the target's (only read)
        logits, front, _ = self.runner.forward(fb, shape)
        return logits, front

    def mirror(self, fb: ForwardBatch, shape: StepShape, token_buf: jax.Array) -> None:
        """Run the draft over a target step's batch (dispatched before the target's sampler
        replaces ``token_buf``, the target's token buffer)."""
        self._forward(fb, shape._replace(verify=False, prompt_logprobs=False), token_buf)

    def propose(self, batch: ScheduleBatch, token_buf: jax.Array) -> Drafts:
        """``len(batch.drafts[i])`` tokens for each sequence ``i`` (the scheduler's
        placeholders), drawn one draft step after another from the sequence's last token."""
        rows = [i for i, d in enumerate(batch.drafts) if d]
        want = np.array([len(batch.drafts[i]) for i in rows])
        slots = batch.slots[rows]
        shape = self.buckets.decode_shape(len(rows), int(self.table.num_pages[slots].max()))
        tokens = np.array([batch.reqs[i].token_ids(n - 1, n)[0]
                           for i, n in ((i, batch.reqs[i].seq_len) for i in rows)], np.int32)
        out: list[list[int]] = [[] for _ in rows]
        q_steps = []
        for j in range(int(want.max())):
            fb = self._step_batch(slots, want > j, j, tokens, shape)
            logits, front = self._forward(fb, shape, token_buf)
            sampled, q = draft_sample(shape.num_seqs, fb.all_greedy, logits, front)
            tokens = np.asarray(sampled)[:len(rows)]
            for r in np.flatnonzero(want > j).tolist():
                out[r].append(int(tokens[r]))
            if q is not None:
                q_steps.append(q)
        drafts = [[] for _ in batch.reqs]
        for i, d in zip(rows, out):
            drafts[i] = d
        return Drafts(drafts, q_steps, {i: r for r, i in enumerate(rows)})

    def _step_batch(self, slots: np.ndarray, active: np.ndarray, j: int, tokens: np.ndarray,
                    shape: StepShape) -> ForwardBatch:
        """Draft step ``j``: one token per sequence at its KV length + j (inactive sequences,
        whose drafts are all drawn, write the scratch page and read nothing of theirs)."""
        fb, s, t = empty_forward_batch(shape), len(slots), self.table
        pos = np.where(active, t.kv_len[slots] + j, 0)
        fb.cu_q_lens[:] = s
        fb.cu_q_lens[:s + 1] = np.arange(s + 1)
        fb.input_ids[:s], fb.positions[:s], fb.kv_lens[:s] = tokens, pos, pos + 1
        pages = t.pages[slots, :shape.num_pages]
        fb.page_table[:s] = np.where(active[:, None], pages, SCRATCH_PAGE)
        page = fb.page_table[np.arange(s), pos // self.page_size]
        fb.slot_mapping[:s] = page * self.page_size + pos % self.page_size
        fb.temperature[:s], fb.top_k[:s], fb.top_p[:s] = (t.temperature[slots], t.top_k[slots],
                                                          t.top_p[slots])
        fb.min_p[:s], fb.seed[:s] = t.min_p[slots], t.seed[slots] ^ np.uint32(DRAFT_SEED_SALT)
        return fb._replace(all_greedy=bool(t.greedy[slots].all()))


def q_inputs(batch: ScheduleBatch, drafts: Drafts, greedy: np.ndarray,
             num_rows: int) -> tuple[np.ndarray, np.ndarray]:
    """For a verify step's rows: which judge their draft by rejection against ``q`` (a drafted
    row of a sampling request) and where its ``q`` is ([T] bool, [T, 2] step and row)."""
    use_q, index = np.zeros(num_rows, bool), np.zeros((num_rows, 2), np.int32)
    offset = 0
    for i, (n, d) in enumerate(zip(batch.new_tokens, batch.drafts)):
        if d and drafts.q_steps and not greedy[i]:
            use_q[offset:offset + len(d)] = True
            index[offset:offset + len(d)] = np.stack(
                [np.arange(len(d)), np.full(len(d), drafts.q_rows[i])], axis=1)
        offset += n
    return use_q, index


def pool_share(target: ModelSpec, draft: ModelSpec) -> float:
    """The target's share of a pool's memory when each page holds both models' KV."""
    return target.kv_bytes_per_token(2) / (target.kv_bytes_per_token(2)
                                           + draft.kv_bytes_per_token(2))

