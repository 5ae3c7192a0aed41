"""The ``minijax-serve`` command: ``generate`` one prompt, or ``bench`` the engine on a workload.

Every :class:`~minijax_serve.EngineConfig` field is a flag of both subcommands, generated from the
dataclass: ``page_size`` -> ``--page-size``; bool fields are on/off flags (``--skip-tokenizer-init``);
``int | None`` fields take an integer (or ``none``).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import types
import typing
from typing import Any, Callable, Sequence

from minijax_serve.config import EngineConfig

DEFAULT_MODEL = "smollm2-135m"


def _optional(convert: Callable[[str], Any]) -> Callable[[str], Any]:
    """An argparse type for ``X | None`` fields: ``none`` (any case) -> None, else ``convert``."""

    def parse(text: str) -> Any:
        return None if text.lower() == "none" else convert(text)

    parse.__name__ = convert.__name__  # argparse names the type in its error messages
    return parse


def _converter(hint: Any) -> tuple[Callable[[str], Any], bool]:
    """(argparse type, is_bool) for a field's type hint: bool, int, float, str or ``X | None``."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in args:
        inner = [a for a in args if a is not type(None)]
        if len(inner) != 1:
            raise TypeError(f"unsupported EngineConfig type {hint!r}")
        return _optional(_converter(inner[0])[0]), False
    if hint is bool:
        return bool, True
    if hint in (int, float, str):
        return hint, False
    raise TypeError(f"unsupported EngineConfig type {hint!r}")


def add_engine_args(parser: argparse.ArgumentParser, exclude: Sequence[str] = ()) -> None:
    """Add one flag per EngineConfig field (except ``exclude``, which the caller defines itself)."""
    group = parser.add_argument_group("engine (EngineConfig fields)")
    hints = typing.get_type_hints(EngineConfig)
    for field in dataclasses.fields(EngineConfig):
        if field.name in exclude:
            continue
        flag = "--" + field.name.replace("_", "-")
        convert, is_bool = _converter(hints[field.name])
        if is_bool:
            action = "store_true" if field.default is False else argparse.BooleanOptionalAction
            group.add_argument(flag, action=action, default=field.default,
                               help=f"EngineConfig.{field.name} (default: {field.default})")
        else:
            group.add_argument(flag, type=convert, default=field.default, metavar=field.name.upper(),
                               help=f"EngineConfig.{field.name} (default: {field.default})")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig named by the parsed flags (fields absent from ``args`` keep defaults)."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)
              if hasattr(args, f.name)}
    return EngineConfig(**values)


# -- generate -------------------------------------------------------------------------------

def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate a continuation of one prompt and print it",
                       description="Generate from one prompt. With --skip-tokenizer-init the prompt "
                                   "is space-separated token ids and token ids are printed.")
    p.add_argument("prompt", help="the prompt text (or token ids with --skip-tokenizer-init)")
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"alias or HF directory ({DEFAULT_MODEL})")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1, help="-1 = off (default)")
    p.add_argument("--chat", action="store_true",
                   help="apply the tokenizer's chat template to the prompt as a user message")
    p.add_argument("--seed", type=int, default=0,
                   help="sampling seed of the request (also EngineConfig.seed)")
    add_engine_args(p, exclude=("seed",))
    p.set_defaults(func=run_generate)


def _prompt_ids(engine: Any, prompt: str, chat: bool) -> list[int] | str:
    """The prompt as the engine takes it: text, chat-templated ids, or parsed token ids."""
    if engine.tokenizer is None:
        if chat:
            raise SystemExit("error: --chat needs a tokenizer (drop --skip-tokenizer-init)")
        try:
            return [int(t) for t in prompt.replace(",", " ").split()]
        except ValueError:
            raise SystemExit("error: without a tokenizer the prompt must be token ids, "
                             "e.g. '1 42 7'") from None
    if not chat:
        return prompt
    text = engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                tokenize=False, add_generation_prompt=True)
    return engine.tokenizer.encode(text, add_special_tokens=False)  # the template has its BOS


def run_generate(args: argparse.Namespace) -> int:
    """Build the engine, generate for the one prompt, print the text (or the token ids)."""
    from minijax_serve import Engine, SamplingParams

    engine = Engine(args.model, engine_config_from_args(args))
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    out = engine.generate([_prompt_ids(engine, args.prompt, args.chat)], params)[0]
    print(out.text if engine.tokenizer is not None else " ".join(map(str, out.token_ids)))
    return 0


# -- bench ----------------------------------------------------------------------------------

def _add_bench(sub: argparse._SubParsersAction) -> None:
    from minijax_serve.bench import runner

    p = sub.add_parser("bench", help="throughput and latency benchmark",
                       description="Time the engine on a workload, after a warm-up that compiles "
                                   "every step shape: every request at once (offline, the "
                                   "default) or at --request-rate; SGLang-style figures, the "
                                   "measured matmul peak and copy bandwidth, optionally a "
                                   "HuggingFace baseline, --compare runs and a --plot.")
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"alias or HF directory ({DEFAULT_MODEL})")
    runner.add_args(p)
    add_engine_args(p, exclude=("seed",))
    p.set_defaults(func=run_bench)


def run_bench(args: argparse.Namespace) -> int:
    """Run the benchmark and print its reports."""
    from minijax_serve.bench import runner

    runner.run(args, engine_config_from_args(args))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="minijax-serve", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    _add_bench(sub)
    return parser


def enable_compilation_cache() -> None:
    """Persist compiled steps in ``$MINIJAX_SERVE_CACHE/jax`` so repeated runs skip compiling
    (unless JAX_COMPILATION_CACHE_DIR already chooses a place)."""
    import jax

    from minijax_serve.models.loader import cache_root

    if not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        jax.config.update("jax_compilation_cache_dir", str(cache_root() / "jax"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``minijax-serve`` and ``python -m minijax_serve``; returns the exit status."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args = build_parser().parse_args(argv)
    enable_compilation_cache()
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
