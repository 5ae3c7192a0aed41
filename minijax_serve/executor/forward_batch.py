"""ForwardBatch: a scheduled batch lowered to fixed-shape numpy arrays, one transfer per step.

New tokens of all sequences are flattened on one axis (ragged layout) with per-sequence query
offsets ``cu_q_lens``; every array is padded to the step's bucketed shape. Padding tokens write
their KV to the scratch page; padding sequences sample into the token buffer's scratch row.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import numpy as np

from minijax_serve.executor.buckets import StepShape
from minijax_serve.memory.page_allocator import SCRATCH_PAGE
from minijax_serve.request import Req

MAX_BANNED_TOKENS = 8  # EOS + stop_token_ids masked while min_new_tokens is not reached


class ForwardBatch(NamedTuple):
    input_ids: np.ndarray  # [T] token ids known on the host
    buf_index: np.ndarray  # [T] token-buffer row to read the input id from, -1: use input_ids
    positions: np.ndarray  # [T]
    slot_mapping: np.ndarray  # [T] flat KV slot each new token writes
    cu_q_lens: np.ndarray  # [S+1]
    kv_lens: np.ndarray  # [S]
    page_table: np.ndarray  # [S, W]
    sample_slots: np.ndarray  # [S] token-buffer row the sampled token goes to
    temperature: np.ndarray  # [S]
    top_k: np.ndarray  # [S]
    top_p: np.ndarray  # [S]
    min_p: np.ndarray  # [S]
    seed: np.ndarray  # [S] uint32
    banned: np.ndarray  # [S, MAX_BANNED_TOKENS] token ids masked to -inf, -1 = none
    all_greedy: np.ndarray  # () bool: skip sorting the vocabulary

    @property
    def shape(self) -> StepShape:
        return StepShape(len(self.input_ids), len(self.kv_lens), self.page_table.shape[1])


def empty_forward_batch(shape: StepShape) -> ForwardBatch:
    t, s, w = shape
    i32 = lambda *dims: np.zeros(dims, np.int32)  # noqa: E731
    return ForwardBatch(
        input_ids=i32(t), buf_index=np.full(t, -1, np.int32), positions=i32(t),
        slot_mapping=i32(t), cu_q_lens=i32(s + 1), kv_lens=i32(s),
        page_table=np.full((s, w), SCRATCH_PAGE, np.int32), sample_slots=i32(s),
        temperature=np.zeros(s, np.float32), top_k=np.full(s, -1, np.int32),
        top_p=np.ones(s, np.float32), min_p=np.zeros(s, np.float32), seed=np.zeros(s, np.uint32),
        banned=np.full((s, MAX_BANNED_TOKENS), -1, np.int32), all_greedy=np.array(True),
    )


def lower(reqs: Sequence[Req], new_tokens: Sequence[int], shape: StepShape, page_size: int,
          scratch_slot: int, eos_ids: Sequence[int]) -> ForwardBatch:
    """Lower the scheduled requests, each computing ``new_tokens[i]`` tokens from ``req.kv_len``.

    A request's last output token comes from the device token buffer (the previous step wrote
    it there) when ``req.token_in_buffer``; every other token id is known on the host.
    """
    fb = empty_forward_batch(shape)
    fb.sample_slots[:] = scratch_slot
    t0 = 0
    for i, (req, n) in enumerate(zip(reqs, new_tokens)):
        start, end = req.kv_len, req.kv_len + n
        pos = np.arange(start, end, dtype=np.int32)
        fb.positions[t0:t0 + n] = pos
        known = req.token_ids(start, end)
        fb.input_ids[t0:t0 + len(known)] = known
        if req.token_in_buffer and end == req.seq_len:
            fb.buf_index[t0 + n - 1] = req.slot
        pages = np.asarray(req.pages, np.int32)
        fb.slot_mapping[t0:t0 + n] = pages[pos // page_size] * page_size + pos % page_size
        fb.page_table[i, :len(pages)] = pages
        fb.kv_lens[i] = end
        t0 += n
        fb.cu_q_lens[i + 1] = t0
        fb.sample_slots[i] = req.slot
        p = req.params
        fb.temperature[i] = p.temperature
        fb.top_k[i] = p.top_k
        fb.top_p[i] = p.top_p
        fb.min_p[i] = p.min_p
        fb.seed[i] = req.seed
        if len(req.output_ids) < p.min_new_tokens:
            ban = list(dict.fromkeys(([] if p.ignore_eos else list(eos_ids)) + list(p.stop_token_ids)))
            fb.banned[i, :len(ban)] = ban
    fb.cu_q_lens[len(reqs) + 1:] = t0
    return fb._replace(all_greedy=np.array(all(r.params.greedy for r in reqs)))
