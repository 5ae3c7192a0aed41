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
    it there) when ``req.token_in_buffer``; every other token id is known on the host. A request
    whose tokens stop short of its sequence's end (a prefill chunk that is not the last) samples
    into the scratch row.

    A decode tick lowers every running request, so the per-request work is only reading its
    fields into Python lists; the arrays are filled by a few operations over the whole batch.
    """
    fb = empty_forward_batch(shape)
    s = len(reqs)
    n = np.array(new_tokens, np.int32)
    kv = np.array([r.kv_len for r in reqs], np.int32)
    seq = np.array([r.seq_len for r in reqs], np.int32)
    end = kv + n
    cu = np.cumsum(n, dtype=np.int32)
    t = int(cu[-1]) if s else 0
    fb.cu_q_lens[1:] = t
    fb.cu_q_lens[1:s + 1] = cu
    fb.kv_lens[:s] = end
    row = np.repeat(np.arange(s), n)  # the request of each new token
    pos = np.arange(t, dtype=np.int32) + (kv - cu + n)[row]  # kv_len + index in request
    fb.positions[:t] = pos
    slots = np.array([r.slot for r in reqs], np.int32)
    from_buf = np.array([r.token_in_buffer for r in reqs], bool) & (end == seq)
    fb.buf_index[cu[from_buf] - 1] = slots[from_buf]
    fb.input_ids[:t] = _host_token_ids(reqs, new_tokens, from_buf.tolist())
    pages: list[int] = []
    for r in reqs:
        pages += r.pages
    num_pages = np.array([len(r.pages) for r in reqs], np.int32)
    page_row = np.repeat(np.arange(s), num_pages)
    page_col = np.arange(len(pages)) - (np.cumsum(num_pages) - num_pages)[page_row]
    fb.page_table[page_row, page_col] = np.array(pages, np.int32)
    fb.slot_mapping[:t] = fb.page_table[row, pos // page_size] * page_size + pos % page_size
    fb.sample_slots[:] = scratch_slot
    fb.sample_slots[:s] = np.where(end < seq, scratch_slot, slots)
    params = [r.params for r in reqs]
    fb.temperature[:s] = [p.temperature for p in params]
    fb.top_k[:s] = [p.top_k for p in params]
    fb.top_p[:s] = [p.top_p for p in params]
    fb.min_p[:s] = [p.min_p for p in params]
    fb.seed[:s] = [r.seed for r in reqs]
    for i, (req, p) in enumerate(zip(reqs, params)):
        if req.num_outputs < p.min_new_tokens:
            ban = list(dict.fromkeys(([] if p.ignore_eos else list(eos_ids)) + list(p.stop_token_ids)))
            fb.banned[i, :len(ban)] = ban
    return fb._replace(all_greedy=np.array(all(p.greedy for p in params)))


def _host_token_ids(reqs: Sequence[Req], new_tokens: Sequence[int],
                    from_buf: list[bool]) -> list[int]:
    """Every new token's id, flattened; 0 for a token the step reads from the token buffer (it
    may not have reached the host yet)."""
    ids: list[int] = []
    for req, k, buf in zip(reqs, new_tokens, from_buf):
        if buf:
            ids += req.token_ids(req.kv_len, req.kv_len + k - 1) if k > 1 else []
            ids.append(0)
        else:
            ids += req.token_ids(req.kv_len, req.kv_len + k)
    return ids
