"""The ``tree`` bench dataset: prompts along the paths of a random prefix tree (agent trees,
few-shot variants, multi-turn branches), and the ideal prefill of any workload."""

from __future__ import annotations

import argparse
from typing import Sequence

from minijax_serve.bench.datasets import BenchRequest, DatasetContext, register


def _tree_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "tree dataset", "--num-prompts prompts, each the path from the root to a node of a "
        "random tree whose edges are random token segments")
    group.add_argument("--tree-max-segment-len", type=int, default=40,
                       help="an edge has 1 to this many tokens (default: 40)")
    group.add_argument("--tree-max-prompt-len", type=int, default=256,
                       help="longest prompt (default: 256)")
    group.add_argument("--tree-output-len", type=int, default=32,
                       help="output length of every request (default: 32)")


def sample_tree(args: argparse.Namespace, ctx: DatasetContext) -> list[BenchRequest]:
    """Each new node hangs under the root or a node drawn uniformly from those made so far, with
    a segment of 1 to ``--tree-max-segment-len`` token ids uniform over the vocabulary; paths
    longer than ``--tree-max-prompt-len`` are drawn again. Shuffled by ``ctx.rng``."""
    seg, longest, out = args.tree_max_segment_len, args.tree_max_prompt_len, args.tree_output_len
    for flag, value in (("--tree-max-segment-len", seg), ("--tree-max-prompt-len", longest),
                        ("--tree-output-len", out), ("--num-prompts", args.num_prompts)):
        if value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    if longest + out > ctx.context_length:
        raise ValueError(f"tree: --tree-max-prompt-len ({longest}) + --tree-output-len ({out}) "
                         f"exceed the context length {ctx.context_length}")
    paths: list[list[int]] = []
    while len(paths) < args.num_prompts:
        parent = int(ctx.rng.integers(-1, len(paths)))  # -1: under the root
        base = paths[parent] if parent >= 0 else []
        segment = ctx.rng.integers(0, ctx.vocab_size, size=int(ctx.rng.integers(1, seg + 1)))
        if len(base) + len(segment) <= longest:
            paths.append(base + segment.tolist())
    return [BenchRequest(paths[i], out) for i in ctx.rng.permutation(len(paths))]


register("tree", _tree_args, sample_tree)


def ideal_prefill_tokens(prompts: Sequence[Sequence[int]]) -> int:
    """The prompt tokens an ideal engine with a cache that keeps everything computes: every
    distinct prefix once (the nodes of the prompts' token trie), plus one token per prompt (the
    last, whose logits it needs even when another prompt computed it)."""
    root: dict = {}
    nodes = 0
    for prompt in prompts:
        node = root
        for token in prompt:
            if token not in node:
                node[token] = {}
                nodes += 1
            node = node[token]
    return nodes + len(prompts)
