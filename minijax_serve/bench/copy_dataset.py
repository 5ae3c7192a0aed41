"""The ``sharegpt-copy`` bench dataset: ShareGPT replies handed back to the model with an
instruction to repeat them (or to fix their typos), so that its output copies its prompt: the
workload where n-gram speculative decoding drafts from the prompt."""

from __future__ import annotations

import argparse

from minijax_serve.bench.datasets import (MIN_SHAREGPT_TOKENS, BenchRequest, DatasetContext,
                                          register)
from minijax_serve.bench.sharegpt_file import read_sharegpt
from minijax_serve.frontend.inputs import chat_prompt_ids

INSTRUCTIONS = {
    "repeat": "Repeat the following text exactly, word for word, and nothing else:",
    "edit": "Rewrite the following text with its spelling and grammar mistakes fixed, keeping "
            "everything else the same:",
}


def _copy_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "sharegpt-copy dataset", "ShareGPT replies in a chat turn that asks the model to repeat "
        "them; each output is as long as its reply (also reads --dataset-path)")
    group.add_argument("--copy-instruction", choices=sorted(INSTRUCTIONS), default="repeat",
                       help="repeat (word for word) or edit (fix mistakes, keep the rest) "
                            "(default: repeat)")
    group.add_argument("--copy-max-len", type=int, default=256, metavar="N",
                       help="skip replies of more than N tokens (default: 256)")


def sample_copy(args: argparse.Namespace, ctx: DatasetContext) -> list[BenchRequest]:
    """``--num-prompts`` requests: a conversation's second turn (a reply of
    ``MIN_SHAREGPT_TOKENS`` to ``--copy-max-len`` tokens) after the ``--copy-instruction``, in
    one user message through the model's chat template with its generation prompt; the output
    length is the reply's token count (a copy's). The exchanges are shuffled by ``ctx.rng``, as
    ``sharegpt``'s; prompt + output fit the context."""
    if ctx.tokenizer is None:
        raise ValueError("--dataset sharegpt-copy needs the model's tokenizer and chat template")
    if args.num_prompts < 1 or args.copy_max_len < MIN_SHAREGPT_TOKENS:
        raise ValueError(f"--num-prompts must be >= 1 and --copy-max-len >= "
                         f"{MIN_SHAREGPT_TOKENS}, got {args.num_prompts} and {args.copy_max_len}")
    data = read_sharegpt(getattr(args, "dataset_path", None))
    instruction = INSTRUCTIONS[args.copy_instruction]
    requests: list[BenchRequest] = []
    for i in ctx.rng.permutation(len(data.exchanges)):
        reply = data.exchanges[i][1]
        output_len = len(ctx.tokenizer.encode(reply, add_special_tokens=False))
        if not MIN_SHAREGPT_TOKENS <= output_len <= args.copy_max_len:
            continue
        prompt = chat_prompt_ids(ctx.tokenizer, [{"role": "user",
                                                  "content": f"{instruction}\n\n{reply}"}])
        if len(prompt) + output_len <= ctx.context_length:
            requests.append(BenchRequest(prompt, output_len))
            if len(requests) == args.num_prompts:
                return requests
    raise ValueError(f"--num-prompts {args.num_prompts}: only {len(requests)} ShareGPT replies "
                     f"of {MIN_SHAREGPT_TOKENS}-{args.copy_max_len} tokens fit the context "
                     f"length {ctx.context_length} as copies")


register("sharegpt-copy", _copy_args, sample_copy)
