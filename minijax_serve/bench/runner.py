"""``minijax-serve bench``: time the engine, or a server, on a workload, with its context in the
same run.

Order of a run: draw the workload (before any engine exists, so the engine's context can be
sized to it), then for each engine configuration (one, or one per ``--compare`` value): build a
fresh engine, compile every step shape (``Engine.warmup``, reported separately), measure the
matmul peak and copy bandwidth once per dtype, and time the workload through the step API
(:mod:`minijax_serve.bench.driver`): every request at once by default (offline), or at Poisson
arrival times with ``--request-rate``, at most ``--max-concurrency`` in flight. Compilations
must not grow during the timed run; if they do, a warning is printed and
``recompiled_during_run`` is set. With ``--backend openai`` the same workload and traffic go to
an OpenAI-compatible server instead (:mod:`minijax_serve.bench.openai_backend`), streamed over
HTTP, with the client-side figures only.

Each run prints an SGLang-style report and, with ``--output-json``, appends one JSON object (every
figure, the engine configuration and the workload flags). ``--compare`` then prints the runs side
by side with ratios against the first. With ``--baseline hf`` the same requests then run through
HuggingFace transformers (:mod:`minijax_serve.bench.hf_baseline`), printed in its own section
with the engine/HF throughput ratios and stored under each run's ``baseline``. ``--repeats N``
does all of that N times in turn (engine runs, baseline, engine runs, baseline, ...), so that
the ratios of one repeat share the machine's drift, and ends with each configuration's output
throughput and ratio in every repeat and their medians. ``--plot`` draws throughput over time
and latency CDFs of every run and the baseline (of the first repeat), and each engine run's
batch composition and KV usage from its step trace (recorded for ``--plot`` as for ``--trace``).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import math
from pathlib import Path
from typing import Any

import jax
import numpy as np

from minijax_serve.bench import engine_run
from minijax_serve.bench.args import add_args, check_args
from minijax_serve.bench.compare import REQUEST_FIELDS, compare_value, format_compare, zip_compare
from minijax_serve.bench.datasets import DATASETS, BenchRequest, DatasetContext, random_id_bound
from minijax_serve.bench.driver import arrival_offsets
from minijax_serve.bench.report import (WIDTH, append_json, format_baseline, format_repeats,
                                        format_report)
from minijax_serve.config import EngineConfig
from minijax_serve.core.sampling_params import SamplingParams

__all__ = ["add_args", "run"]  # cli.py adds the bench's flags with runner.add_args


Run = tuple[Any, EngineConfig, dict[str, Any]]  # compare value, engine config, request fields


def _configs(args: argparse.Namespace, config: EngineConfig) -> list[Run]:
    """(compare value or None, engine config, request fields) of every run, each validated."""
    request = {name: getattr(args, name) for name in REQUEST_FIELDS}
    if args.compare is None:
        runs = [(None, config, request)]
    else:
        runs = []
        for o in zip_compare(args.compare)[1]:
            engine_fields = {k: v for k, v in o.items() if k not in REQUEST_FIELDS}
            runs.append((compare_value(o), dataclasses.replace(config, **engine_fields),
                         {**request, **{k: v for k, v in o.items() if k in REQUEST_FIELDS}}))
    for _, _, fields in runs:
        SamplingParams(**fields)
    return runs


def run(args: argparse.Namespace, config: EngineConfig) -> list[dict[str, Any]]:
    """Run the benchmark (one run per ``--compare`` value, all of them ``--repeats`` times, each
    time followed by the baseline), print the reports, append them to ``--output-json``, draw
    ``--plot``; returns each run's figures, repeat after repeat."""
    check_args(args)
    server = None
    if args.backend == "openai":
        from minijax_serve.bench import openai_backend  # httpx only for a server

        server = openai_backend.connect(args)  # before the draw: a server that is down fails now
    requests, config, tokenizer = _draw_workload(args, config)
    offsets = arrival_offsets(len(requests), args.request_rate, args.burstiness, args.seed)
    if server is None:
        runs = _configs(args, config)
    else:
        bodies = openai_backend.request_bodies(args, server, requests, tokenizer)
    repeats = args.repeats
    field = None if args.compare is None else zip_compare(args.compare)[0]

    results: list[dict[str, Any]] = []
    peaks: dict[str, tuple[float, float]] = {}
    append_now = bool(args.output_json) and args.baseline == "none"  # else after the baseline
    plotted: tuple[list[dict[str, Any]], Any] | None = None
    for repeat in range(repeats):
        if repeats > 1:
            print(f"\n## Repeat {repeat + 1}/{repeats}")
        if server is None:
            borrowed = tokenizer if args.tokenizer else None
            round_results, traces = _run_engines(args, runs, field, requests, offsets, peaks,
                                                 repeat, append_now, borrowed)
        else:
            result, run_trace = openai_backend.run_server(args, server, bodies, offsets)
            _show(args, result, run_trace, "openai", None, repeat, append_now)
            round_results, traces = [result], [run_trace]
        base = None
        if args.baseline == "hf":
            dtype = _baseline_dtype(config, server, round_results)
            base = _run_baseline(args, requests, round_results, dtype)
        if args.output_json and not append_now:
            for result in round_results:
                append_json(args.output_json, result)
        results += round_results
        if plotted is None:
            plotted = traces, base
    if repeats > 1:
        print(format_repeats(results))
    if args.plot:
        from minijax_serve.bench import plot

        rate = "offline" if math.isinf(args.request_rate) else f"{args.request_rate:g} req/s"
        model = args.model if server is None else server.model
        sim = f" on a simulated {config.simulate} (virtual time)" if config.simulate else ""
        plot.plot_runs(args.plot, *plotted,
                       title=f"{model}{sim}: {args.dataset_name}, {len(requests)} requests, {rate}")
        print(f"Plot written to {args.plot}")
    return results


def _run_engines(args: argparse.Namespace, runs: list[Run],
                 field: str | None, requests: list[BenchRequest], offsets: np.ndarray,
                 peaks: dict[str, tuple[float, float]], repeat: int, append_now: bool,
                 tokenizer: Any = None) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """One timed run of each engine configuration, reports printed (and appended to
    ``--output-json`` at once if ``append_now``), ``tokenizer`` borrowed by every engine
    (``--tokenizer``); returns (figures, plot traces)."""
    results: list[dict[str, Any]] = []
    traces: list[dict[str, Any]] = []
    for index, (value, cfg, request) in enumerate(runs):
        compare = None if field is None else {
            "field": field, "value": value, "index": index, "values": [r[0] for r in runs]}
        label = "minijax" if compare is None else f"{field}={value}"
        if compare is not None:
            print(f"\n### Run {index + 1}/{len(runs)}: {label}")
        result, run_trace = engine_run.run_engine(args, cfg, request, requests, offsets, peaks,
                                                  label, tokenizer)
        _show(args, result, run_trace, label, compare, repeat, append_now)
        results.append(result)
        traces.append(run_trace)
    if len(results) > 1:
        print(format_compare(field, results))
    return results, traces


def _show(args: argparse.Namespace, result: dict[str, Any], run_trace: dict[str, Any],
          label: str, compare: dict[str, Any] | None, repeat: int, append_now: bool) -> None:
    """Label a run, print its report (after a warning if it compiled while timed), append it
    to ``--output-json`` if ``append_now``."""
    result.update(compare=compare, baseline=None, repeat=repeat, repeats=args.repeats)
    run_trace["label"] = label
    if result.get("recompiled_during_run"):
        print("!" * WIDTH)
        print(f"WARNING: {result['num_compilations_after'] - result['num_compilations_before']}"
              " program(s) compiled DURING the timed run; its figures include compile time")
        print("!" * WIDTH)
    print(format_report(result))
    if append_now:
        append_json(args.output_json, result)  # as it goes: a cut run keeps what it measured


def _baseline_dtype(config: EngineConfig, server: Any, results: list[dict[str, Any]]) -> str:
    """The engine's dtype; for a server, whose dtype the client cannot see, ``--dtype`` as an
    engine here would resolve it."""
    if server is None:
        return results[0]["dtype"]
    from minijax_serve.engine.setup import default_dtype

    return jax.numpy.dtype(default_dtype(config.dtype, jax.default_backend())).name


def _run_baseline(args: argparse.Namespace, requests: list[BenchRequest],
                  results: list[dict[str, Any]], dtype: str) -> dict[str, Any]:
    """Run the HF baseline on the requests in ``dtype``, store it and the throughput ratios
    under each run's ``baseline``, print them; returns the baseline's figures."""
    from minijax_serve.bench import hf_baseline

    gc.collect()  # the engines are gone: free their KV pools before HF loads its model
    base = hf_baseline.run_hf_baseline(
        args.model, [(list(r.prompt_ids), r.output_len) for r in requests],
        args.baseline_batch_size, dtype)
    for result in results:
        result["baseline"] = dict(
            base,
            output_throughput_ratio=result["output_throughput"] / base["output_throughput"],
            total_throughput_ratio=result["total_throughput"] / base["total_throughput"])
    print(format_baseline(results[0]["baseline"],
                          "Server" if results[0]["backend"] == "openai" else "Engine"))
    for result in results[1:]:
        b = result["baseline"]
        print(f"{result['compare']['field']}={result['compare']['value']}: output "
              f"{b['output_throughput_ratio']:.2f}x, total "
              f"{b['total_throughput_ratio']:.2f}x the baseline")
    return base


def _draw_workload(args: argparse.Namespace, config: EngineConfig):
    """Draw the requests from the model's config and tokenizer, before the engine exists;
    returns (requests, config, tokenizer or None).

    Without ``--context-length``, the engine's context is sized to the workload (the next power
    of two above its longest request, capped by the model's): the step shapes ``warmup`` compiles
    then cover what the run can produce, not the model's whole context.
    """
    from minijax_serve.engine.setup import load_tokenizer
    from minijax_serve.models.config import load_model_config
    from minijax_serve.models.registry import resolve_model

    resolved = resolve_model(args.model)
    model_cfg = load_model_config(resolved.path)
    if args.tokenizer:  # borrowed: its token counts are its own, not the model's tokenizer's
        tokenizer = load_tokenizer(Path(args.tokenizer))
    elif config.skip_tokenizer_init or resolved.dummy:
        tokenizer = None
    else:
        tokenizer = load_tokenizer(resolved.path)
    context = config.context_length or model_cfg.context_limit()[0]
    ctx = DatasetContext(random_id_bound(model_cfg.vocab_size, tokenizer), tokenizer, context,
                         np.random.default_rng(args.seed))
    requests = DATASETS[args.dataset_name].sample(args, ctx)
    if config.context_length is None:
        longest = max(len(r.prompt_ids) + r.output_len for r in requests)
        fitted = min(context, 1 << (longest - 1).bit_length())
        config = dataclasses.replace(config, context_length=fitted)
    return requests, config, tokenizer
