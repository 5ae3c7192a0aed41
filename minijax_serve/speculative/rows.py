"""A verify step's sampling rows: every new token of the step is a row that samples the token
after it, so that a sequence's last token and its drafts are scored at once.

Row ``j`` of a sequence (its ``j``-th new token, at position ``p``) samples the token at
``p + 1`` with its sequence's parameters and with the noise of that position, exactly as a decode
step of that position would: its ``kv_lens`` entry (the sampler's position) is ``p + 1``, and
EOS and stop tokens are banned while the outputs before it are fewer than ``min_new_tokens``.
"""

from __future__ import annotations

import numpy as np

from minijax_serve.executor.buckets import StepShape
from minijax_serve.executor.forward_batch import SAMPLING_FIELDS, ForwardBatch, empty_forward_batch
from minijax_serve.memory.slot_table import SlotTable
from minijax_serve.scheduler import ScheduleBatch

PER_SEQUENCE = ("temperature", "top_k", "top_p", "min_p", "seed", "penalties")


def row_sampling(batch: ScheduleBatch, fb: ForwardBatch, shape: StepShape, table: SlotTable,
                 scratch_slot: int) -> tuple[ForwardBatch, np.ndarray]:
    """The sampler's fields of every row of a verify step lowered as ``fb`` (with its flags:
    greedy, penalised, logprobs) and their packed vector, the front the sampler reads.

    A sequence without drafts keeps its own token-buffer row (its token is relayed as in a
    decode step); the rows of one with drafts sample into the scratch row."""
    n = np.array(batch.new_tokens, np.int32)
    s, t = len(n), int(n.sum())
    seq = np.repeat(np.arange(s), n)  # the sequence of each row
    index = np.arange(t) - np.repeat(np.cumsum(n) - n, n)  # the row's place in its sequence
    rows = empty_forward_batch(StepShape(0, shape.num_tokens, 0))
    rows.sample_slots[:] = scratch_slot
    rows.sample_slots[:t] = np.where(n > 1, scratch_slot, fb.sample_slots[:s])[seq]
    rows.kv_lens[:t] = fb.positions[:t] + 1
    for name in PER_SEQUENCE:
        getattr(rows, name)[:t] = getattr(fb, name)[:s][seq]
    slots = batch.slots[seq]
    outputs = table.seq_len[slots] - table.prompt_len[slots] + index  # before the row's token
    rows.banned[:t] = np.where((outputs < table.min_new[slots])[:, None], table.banned[slots], -1)
    rows = rows._replace(all_greedy=fb.all_greedy, penalized=fb.penalized, logprobs=fb.logprobs)
    return rows, np.concatenate([getattr(rows, f).view(np.int32).ravel() for f in SAMPLING_FIELDS])


def row_masks(masks: np.ndarray, new_tokens: list[int], num_rows: int) -> np.ndarray:
    """The grammars' token masks [S, W] of a step's sequences as one per row [num_rows, W]
    (a sequence's mask on each of its rows; every token allowed on padding rows)."""
    out = np.full((num_rows, masks.shape[1]), -1, np.int32)
    n = np.array(new_tokens)
    out[:n.sum()] = np.repeat(masks[:len(n)], n, axis=0)
    return out
