"""The ``bench`` subcommand's own flags (``cli.py`` adds ``--model`` and the EngineConfig flags),
their checks, and the workload record stored with every run."""

from __future__ import annotations

import argparse
import dataclasses
import math
from typing import Any

from minijax_serve.bench import (copy_dataset,  # noqa: F401  (register their datasets)
                                  tree_dataset)
from minijax_serve.bench.compare import REQUEST_FIELDS, parse_compare
from minijax_serve.bench.datasets import DATASETS
from minijax_serve.bench.metrics import SLO_METRICS
from minijax_serve.config import EngineConfig
from minijax_serve.config.flags import add_sampling_args


def _rate(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0 (inf = offline), got {text}")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return value


def _percentiles(text: str) -> tuple[float, ...]:
    values = tuple(float(p) for p in text.split(","))
    if not all(0 < p < 100 for p in values):
        raise argparse.ArgumentTypeError(f"each percentile must be in (0, 100), got {text}")
    return values


def _slo(text: str) -> tuple[str, float]:
    name, _, ms = text.partition(":")
    try:
        value = float(ms)
    except ValueError:
        value = -1.0
    if name not in SLO_METRICS or not value > 0:
        raise argparse.ArgumentTypeError(
            f"must be METRIC:MS with METRIC one of {', '.join(SLO_METRICS)} and MS > 0, got {text}")
    return SLO_METRICS[name], value


def add_args(parser: argparse.ArgumentParser) -> None:
    """The benchmark's own flags and every registered dataset's flags."""
    parser.add_argument("--dataset", "--dataset-name", dest="dataset_name",
                        choices=sorted(DATASETS), default="random",
                        help="where the prompts and output lengths come from (default: random)")
    parser.add_argument("--num-prompts", type=int, default=64,
                        help="requests in the run (default: 64)")
    parser.add_argument("--tokenizer", metavar="DIR", default=None,
                        help="a model directory whose tokenizer the dataset and the engine "
                             "use instead of the model's own, e.g. for a shape-only alias "
                             "(llama-3-8b) under --simulate; token counts are then that "
                             "tokenizer's, not the model's (default: the model's own)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the dataset draw and of the arrival times (also "
                             "EngineConfig.seed; default: 0)")
    server = parser.add_argument_group("backend")
    server.add_argument("--backend", choices=("minijax", "openai"), default="minijax",
                        help="minijax: time an in-process engine (default); openai: time an "
                             "OpenAI-compatible server (ours, vLLM, SGLang) at --base-url over "
                             "streaming HTTP, latencies measured at the client. With openai, "
                             "--model only gives the dataset's tokenizer and vocabulary (and the "
                             "hf baseline's model) and the engine flags are not used, except "
                             "--skip-tokenizer-init and --context-length for the dataset and "
                             "--dtype for the hf baseline")
    server.add_argument("--base-url", metavar="URL", default=None,
                        help="the server's address without /v1, e.g. http://127.0.0.1:30000 "
                             "(required with --backend openai)")
    server.add_argument("--endpoint", choices=("completions", "chat"), default="completions",
                        help="completions: POST /v1/completions with the prompt's token ids; "
                             "chat: POST /v1/chat/completions with the prompt decoded as one "
                             "user message (needs the tokenizer; default: completions)")
    server.add_argument("--served-model-name", metavar="NAME", default=None,
                        help="the model field of every request (default: the first id of GET "
                             "/v1/models)")
    server.add_argument("--api-key", metavar="KEY", default=None,
                        help="sent as Authorization: Bearer KEY (default: $OPENAI_API_KEY, "
                             "else none); never stored in --output-json")
    traffic = parser.add_argument_group("traffic")
    traffic.add_argument("--request-rate", type=_rate, default=math.inf, metavar="R",
                         help="requests per second, Poisson arrivals; inf = every request at "
                              "once, an offline run (default: inf)")
    traffic.add_argument("--burstiness", type=float, default=1.0,
                         help="shape of the gamma-distributed gaps between arrivals: 1 = "
                              "Poisson, < 1 burstier, > 1 more regular (default: 1)")
    traffic.add_argument("--max-concurrency", type=_positive_int, default=None, metavar="C",
                         help="at most C requests sent and unfinished at a time; the others wait "
                              "in the client (default: no limit)")
    traffic.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                         help="generate every request's full output length, ignoring EOS, as "
                              "SGLang's benchmarks do (default: on; --no-ignore-eos honours "
                              "EOS; the hf baseline always ignores it)")
    out = parser.add_argument_group("output")
    out.add_argument("--output-json", metavar="FILE",
                     help="append each run's figures and configuration as one JSON object per "
                          "line")
    out.add_argument("--metric-percentiles", type=_percentiles, default=(99.0,),
                     metavar="P1,P2,...",
                     help="the percentiles of every latency to report, each in (0, 100) "
                          "(vLLM's flag; default 99): keys p<P>_{ttft,tpot,itl,e2e}_ms")
    out.add_argument("--goodput", type=_slo, nargs="+", default=None, metavar="METRIC:MS",
                     help="service-level objectives in ms (ttft, tpot, e2el or e2e), e.g. "
                          "--goodput ttft:500 tpot:50: request_goodput = finished requests "
                          "that met all of them per second (vLLM's flag and rule)")
    out.add_argument("--output-details", action="store_true",
                     help="also store per-request lengths, send times and latencies in the JSON")
    out.add_argument("--trace", metavar="FILE.jsonl",
                     help="append every timed step's StepRecord (minijax_serve.engine.trace), with its "
                          "run's label, as one JSON object per line (the in-process engine "
                          "only)")
    out.add_argument("--plot", metavar="FILE.png",
                     help="draw tokens/s over time and TTFT / E2E latency CDFs of every run "
                          "(and the baseline) of the first repeat into FILE.png (needs "
                          "matplotlib)")
    out.add_argument("--disable-tqdm", action="store_true",
                     help="no progress bar (there is none when stdout is not a terminal)")
    parser.add_argument("--compare", type=parse_compare, action="append", default=None,
                        metavar="FIELD=V1,V2,...",
                        help="run the workload once per value of one EngineConfig field (a fresh "
                             "engine each), e.g. page_size=16,32 or skip_tokenizer_init=False,True,"
                             " or of a request field (" + ", ".join(REQUEST_FIELDS) + "), e.g. "
                             "logprobs=none,5; prints the runs side by side with ratios against "
                             "the first. "
                             "Repeat it to vary several fields together (run i takes each "
                             "field's i-th value)")
    parser.add_argument("--repeats", type=_positive_int, default=1, metavar="N",
                        help="run the whole comparison N times in turn (every configuration, then "
                             "the baseline, then again), so that each shares the machine's drift; "
                             "prints each repeat's throughputs and ratios and their medians "
                             "(default: 1)")
    ceiling = parser.add_argument_group("hardware ceiling")
    ceiling.add_argument("--peak-matmul-size", type=int, default=None,
                         help="side of the square matmul timed as the FLOP/s peak "
                              "(default: 2048 on CPU, 8192 on accelerators)")
    ceiling.add_argument("--peak-copy-mib", type=int, default=None,
                         help="MiB of the array copied to time the memory bandwidth "
                              "(default: 256 on CPU, 2048 on accelerators)")
    base = parser.add_argument_group("baseline")
    base.add_argument("--baseline", choices=("none", "hf"), default="none",
                      help="also run the same requests through a baseline: hf = HuggingFace "
                           "transformers generate, static left-padded batches (default: none)")
    base.add_argument("--baseline-batch-size", type=int, default=16,
                      help="requests per static batch of the hf baseline (default: 16)")
    add_sampling_args(parser, REQUEST_FIELDS)
    for dataset in DATASETS.values():
        dataset.add_args(parser)


def workload(args: argparse.Namespace) -> dict[str, Any]:
    """The command-line arguments that are not EngineConfig fields (nor the API key)."""
    engine_fields = {f.name for f in dataclasses.fields(EngineConfig)} - {"seed"}
    skip = engine_fields | {"func", "command", "output_json", "api_key"}
    return {k: v for k, v in vars(args).items() if k not in skip}


def _check_backend(args: argparse.Namespace) -> None:
    """The server flags: needed with ``--backend openai``, meaningless without it."""
    if args.backend != "openai":
        for flag, given in (("--base-url", args.base_url is not None),
                            ("--served-model-name", args.served_model_name is not None),
                            ("--api-key", args.api_key is not None),
                            ("--endpoint", args.endpoint != "completions")):
            if given:
                raise ValueError(f"{flag} is for a server: it needs --backend openai")
        return
    if args.base_url is None:
        raise ValueError("--backend openai needs --base-url URL, the server's address "
                         "(e.g. http://127.0.0.1:30000)")
    if not args.base_url.startswith(("http://", "https://")):
        raise ValueError(f"--base-url must start with http:// or https://, got {args.base_url!r}")
    if args.compare is not None:
        raise ValueError("--compare runs a fresh in-process engine per value; it cannot vary a "
                         "server's configuration: not with --backend openai (run the bench "
                         "once per server configuration instead)")


def check_args(args: argparse.Namespace) -> None:
    """ValueError naming the flag for a bad combination, before anything is loaded."""
    if args.num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {args.num_prompts}")
    _check_backend(args)
    if args.trace and args.backend == "openai":
        raise ValueError("--trace records the in-process engine's steps: a server's are its own "
                         "(drop --trace, or --backend openai)")
    if getattr(args, "simulate", None) is not None:
        for flag, given in (("--backend openai", args.backend == "openai"),
                            ("--baseline hf", args.baseline == "hf")):
            if given:
                raise ValueError(f"--simulate runs no model; {flag} needs one (drop one of "
                                 "them)")
    if args.goodput is not None and len(dict(args.goodput)) < len(args.goodput):
        raise ValueError(f"--goodput names a metric twice: {args.goodput}")
    if args.baseline == "hf" and args.baseline_batch_size < 1:
        raise ValueError(f"--baseline-batch-size must be >= 1, got {args.baseline_batch_size}")
    for flag, value in (("--peak-matmul-size", args.peak_matmul_size),
                        ("--peak-copy-mib", args.peak_copy_mib)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise ValueError("--plot needs matplotlib (pip install matplotlib, or the package's "
                             "[test] extra)") from None
