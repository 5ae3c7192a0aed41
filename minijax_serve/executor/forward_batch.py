"""ForwardBatch: a scheduled batch lowered to fixed-shape numpy arrays, one transfer per step.

New tokens of all sequences are flattened on one axis (ragged layout) with per-sequence query
offsets ``cu_q_lens``; every array is padded to the step's bucketed shape. Padding tokens write
their KV to the scratch page; padding sequences sample into the token buffer's scratch row.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import jax
import numpy as np

from minijax_serve.executor.buckets import StepShape
from minijax_serve.memory.page_allocator import SCRATCH_PAGE
from minijax_serve.memory.slot_table import MAX_BANNED_TOKENS, SlotTable

if TYPE_CHECKING:
    from minijax_serve.scheduler.batch import ScheduleBatch


class ForwardBatch(NamedTuple):
    """The sampler's fields, sized by the number of sequences alone, come first: the sampler
    unpacks them from the front of the packed vector whatever the tokens and page width. The
    last three are read on the host to pick the step's programs, and not sent."""

    sample_slots: np.ndarray  # [S] token-buffer row the sampled token goes to
    kv_lens: np.ndarray  # [S]
    temperature: np.ndarray  # [S]
    top_k: np.ndarray  # [S]
    top_p: np.ndarray  # [S]
    min_p: np.ndarray  # [S]
    seed: np.ndarray  # [S] uint32
    # [S, 4] float32 repetition (1 = off), frequency, presence (0 = off), logit bias (1 = on)
    penalties: np.ndarray
    banned: np.ndarray  # [S, MAX_BANNED_TOKENS] token ids masked to -inf, -1 = none
    cu_q_lens: np.ndarray  # [S+1]
    input_ids: np.ndarray  # [T] token ids known on the host
    buf_index: np.ndarray  # [T] token-buffer row to read the input id from, -1: use input_ids
    positions: np.ndarray  # [T]
    slot_mapping: np.ndarray  # [T] flat KV slot each new token writes
    page_table: np.ndarray  # [S, W]
    all_greedy: bool = True  # every request is greedy: the argmax sampler
    truncated: bool = True  # a sampled request uses top-k, top-p or min-p: the sorting sampler
    penalized: bool = False  # a request uses a penalty or a logit bias: the penalised sampler
    logprobs: bool = False  # a request asks for logprobs: the logprobs program


def empty_forward_batch(shape: StepShape) -> ForwardBatch:
    t, s, w = shape[:3]
    i32 = lambda *dims: np.zeros(dims, np.int32)  # noqa: E731
    return ForwardBatch(
        input_ids=i32(t), buf_index=np.full(t, -1, np.int32), positions=i32(t),
        slot_mapping=i32(t), cu_q_lens=i32(s + 1), kv_lens=i32(s),
        page_table=np.full((s, w), SCRATCH_PAGE, np.int32), sample_slots=i32(s),
        temperature=np.zeros(s, np.float32), top_k=np.full(s, -1, np.int32),
        top_p=np.ones(s, np.float32), min_p=np.zeros(s, np.float32), seed=np.zeros(s, np.uint32),
        penalties=np.tile(np.array([1, 0, 0, 0], np.float32), (s, 1)),
        banned=np.full((s, MAX_BANNED_TOKENS), -1, np.int32),
    )


def lower(batch: ScheduleBatch, table: SlotTable, shape: StepShape, page_size: int,
          scratch_slot: int) -> ForwardBatch:
    """Lower a scheduled batch: its requests compute ``batch.new_tokens`` each from their KV length.

    Everything but the token ids of prefill chunks is gathered from the slot table by the
    requests' slots, so a decode tick of many requests costs a few array operations. A request's
    last output token comes from the device token buffer (the previous step wrote it there) when
    its slot's ``in_buffer`` is set; every other token id is known on the host (a verify's
    drafts after its last token: ``batch.drafts``). A request whose
    tokens stop short of its sequence's end (a prefill chunk that is not the last) samples into
    the scratch row.
    """
    fb = empty_forward_batch(shape)
    rows = batch.slots
    s = len(rows)
    n = np.array(batch.new_tokens, np.int32)
    kv, seq = table.kv_len[rows], table.seq_len[rows]
    end = kv + n
    cu = np.cumsum(n, dtype=np.int32)
    t = int(cu[-1]) if s else 0
    fb.cu_q_lens[1:] = t
    fb.cu_q_lens[1:s + 1] = cu
    fb.kv_lens[:s] = end
    row = np.repeat(np.arange(s), n)  # the request of each new token
    pos = np.arange(t, dtype=np.int32) + (kv - cu + n)[row]  # kv_len + index in request
    fb.positions[:t] = pos
    from_buf = table.in_buffer[rows] & (end == seq)
    fb.buf_index[cu[from_buf] - 1] = rows[from_buf]
    for i in np.flatnonzero(~from_buf | (n > 1)).tolist():  # tokens known on the host
        k = int(n[i]) - int(from_buf[i])
        ids = batch.reqs[i].token_ids(int(kv[i]), int(kv[i]) + k)
        fb.input_ids[cu[i] - n[i]:cu[i] - n[i] + k] = ids + batch.drafts[i] if batch.drafts else ids
    fb.page_table[:s] = table.pages[rows, :shape.num_pages]
    fb.slot_mapping[:t] = fb.page_table[row, pos // page_size] * page_size + pos % page_size
    fb.sample_slots[:] = scratch_slot
    fb.sample_slots[:s] = np.where(end < seq, scratch_slot, rows)
    fb.temperature[:s], fb.top_k[:s] = table.temperature[rows], table.top_k[rows]
    fb.top_p[:s], fb.min_p[:s], fb.seed[:s] = table.top_p[rows], table.min_p[rows], table.seed[rows]
    banning = seq - table.prompt_len[rows] < table.min_new[rows]  # outputs so far < min_new_tokens
    fb.banned[:s] = np.where(banning[:, None], table.banned[rows], -1)
    penalized = bool(table.penalized[rows].any())
    if penalized:
        fb.penalties[:s] = table.penalties[rows]
    sampled = ~table.greedy[rows]
    cut = (table.top_k[rows] > 0) | (table.top_p[rows] < 1.0) | (table.min_p[rows] > 0.0)
    return fb._replace(all_greedy=not sampled.any(), truncated=bool((cut & sampled).any()),
                       penalized=penalized,
                       logprobs=bool(table.logprobs[rows].any()))


PACKED_FIELDS = ForwardBatch._fields[:ForwardBatch._fields.index("all_greedy")]


def pack(fb: ForwardBatch) -> np.ndarray:
    """Every array's bytes in one int32 vector: a step sends its batch in one transfer."""
    return np.concatenate([x.view(np.int32).ravel() for x in fb[:len(PACKED_FIELDS)]])


def _unpack(packed: jax.Array, templates) -> list[jax.Array]:
    fields, offset = [], 0
    for x in templates:
        part = packed[offset:offset + x.size].reshape(x.shape)
        offset += x.size
        if x.dtype != np.int32:
            part = jax.lax.bitcast_convert_type(part, x.dtype)
        fields.append(part)
    return fields


def unpack(packed: jax.Array, shape: StepShape) -> ForwardBatch:
    """The ForwardBatch of ``shape`` inside a step, from :func:`pack`'s vector (static slices)."""
    return ForwardBatch(*_unpack(packed, empty_forward_batch(shape)[:len(PACKED_FIELDS)]))


SAMPLING_FIELDS = ForwardBatch._fields[:ForwardBatch._fields.index("cu_q_lens")]


def sampling_size(num_seqs: int) -> int:
    """Length of the front of a packed batch that holds the sampler's fields."""
    fb = empty_forward_batch(StepShape(0, num_seqs, 0))
    return sum(getattr(fb, name).size for name in SAMPLING_FIELDS)


def unpack_sampling(front: jax.Array, num_seqs: int) -> dict[str, jax.Array]:
    """The sampler's fields (``sample_slots`` .. ``banned``) by name, from the first
    :func:`sampling_size` entries of a packed batch of ``num_seqs`` sequences."""
    fb = empty_forward_batch(StepShape(0, num_seqs, 0))
    return dict(zip(SAMPLING_FIELDS, _unpack(front, [getattr(fb, n) for n in SAMPLING_FIELDS])))
