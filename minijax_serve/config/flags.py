"""Command-line flags shared by every subcommand: one per EngineConfig field and per request
(SamplingParams) field, each with its allowed values and its effective default on this machine,
and the CLI's spelling of the library's error messages (``--skip-tokenizer-init``, not
``skip_tokenizer_init=True``).

EngineConfig fields become flags from the dataclass: ``page_size`` -> ``--page-size``; bool fields
are on/off flags (``--no-X`` for those that default to true); ``int | None`` fields take an
integer or ``none``.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import types
import typing
from typing import Any, Callable, Sequence

from minijax_serve.config.engine_config import EngineConfig
from minijax_serve.config.names import (ATTENTION_BACKENDS, KV_CACHE_DTYPES, POLICY_NAMES,
                                        QUANTIZATIONS, RETRACT_POLICIES, SIMULATED_DEVICES,
                                        SIMULATED_HOST_TIMES, SPECULATIVE_METHODS)
from minijax_serve.core.sampling_params import MAX_LOGPROBS, SamplingParams

ENGINE_HELP = {  # field -> what it is and its allowed values (the default is appended)
    "dtype": "weights and KV cache dtype: auto, float32, bfloat16 or float16",
    "load_format": "auto (safetensors, restored from an Orbax cache after the first load), "
                   "safetensors, or dummy (random weights)",
    "page_size": "tokens per KV page, >= 1 (a power of two for the pallas backend)",
    "max_total_tokens": "KV pool size in tokens, >= the page size; none: sized from the "
                        "device (accelerators: --mem-fraction-static of the free memory; CPU: "
                        "4 GiB or max-running-requests x context, whichever is smaller)",
    "mem_fraction_static": "share of the free device memory for the KV pool when "
                           "--max-total-tokens is none, in (0, 1)",
    "context_length": "longest prompt + output in tokens, >= 2; none: the model's "
                      "max_position_embeddings (its sliding window if shorter)",
    "max_running_requests": "requests holding a slot (decoding or mid-prefill) at once, >= 1; "
                            "none: SGLang's rule from the KV pool and the context (accelerators), "
                            "64 (CPU)",
    "max_prefill_tokens": "new tokens of whole prompts admitted per prefill step, >= 1 (one "
                          "longer prompt still runs alone); none: 16384 (accelerators), 4096 "
                          "(CPU)",
    "min_token_bucket": "smallest padded new-token count of a prefill step, >= 1",
    "min_seq_bucket": "smallest padded sequence count of a decode step, >= 1",
    "min_kv_bucket": "smallest page-table width in tokens, >= 1; none: one width, the whole "
                     "context",
    "attention_backend": "auto, xla (the jnp reference), pallas (the Triton kernels; "
                         "interpreted on CPU) or pallas_mgpu (pallas with the Mosaic GPU ragged "
                         "kernel for prefill tokens; Hopper, bfloat16/float16 (float32 only "
                         "interpreted, on CPU), head_dim 64/128/256, page size 8-64)",
    "layer_loop": "auto, scan (one compiled layer body) or unroll (the layers written out)",
    "skip_tokenizer_init": "no tokenizer: prompts and outputs are token ids",
    "seed": "engine seed (the random schedule policy, unseeded requests, dummy weights), in "
            "[0, 2**32)",
    "enable_radix_cache": "reuse the KV of cached prefixes (a radix tree over KV pages)",
    "schedule_policy": "order of the waiting queue: " + ", ".join(POLICY_NAMES),
    "lpm_max_queue": "lpm falls back to fcfs above this many waiting requests, >= 1",
    "chunked_prefill_size": "new tokens per step under chunked prefill, a positive multiple of "
                            "the page size; -1: off; none: 512 (CPU), SGLang's by the device's "
                            "memory (8192 on an H100 or H200, 16384 above 160 GiB)",
    "enable_mixed_chunk": "unified steps: the running requests' decode tokens and prompt tokens "
                          "in one ragged step (needs chunked prefill); none: on for "
                          "accelerators, off on CPU",
    "schedule_conservativeness": "scales the initial new-token ratio, > 0",
    "init_new_token_ratio": "initial share of max_new_tokens reserved in admission, in (0, 1]",
    "min_new_token_ratio_factor": "the ratio decays to this factor of its initial value, in "
                                  "(0, 1]",
    "new_token_ratio_decay_steps": "decode steps over which the ratio decays, >= 1",
    "retract_decode_steps": "tokens per request added to the ratio after a retract, >= 0",
    "exact_ignore_eos_admission": "admit ignore_eos requests by their exact future KV, not "
                                  "the ratio",
    "retract_policy": "which requests are retracted first: " + " or ".join(RETRACT_POLICIES),
    "force_retract_every": "retract one request every N decode steps (a test switch), >= 0 "
                           "(0: off)",
    "enable_overlap": "dispatch the next step before taking the previous step's tokens",
    "record_steps": "keep one record per dispatched step (Engine.step_records; bench --trace)",
    "compilation_cache": "JAX's persistent compilation cache in $MINIJAX_SERVE_CACHE/jax (a "
                         "directory configured already is kept); off: JAX's settings untouched",
    "tensor_parallel_size": "devices the model is split over (tensor parallelism; 1: off)",
    "simulate": "run no model: drive the real scheduler with a cost model of this device "
                "profile (h200, h100, cpu), on a virtual clock; no weights are loaded",
    "simulated_host_time": "simulated runs: measured (the host's real time counts) or modeled "
                           "(only the profile's dispatch cost: the same figures on every run)",
    "quantization": "fp8: the decoder layers' linear weights in float8_e4m3fn, a scale per "
                    "output channel, dequantised in the matmul; fp8_w8a8: activations in FP8 "
                    "too (a scale per token); none: the checkpoint's own (an FP8 checkpoint "
                    "stays FP8)",
    "kv_cache_dtype": "auto (the model's --dtype) or fp8_e4m3 (float8_e4m3fn pools, a scale "
                      "per layer and KV head: about twice the tokens)",
    "max_logprobs": f"most top log-probabilities a request may ask for, in [0, {MAX_LOGPROBS}]",
    "speculative_method": "speculative decoding: ngram (prompt lookup) or draft (a draft model "
                          "of the same vocabulary); none: off",
    "num_speculative_tokens": "tokens proposed per request and step, verified in one step, >= 1",
    "speculative_draft_model": "draft: the draft model, an alias or a directory; none: the "
                               "target itself (a self-draft, see --speculative-draft-layers)",
    "speculative_draft_layers": "draft: keep only the draft model's first N layers (with its "
                                "final norm and head), >= 1; none: all",
    "speculative_ngram_min": "ngram: the shortest suffix of the sequence looked up, >= 1",
    "speculative_ngram_max": "ngram: the longest suffix looked up, >= --speculative-ngram-min",
    "speculative_simulated_acceptance": "with --simulate: the chance each proposed (dummy) token "
                                        "is accepted, in [0, 1]",
}
ENGINE_CHOICES = {"dtype": ("auto", "float32", "bfloat16", "float16"),
                  "load_format": ("auto", "safetensors", "dummy"),
                  "attention_backend": ATTENTION_BACKENDS,
                  "layer_loop": ("auto", "scan", "unroll"),
                  "schedule_policy": POLICY_NAMES, "retract_policy": RETRACT_POLICIES,
                  "simulate": (None, *SIMULATED_DEVICES), "quantization": QUANTIZATIONS,
                  "kv_cache_dtype": KV_CACHE_DTYPES, "simulated_host_time": SIMULATED_HOST_TIMES,
                  "speculative_method": (None, *SPECULATIVE_METHODS)}

SAMPLING_HELP = {  # SamplingParams field -> help; every request flag of the CLI
    "max_new_tokens": "most tokens to generate, >= 1",
    "min_new_tokens": "EOS and stop tokens are masked and stop strings ignored until this many "
                      "are generated, in [0, max-new-tokens]",
    "temperature": "sampling temperature, >= 0 (0: greedy)",
    "top_p": "nucleus sampling mass, in (0, 1] (1: off)",
    "top_k": "sample among the k most likely tokens, in [1, 2**31) (-1: off; above the "
             "vocabulary size: all of it)",
    "min_p": "drop tokens below this share of the top token's probability, in [0, 1) (0: off)",
    "repetition_penalty": "HF's repetition penalty over prompt and output tokens, in float32's "
                          "normal range [1.2e-38, 3.4e38] (1: off)",
    "frequency_penalty": "OpenAI's frequency penalty over output tokens, in [-2, 2] (0: off)",
    "presence_penalty": "OpenAI's presence penalty over output tokens, in [-2, 2] (0: off)",
    "n": "samples of the prompt, in [1, max-running-requests]; the prompt is computed once",
    "seed": "sampling seed of the request, in [0, 2**32) (sample 0 of n draws from it, sample i "
            "from one derived from it and i)",
    "stop": "a stop string, not included in the output unless --include-stop-str-in-output "
            "(repeat for several)",
    "stop_token_ids": "a stop token id (repeat for several)",
    "logit_bias": "TOKEN_ID=BIAS: add BIAS, in [-100, 100], to the token's logit before "
                  "sampling (repeat for several)",
    "ignore_eos": "generate past EOS, up to max-new-tokens",
    "skip_special_tokens": "leave special tokens (EOS, chat markers) out of the text",
    "include_stop_str_in_output": "keep the stop string (or the EOS / stop token's text) that "
                                  "ended the output in its text",
    "logprobs": f"print the log-probabilities of each output token and of its top K, K in "
                f"[0, {MAX_LOGPROBS}]",
    "prompt_logprobs": f"print the log-probabilities of each prompt token and of its top K, K "
                       f"in [0, {MAX_LOGPROBS}]",
    "json_schema": "structured output: a JSON schema the output fits ('{\"type\": \"object\"}' "
                   "for any object; needs the structured extra)",
    "regex": "structured output: a regular expression the whole output matches",
    "ebnf": "structured output: a GBNF or Lark grammar of the output",
    "speculate": "take part in speculative decoding when the engine speculates (--no-speculate: "
                 "one token per step)",
}


def token_bias(text: str) -> tuple[int, float]:
    """``--logit-bias TOKEN_ID=BIAS`` -> (token id, bias)."""
    token, sep, bias = text.partition("=")
    if not sep:
        raise ValueError(text)
    return int(token), float(bias)


# list fields: one flag per value (its name, its type)
REPEATED = {"stop": ("--stop", str), "stop_token_ids": ("--stop-token-id", int),
            "logit_bias": ("--logit-bias", token_bias)}


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _optional(convert: Callable[[str], Any]) -> Callable[[str], Any]:
    """An argparse type for ``X | None`` fields: ``none`` (any case) -> None, else ``convert``."""

    def parse(text: str) -> Any:
        return None if text.lower() == "none" else convert(text)

    parse.__name__ = convert.__name__  # argparse names the type in its error messages
    return parse


def converter(hint: Any) -> tuple[Callable[[str], Any], bool]:
    """(argparse type, is_bool) for a field's type hint: bool, int, float, str or ``X | None``."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in args:
        inner = [a for a in args if a is not type(None)]
        if inner == [bool]:  # on, off (--no-X) or left to the engine
            return _optional(bool), True
        if str in inner:  # text on the command line (json_schema: a schema's JSON)
            inner = [str]
        if len(inner) != 1:
            raise TypeError(f"unsupported field type {hint!r}")
        return _optional(converter(inner[0])[0]), False
    if hint is bool:
        return bool, True
    if hint in (int, float, str):
        return hint, False
    raise TypeError(f"unsupported field type {hint!r}")


def _effective_default(name: str, default: Any) -> str:
    """The default as it resolves on this machine, for the backend-dependent fields."""
    import jax

    backend, config = jax.default_backend(), EngineConfig()
    if name == "dtype":
        return f"auto = {'float32' if backend == 'cpu' else 'bfloat16'} here ({backend})"
    if name == "attention_backend":
        return f"auto = {config.resolved_attention_backend(backend)} here ({backend})"
    if name == "layer_loop":
        return f"auto = {config.resolved_layer_loop(backend)} here ({backend})"
    if name in ("chunked_prefill_size", "max_prefill_tokens", "max_running_requests",
                "enable_mixed_chunk"):  # engine/limits.py
        cpu = {"chunked_prefill_size": "512", "max_prefill_tokens": "4096",
               "max_running_requests": "64", "enable_mixed_chunk": "off"}[name]
        return (f"none = {cpu} here ({backend})" if backend == "cpu" else
                f"none = from the device here ({backend}; {cpu} on CPU)")
    return str(default).lower() if default is None else str(default)


def add_engine_args(parser: argparse.ArgumentParser, exclude: Sequence[str] = ()) -> None:
    """Add one flag per EngineConfig field (except ``exclude``, which the caller defines itself)."""
    group = parser.add_argument_group("engine (EngineConfig fields)")
    hints = typing.get_type_hints(EngineConfig)
    for field in dataclasses.fields(EngineConfig):
        if field.name in exclude:
            continue
        convert, is_bool = converter(hints[field.name])
        text = f"{ENGINE_HELP[field.name]} (default: {_effective_default(field.name, field.default)})"
        if is_bool:
            action = "store_true" if field.default is False else argparse.BooleanOptionalAction
            group.add_argument(flag(field.name), action=action, default=field.default, help=text)
        else:
            group.add_argument(flag(field.name), type=convert, default=field.default, help=text,
                               metavar=field.name.upper(), choices=ENGINE_CHOICES.get(field.name))


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig named by the parsed flags (fields absent from ``args`` keep defaults)."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)
              if hasattr(args, f.name)}
    return EngineConfig(**values)


def sampling_parser(name: str) -> Callable[[str], Any]:
    """The parser of one SamplingParams field's command-line values."""
    return converter(typing.get_type_hints(SamplingParams)[name])[0]


def add_sampling_args(parser: argparse.ArgumentParser, names: Sequence[str],
                      **defaults: Any) -> None:
    """Add a flag per named SamplingParams field, defaulting to ``defaults`` or else to
    SamplingParams' default."""
    group = parser.add_argument_group("request (SamplingParams fields)")
    params = SamplingParams()
    for name in names:
        default = defaults.get(name, getattr(params, name))
        text = f"{SAMPLING_HELP[name]} (default: {'none' if default in (None, ()) else default})"
        if name in REPEATED:
            group.add_argument(REPEATED[name][0], dest=name, type=REPEATED[name][1],
                               action="append", default=[], help=text)
        elif isinstance(default, bool):
            action = argparse.BooleanOptionalAction if default else "store_true"
            group.add_argument(flag(name), action=action, default=default, help=text)
        else:
            group.add_argument(flag(name), type=sampling_parser(name), default=default,
                               metavar=name.upper(), help=text)


def sampling_params_from_args(args: argparse.Namespace, **fixed: Any) -> SamplingParams:
    """SamplingParams from the parsed request flags (ValueError on a bad value) and ``fixed``."""
    names = {f.name for f in dataclasses.fields(SamplingParams)}
    return SamplingParams(**{k: v for k, v in vars(args).items() if k in names}, **fixed)


def cli_spelling(message: str) -> str:
    """A library error message as a command-line user reads it: field names as flags
    (``skip_tokenizer_init=True`` -> ``--skip-tokenizer-init``, ``page_size=3`` ->
    ``--page-size 3``)."""
    names = {f.name for f in dataclasses.fields(EngineConfig)} | set(SAMPLING_HELP)

    def assigned(m: re.Match) -> str:
        name, value = m[1], m[2]
        if name not in names:
            return m[0]
        if value in ("True", "False"):
            return flag(name) if value == "True" else "--no-" + flag(name)[2:]
        return f"{flag(name)} {value}"

    message = re.sub(r"\b([a-z][a-z0-9_]*)=([^\s,;)]+)", assigned, message)
    message = re.sub(r"(?<![-\w])([a-z][a-z0-9]*_[a-z0-9_]+)\b",
                     lambda m: flag(m[1]) if m[1] in names else m[0], message)
    return re.sub(r"^([a-z]+)\b(?= must|:)",
                  lambda m: flag(m[1]) if m[1] in names else m[0], message)
