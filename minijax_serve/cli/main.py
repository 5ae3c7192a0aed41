"""The ``minijax-serve`` command: ``generate`` from one prompt, ``serve`` the OpenAI API, or
``bench`` the engine (or any OpenAI-compatible server) on a workload. Every
:class:`~minijax_serve.EngineConfig` field is a flag of each subcommand and every request field
a flag of ``generate`` (:mod:`minijax_serve.config.flags`)."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Sequence

from minijax_serve.cli import distributed_args
from minijax_serve.config.flags import (SAMPLING_HELP, add_engine_args, add_sampling_args,
                                        cli_spelling, engine_config_from_args,
                                        sampling_params_from_args)

DEFAULT_MODEL = "smollm2-135m"


# -- generate -------------------------------------------------------------------------------

def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate a continuation of one prompt and print it",
                       description="Generate from one prompt, printing the text as it comes (with "
                                   "--n > 1, each sample after the other). With "
                                   "--skip-tokenizer-init the prompt is space-separated token ids "
                                   "and token ids are printed.")
    p.add_argument("prompt", help="the prompt text (or token ids with --skip-tokenizer-init)")
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"alias or HF directory ({DEFAULT_MODEL})")
    p.add_argument("--chat", action="store_true",
                   help="apply the model's chat template to the prompt as a user message")
    add_sampling_args(p, list(SAMPLING_HELP), seed=0)  # also the engine's (EngineConfig.seed)
    add_engine_args(p, exclude=("seed",))
    distributed_args.add_args(p)
    p.set_defaults(func=run_generate)


def _prompt(engine: Any, prompt: str, chat: bool) -> list[int] | str:
    """The prompt as the engine takes it: text, chat-templated ids, or parsed token ids."""
    if engine.tokenizer is None:
        if chat:
            raise ValueError("--chat needs a tokenizer (drop --skip-tokenizer-init)")
        try:
            return [int(t) for t in prompt.replace(",", " ").split()]
        except ValueError:
            raise ValueError("without a tokenizer the prompt must be token ids, e.g. '1 42 7'") from None
    return engine.chat_prompt([{"role": "user", "content": prompt}]) if chat else prompt


def _token(engine: Any, token: int) -> str:
    return str(token) if engine.tokenizer is None else repr(engine.tokenizer.decode([token]))


def _print_logprobs(engine: Any, title: str, tokens: list[int], logprobs: list[Any]) -> None:
    print(f"\n{title}: position, token, logprob, top tokens")
    for i, (token, lp) in enumerate(zip(tokens, logprobs)):
        if lp is None:
            print(f"{i}\t{_token(engine, token)}\t-")
            continue
        top = sorted(lp.items(), key=lambda kv: -kv[1])
        print(f"{i}\t{_token(engine, token)}\t{lp[token]:.4f}\t"
              + " ".join(f"{_token(engine, t)}:{v:.3f}" for t, v in top))


def run_generate(args: argparse.Namespace) -> int:
    """Check the flags, build the engine, generate, print the text (or the token ids)."""
    from minijax_serve.engine import Engine
    from minijax_serve.frontend.inputs import check_config_limits

    params = sampling_params_from_args(args)  # bad values fail before the model loads
    config = engine_config_from_args(args)
    check_config_limits(params, config)
    engine = Engine(args.model, config)
    prompt = _prompt(engine, args.prompt, args.chat)
    if params.n == 1 and engine.tokenizer is not None:
        for out in engine.stream(prompt, params):
            print(out.new_text, end="", flush=True)
        print()
        outs = [out]
    else:
        outs = engine.generate(prompt, params)
        for out in outs:
            if params.n > 1:
                print(f"--- sample {out.index} ---")
            print(out.text if engine.tokenizer is not None else " ".join(map(str, out.token_ids)))
    for out in outs:
        if out.logprobs is not None:
            _print_logprobs(engine, f"logprobs (sample {out.index})", out.token_ids, out.logprobs)
    if outs[0].prompt_logprobs is not None:
        _print_logprobs(engine, "prompt logprobs", outs[0].prompt_token_ids, outs[0].prompt_logprobs)
    return 0


# -- bench ----------------------------------------------------------------------------------

def _add_bench(sub: argparse._SubParsersAction) -> None:
    from minijax_serve.bench.args import add_args  # the flags alone: the runner imports the engine

    p = sub.add_parser("bench", help="throughput and latency benchmark",
                       description="Time the engine on a workload, after a warm-up that compiles "
                                   "every step shape: every request at once (offline, the "
                                   "default) or at --request-rate; SGLang-style figures, the "
                                   "measured matmul peak and copy bandwidth, optionally a "
                                   "HuggingFace baseline, --compare runs and a --plot.")
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"alias or HF directory ({DEFAULT_MODEL})")
    add_args(p)
    add_engine_args(p, exclude=("seed",))
    distributed_args.add_args(p)
    p.set_defaults(func=run_bench)


def run_bench(args: argparse.Namespace) -> int:
    """Run the benchmark and print its reports."""
    from minijax_serve.bench import runner

    runner.run(args, engine_config_from_args(args))
    return 0


# -- serve ----------------------------------------------------------------------------------

def _add_serve(sub: argparse._SubParsersAction) -> None:
    from minijax_serve.server import launch

    p = sub.add_parser("serve", help="serve the OpenAI API over HTTP",
                       description="An OpenAI-compatible server: POST /v1/completions, "
                                   "/v1/chat/completions, /tokenize, /detokenize and "
                                   "/flush_cache; GET /v1/models, /health and /metrics "
                                   "(Prometheus). Needs the [serve] extra.")
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"alias or HF directory ({DEFAULT_MODEL})")
    launch.add_args(p)
    # a simulation (and its host-time model) is for bench and the library
    add_engine_args(p, exclude=("simulate", "simulated_host_time"))
    p.set_defaults(func=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    """Serve until SIGTERM / SIGINT."""
    from minijax_serve.server import launch

    return launch.run(args, engine_config_from_args(args))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="minijax-serve", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    _add_serve(sub)
    _add_bench(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``minijax-serve`` and ``python -m minijax_serve``; returns the exit status."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    distributed_args.initialize(argv)
    args = build_parser().parse_args(argv)
    try:
        distributed_args.check(args)
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {cli_spelling(str(e))}", file=sys.stderr)
        return 2
