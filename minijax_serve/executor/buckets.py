"""Bucket sets: the small, fixed set of padded shapes a step is compiled for.

They play the role CUDA graphs play in SGLang: the number of compilations is bounded and known,
and ``Engine.warmup()`` pays for all of them up front.
"""

from __future__ import annotations

from typing import NamedTuple


def pow2_range(lo: int, hi: int) -> tuple[int, ...]:
    """lo, 2·lo, 4·lo, ... capped by hi (hi itself is always the last value)."""
    values, v = [], max(1, min(lo, hi))
    while v < hi:
        values.append(v)
        v *= 2
    values.append(hi)
    return tuple(values)


def pow2_and_half_range(lo: int, hi: int) -> tuple[int, ...]:
    """pow2_range with the midpoints 1.5·2^k added (8, 12, 16, 24, 32, 48, ...), capped by hi."""
    values = set(pow2_range(lo, hi))
    values |= {v * 3 // 2 for v in values if v % 2 == 0 and v * 3 // 2 < hi}
    return tuple(sorted(values))


def pick(buckets: tuple[int, ...], n: int) -> int:
    """The smallest bucket that holds n."""
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")


class StepShape(NamedTuple):
    """One compiled step: new tokens, sequences and page-table width (pages per sequence).

    ``decode``: one new token per sequence, known when compiling, so the step runs the decode
    attention kernel without a device-side branch (a branch on a GPU makes the host wait).
    ``prompt_logprobs``: the step also scores every new token's next token (a prefill step
    with a request that asks for its prompt's logprobs); compiled on first use.
    ``verify``: the logits of every new token, not only each sequence's last (a speculative
    verify step: a sequence's drafted tokens are scored at once).
    """

    num_tokens: int
    num_seqs: int
    num_pages: int
    decode: bool = False
    prompt_logprobs: bool = False
    verify: bool = False


class Buckets(NamedTuple):
    """The padded shapes of a configuration.

    Prefill and decode steps apart (``unified=False``): new-token counts of steps carrying
    prompt tokens are powers of two (``tokens``), sequence counts of decode steps powers of two
    and their 1.5x midpoints (``seqs``), decode steps programs of their own where the backend
    has a decode kernel (``split_decode``).

    Unified steps: one ladder, powers of two and their 1.5x midpoints from
    ``min_token_bucket``, for the new tokens of every step; a decode-only step of S sequences runs in the program of
    S tokens (its sequence buckets are the ladder's values up to ``max_running_requests``), so
    a step's padding is at most a third of it while the programs stay one per rung (measured
    over the peer workloads: benchmarks/RESULTS.md, "Steps, buckets and limits made for an
    accelerator"). Its decode-only steps take the ragged kernel where it reads a decode batch
    as fast as the decode kernel (the ``decode_routing`` tuning table: the Triton one, 57 and
    67 % of an H200's copy bandwidth at batch 64, contexts 2048 and 4096, against the decode
    kernel's 59 and 64 %), else (``split_decode``) decode programs of the same sizes.

    Every step's sequence bucket is ``min(its token bucket, max_running_requests)``: the logits
    are computed for that many rows.
    """

    tokens: tuple[int, ...]  # new tokens of a step carrying prompt tokens (every step, unified)
    seqs: tuple[int, ...]  # sequences of a decode-only step (= its new tokens)
    pages: tuple[int, ...]  # page-table width
    split_decode: bool = False  # decode steps are programs of their own (the Pallas backend)

    @classmethod
    def build(cls, *, max_step_tokens: int, max_running_requests: int, context_length: int,
              page_size: int, min_token_bucket: int, min_seq_bucket: int,
              min_kv_bucket: int | None, split_decode: bool = False,
              unified: bool = False) -> "Buckets":
        max_pages = -(-context_length // page_size)
        min_pages = max_pages if min_kv_bucket is None else min_kv_bucket // page_size
        min_pages = max(1, min(max_pages, min_pages))
        pages = pow2_range(min_pages, max_pages)
        if unified:
            tokens = pow2_and_half_range(min_token_bucket, max_step_tokens)
            seqs = tuple(t for t in tokens if t < max_running_requests)
            return cls(tokens, seqs + (max_running_requests,), pages, split_decode)
        return cls(
            tokens=pow2_range(min_token_bucket, max_step_tokens),
            seqs=pow2_and_half_range(min_seq_bucket, max_running_requests),
            pages=pages,
            split_decode=split_decode,
        )

    def prefill_shape(self, num_tokens: int, num_pages: int) -> StepShape:
        t = pick(self.tokens, num_tokens)
        return StepShape(t, min(t, self.seqs[-1]), pick(self.pages, num_pages))

    def decode_shape(self, num_seqs: int, num_pages: int) -> StepShape:
        s = pick(self.seqs, num_seqs)
        return StepShape(s, s, pick(self.pages, num_pages), self.split_decode)

    def all_shapes(self) -> list[StepShape]:
        shapes = {self.prefill_shape(t, w) for t in self.tokens for w in self.pages}
        shapes |= {self.decode_shape(s, w) for s in self.seqs for w in self.pages}
        return sorted(shapes)
