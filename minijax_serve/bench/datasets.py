"""Benchmark datasets: each turns the command-line flags into ``(prompt_token_ids, output_len)``.

A dataset is a :class:`Dataset` in ``DATASETS``: ``add_args`` adds its flags to the ``bench``
parser, ``sample`` draws the requests. To add one (e.g. ShareGPT), write both functions and
``register`` them; ``--dataset-name`` picks it.
"""

from __future__ import annotations

import argparse
from typing import Any, Callable, NamedTuple

import numpy as np


class BenchRequest(NamedTuple):
    prompt_ids: list[int]
    output_len: int


class DatasetContext(NamedTuple):
    """What a dataset may need from the engine, plus its random generator."""

    vocab_size: int
    tokenizer: Any | None  # None under skip_tokenizer_init
    context_length: int
    rng: np.random.Generator


SampleFn = Callable[[argparse.Namespace, DatasetContext], list[BenchRequest]]


class Dataset(NamedTuple):
    add_args: Callable[[argparse.ArgumentParser], None]
    sample: SampleFn


DATASETS: dict[str, Dataset] = {}


def register(name: str, add_args: Callable[[argparse.ArgumentParser], None],
             sample: SampleFn) -> None:
    DATASETS[name] = Dataset(add_args, sample)


# -- random ---------------------------------------------------------------------------------

def length_bounds(length: int, range_ratio: float) -> tuple[int, int]:
    """Inclusive bounds ``[max(1, int(r·L)), L]`` of a random length (SGLang's rule)."""
    if length < 1:
        raise ValueError(f"length must be >= 1, got {length}")
    if not 0.0 <= range_ratio <= 1.0:
        raise ValueError(f"range ratio must be in [0, 1], got {range_ratio}")
    return max(1, int(length * range_ratio)), length


def sample_lengths(rng: np.random.Generator, n: int, length: int, range_ratio: float) -> list[int]:
    """``n`` lengths drawn uniformly from :func:`length_bounds` (both ends included)."""
    lo, hi = length_bounds(length, range_ratio)
    return rng.integers(lo, hi + 1, size=n).tolist()


def _random_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("random dataset")
    group.add_argument("--random-input-len", type=int, default=256,
                       help="largest prompt length in tokens (default: 256)")
    group.add_argument("--random-output-len", type=int, default=128,
                       help="largest output length in tokens (default: 128)")
    group.add_argument("--random-range-ratio", type=float, default=0.125,
                       help="lengths are uniform in [max(1, ratio·L), L] (default: 0.125)")


def sample_random(args: argparse.Namespace, ctx: DatasetContext) -> list[BenchRequest]:
    """Prompts of token ids uniform over the vocabulary, with lengths from :func:`sample_lengths`."""
    n = args.num_prompts
    in_lens = sample_lengths(ctx.rng, n, args.random_input_len, args.random_range_ratio)
    out_lens = sample_lengths(ctx.rng, n, args.random_output_len, args.random_range_ratio)
    return [BenchRequest(ctx.rng.integers(0, ctx.vocab_size, size=i).tolist(), o)
            for i, o in zip(in_lens, out_lens)]


register("random", _random_args, sample_random)
