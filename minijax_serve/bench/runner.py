"""``minijax-serve bench``: time the engine on a workload, with its context in the same run.

Order of a run: draw the workload (before any engine exists, so the engine's context can be
sized to it), then for each engine configuration (one, or one per ``--compare`` value): build a
fresh engine, compile every step shape (``Engine.warmup``, reported separately), measure the
matmul peak and copy bandwidth once per dtype, and time the workload through the step API
(:mod:`minijax_serve.bench.driver`): every request at once by default (offline), or at Poisson
arrival times with ``--request-rate``, at most ``--max-concurrency`` in flight. Compilations
must not grow during the timed run; if they do, a warning is printed and
``recompiled_during_run`` is set.

Each run prints an SGLang-style report and, with ``--output-json``, appends one JSON object (every
figure, the engine configuration and the workload flags). ``--compare`` then prints the runs side
by side with ratios against the first. With ``--baseline hf`` the same requests then run through
HuggingFace transformers (:mod:`minijax_serve.bench.hf_baseline`), printed in its own section
with the engine/HF throughput ratios and stored under each run's ``baseline``. ``--repeats N``
does all of that N times in turn (engine runs, baseline, engine runs, baseline, ...), so that
the ratios of one repeat share the machine's drift, and ends with each configuration's output
throughput and ratio in every repeat and their medians. ``--plot`` draws throughput over time
and latency CDFs of every run and the baseline (of the first repeat).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import sys
import time
from typing import Any, Sequence

import jax
import numpy as np

from minijax_serve.bench import metrics
from minijax_serve.bench.compare import (REQUEST_FIELDS, compare_value, format_compare,
                                         parse_compare, zip_compare)
from minijax_serve.bench.datasets import DATASETS, BenchRequest, DatasetContext
from minijax_serve.bench.driver import TimedRun, arrival_offsets, drive
from minijax_serve.bench.report import WIDTH, format_baseline, format_repeats, format_report
from minijax_serve.config import EngineConfig
from minijax_serve.flags import add_sampling_args
from minijax_serve.sampling_params import SamplingParams



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


def add_args(parser: argparse.ArgumentParser) -> None:
    """The benchmark's own flags and every registered dataset's flags."""
    parser.add_argument("--dataset", "--dataset-name", dest="dataset_name",
                        choices=sorted(DATASETS), default="random",
                        help="where the prompts and output lengths come from (default: random)")
    parser.add_argument("--num-prompts", type=int, default=64,
                        help="requests in the run (default: 64)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the dataset draw and of the arrival times (also "
                             "EngineConfig.seed; default: 0)")
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
    out.add_argument("--output-details", action="store_true",
                     help="also store per-request lengths, send times and latencies in the JSON")
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


def _workload(args: argparse.Namespace) -> dict[str, Any]:
    """The command-line arguments that are not EngineConfig fields."""
    engine_fields = {f.name for f in dataclasses.fields(EngineConfig)} - {"seed"}
    skip = engine_fields | {"func", "command", "output_json"}
    return {k: v for k, v in vars(args).items() if k not in skip}


def _jsonable(value: Any) -> Any:
    """``value`` with infinities as the strings "inf"/"-inf" and NaN as None (strict JSON)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, np.generic):
        return _jsonable(value.item())
    return value


def append_json(path: str, result: dict[str, Any]) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(_jsonable(result), allow_nan=False) + "\n")


def _check_args(args: argparse.Namespace) -> None:
    if args.num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {args.num_prompts}")
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
    for _, cfg, fields in runs:
        cfg.validate()
        SamplingParams(**fields)
    return runs


def run(args: argparse.Namespace, config: EngineConfig) -> list[dict[str, Any]]:
    """Run the benchmark (one run per ``--compare`` value, all of them ``--repeats`` times, each
    time followed by the baseline), print the reports, append them to ``--output-json``, draw
    ``--plot``; returns each run's figures, repeat after repeat."""
    _check_args(args)
    config.validate()
    requests, config = _draw_workload(args, config)
    runs = _configs(args, config)
    offsets = arrival_offsets(len(requests), args.request_rate, args.burstiness, args.seed)
    repeats = args.repeats
    field = None if args.compare is None else zip_compare(args.compare)[0]

    results: list[dict[str, Any]] = []
    peaks: dict[str, tuple[float, float]] = {}
    append_now = bool(args.output_json) and args.baseline == "none"  # else after the baseline
    plotted: tuple[list[dict[str, Any]], Any] | None = None
    for repeat in range(repeats):
        if repeats > 1:
            print(f"\n## Repeat {repeat + 1}/{repeats}")
        round_results, traces = _run_engines(args, runs, field, requests, offsets, peaks, repeat,
                                             append_now)
        base = None
        if args.baseline == "hf":
            base = _run_baseline(args, requests, round_results)
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
        plot.plot_runs(args.plot, *plotted,
                       title=f"{args.model}: {args.dataset_name}, {len(requests)} requests, {rate}")
        print(f"Plot written to {args.plot}")
    return results


def _run_engines(args: argparse.Namespace, runs: list[Run],
                 field: str | None, requests: list[BenchRequest], offsets: np.ndarray,
                 peaks: dict[str, tuple[float, float]], repeat: int, append_now: bool,
                 ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """One timed run of each engine configuration, reports printed (and appended to
    ``--output-json`` at once if ``append_now``); returns (figures, plot traces)."""
    results: list[dict[str, Any]] = []
    traces: list[dict[str, Any]] = []
    for index, (value, cfg, request) in enumerate(runs):
        compare = None if field is None else {
            "field": field, "value": value, "index": index, "values": [r[0] for r in runs]}
        label = "minijax" if compare is None else f"{field}={value}"
        if compare is not None:
            print(f"\n### Run {index + 1}/{len(runs)}: {label}")
        result, trace = _run_engine(args, cfg, request, requests, offsets, peaks, label)
        result.update(compare=compare, baseline=None, repeat=repeat, repeats=args.repeats)
        trace["label"] = label
        results.append(result)
        traces.append(trace)
        if result["recompiled_during_run"]:
            print("!" * WIDTH)
            print(f"WARNING: {result['num_compilations_after'] - result['num_compilations_before']}"
                  " step shape(s) compiled DURING the timed run; its figures include compile time")
            print("!" * WIDTH)
        print(format_report(result))
        if append_now:
            append_json(args.output_json, result)  # as it goes: a cut run keeps what it measured
    if len(results) > 1:
        print(format_compare(field, results))
    return results, traces


def _run_baseline(args: argparse.Namespace, requests: list[BenchRequest],
                  results: list[dict[str, Any]]) -> dict[str, Any]:
    """Run the HF baseline on the requests, store it and the throughput ratios under each
    run's ``baseline``, print them; returns the baseline's figures."""
    from minijax_serve.bench import hf_baseline

    gc.collect()  # the engines are gone: free their KV pools before HF loads its model
    base = hf_baseline.run_hf_baseline(
        args.model, [(list(r.prompt_ids), r.output_len) for r in requests],
        args.baseline_batch_size, results[0]["dtype"])
    for result in results:
        result["baseline"] = dict(
            base,
            output_throughput_ratio=result["output_throughput"] / base["output_throughput"],
            total_throughput_ratio=result["total_throughput"] / base["total_throughput"])
    print(format_baseline(results[0]["baseline"]))
    for result in results[1:]:
        b = result["baseline"]
        print(f"{result['compare']['field']}={result['compare']['value']}: output "
              f"{b['output_throughput_ratio']:.2f}x, total "
              f"{b['total_throughput_ratio']:.2f}x the baseline")
    return base


def _draw_workload(args: argparse.Namespace, config: EngineConfig):
    """Draw the requests from the model's config and tokenizer, before the engine exists.

    Without ``--context-length``, the engine's context is sized to the workload (the next power
    of two above its longest request, capped by the model's): the step shapes ``warmup`` compiles
    then cover what the run can produce, not the model's whole context.
    """
    from minijax_serve.engine_setup import load_tokenizer
    from minijax_serve.models.config import load_model_config
    from minijax_serve.models.registry import resolve_model

    resolved = resolve_model(args.model)
    model_cfg = load_model_config(resolved.path)
    tokenizer = None if config.skip_tokenizer_init or resolved.dummy else load_tokenizer(resolved.path)
    context = config.context_length or model_cfg.max_position_embeddings
    ctx = DatasetContext(model_cfg.vocab_size, tokenizer, context, np.random.default_rng(args.seed))
    requests = DATASETS[args.dataset_name].sample(args, ctx)
    if config.context_length is None:
        longest = max(len(r.prompt_ids) + r.output_len for r in requests)
        fitted = min(context, 1 << (longest - 1).bit_length())
        config = dataclasses.replace(config, context_length=fitted)
    return requests, config


def _check_fits(engine: Any, requests: Sequence[BenchRequest]) -> None:
    """Fail before timing if a request cannot run on this engine at all."""
    for i, r in enumerate(requests):
        total = len(r.prompt_ids) + r.output_len
        for limit, name, hint in ((engine.context_length, "context length", "--context-length"),
                                  (engine.kv_pool_tokens, "KV pool", "--max-total-tokens")):
            if total > limit:
                raise ValueError(f"request {i}: prompt ({len(r.prompt_ids)}) + output "
                                 f"({r.output_len}) = {total} tokens exceed the {name} ({limit} "
                                 f"tokens); raise {hint} or shorten the workload")


def _progress(total: int, label: str, disabled: bool):
    """A tqdm bar on completed requests (None when disabled, stdout is no terminal, or no tqdm)."""
    if disabled or not sys.stdout.isatty():
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=label, unit="req", dynamic_ncols=True)


def _run_engine(args: argparse.Namespace, config: EngineConfig, request: dict[str, Any],
                requests: list[BenchRequest], offsets: np.ndarray,
                peaks: dict[str, tuple[float, float]], label: str):
    """Build, warm up and time one engine on the workload, every request with the ``request``
    fields (logprobs, penalties); returns (figures, plot trace)."""
    from minijax_serve import Engine

    engine = Engine(args.model, config)
    num_programs = engine.warmup()
    num_shapes = len(engine.buckets.all_shapes())
    compile_time = engine.stats()["compile_time_s"]
    print(f"Warm-up: compiled {num_shapes} step shapes ({num_programs} programs with their "
          f"samplers) in {compile_time:.2f} s (context length {engine.context_length})")
    _check_fits(engine, requests)
    dtype = jax.numpy.dtype(engine.dtype).name
    matmul_n = args.peak_matmul_size or metrics.default_matmul_size()
    copy_mib = args.peak_copy_mib or metrics.default_copy_mib()
    if dtype not in peaks:
        peaks[dtype] = (metrics.matmul_peak_flops(engine.dtype, matmul_n),
                        metrics.copy_bandwidth(copy_mib))
    peak_flops, peak_bw = peaks[dtype]

    params = [SamplingParams(max_new_tokens=r.output_len, ignore_eos=args.ignore_eos,
                             temperature=0.0, **request) for r in requests]
    stats_before = engine.stats()
    bar = _progress(len(requests), label, args.disable_tqdm)
    try:
        timed = drive(engine, [r.prompt_ids for r in requests], params, offsets,
                      args.max_concurrency, bar.update if bar is not None else None)
    finally:
        if bar is not None:
            bar.close()
    stats_after = engine.stats()
    engine.check_invariants()  # every page and slot back in its pool after the workload

    result = figures(engine.model_config, jax.numpy.dtype(engine.dtype).itemsize, timed,
                     stats_before, stats_after, peak_flops, peak_bw,
                     details=args.output_details)
    result.update(
        mode="offline" if math.isinf(args.request_rate) and args.max_concurrency is None
        else "online",
        request_rate=args.request_rate, burstiness=args.burstiness,
        max_concurrency=args.max_concurrency, ignore_eos=args.ignore_eos,
        num_compiled_shapes=num_shapes, num_compiled_programs=num_programs,
        compile_time_s=compile_time,
        num_compilations_before=stats_before["num_compilations"],
        num_compilations_after=stats_after["num_compilations"],
        recompiled_during_run=stats_after["num_compilations"] > stats_before["num_compilations"],
        peak_matmul_size=matmul_n, peak_copy_mib=copy_mib, dtype=dtype,
        load_time_s=engine.load_time_s, engine_stats=stats_after, model=str(args.model),
        backend=jax.default_backend(), device=jax.devices()[0].device_kind,
        num_devices=jax.device_count(), host_cpu=metrics.host_cpu(), jax_version=jax.__version__,
        timestamp=time.time(),
        engine_config=dataclasses.asdict(config), request_fields=request, workload=_workload(args),
    )
    trace = _trace(timed)
    del engine  # free the KV pool before the next engine or the baseline
    gc.collect()
    return result, trace


def figures(model_cfg: Any, itemsize: int, timed: TimedRun, stats_before: dict[str, Any],
            stats_after: dict[str, Any], peak_flops: float, peak_bw: float,
            details: bool = False) -> dict[str, Any]:
    """Throughput, latency, engine, FLOP and bandwidth figures of one timed run."""
    done = timed.finished()
    outs = [o for o, _ in done]
    in_lens = [len(o.prompt_token_ids) for o in outs]
    out_lens = [len(o.token_ids) for o in outs]
    n_in, n_out = sum(in_lens), sum(out_lens)
    duration = max(timed.duration, 1e-9)
    lat = metrics.request_latencies(outs, [s for _, s in done])
    flops = metrics.model_flops(model_cfg, in_lens, out_lens, [o.cached_tokens for o in outs])
    fig: dict[str, Any] = {
        "completed": len(done), "failed": len(timed.outputs) - len(done),
        "num_requests": len(timed.outputs), "duration_s": timed.duration,
        "total_input_tokens": n_in, "total_output_tokens": n_out,
        "request_throughput": len(done) / duration, "input_throughput": n_in / duration,
        "output_throughput": n_out / duration, "total_throughput": (n_in + n_out) / duration,
        "concurrency": sum(lat["e2e"]) / duration,
        "model_flops": flops, "achieved_flops_per_s": flops / duration,
        "peak_flops_per_s": peak_flops, "mfu": flops / duration / peak_flops,
    }
    errors = [e for e in timed.errors if e]
    fig["first_error"] = errors[0] if errors else None
    for name, values in lat.items():
        for stat, value in metrics.summarize(values, scale=1e3).items():
            fig[f"{stat}_{name}_ms"] = value
    fig["max_itl_ms"] = 1e3 * max(lat["itl"], default=0.0)

    def delta(key: str) -> int:
        return stats_after.get(key, 0) - stats_before.get(key, 0)

    prompt = delta("prompt_tokens")
    computed, cached = delta("prefill_tokens_computed"), delta("cached_tokens")
    pool = stats_after.get("kv_pool_tokens", 0)
    peak_used = stats_after.get("peak_kv_tokens_used", 0)
    fig.update(
        prompt_tokens=prompt, prefill_tokens_computed=computed,
        cached_tokens=cached,
        cache_hit_rate=cached / (cached + computed) if cached + computed else 0.0,  # as stats()
        prefill_saved_fraction=1.0 - computed / prompt if prompt else 0.0,
        peak_kv_tokens_used=peak_used, kv_pool_tokens=pool,
        peak_kv_usage=peak_used / pool if pool else 0.0, num_retracted=delta("num_retracted"),
        evicted_tokens=delta("evicted_tokens"), chunked_steps=delta("chunked_steps"),
        # the engine is fresh for each run: these means are over this run's steps
        mean_token_usage=stats_after.get("mean_token_usage", 0.0),
        mean_token_usage_queued=stats_after.get("mean_token_usage_queued", 0.0),
        mean_host_ms_per_step=stats_after.get("mean_host_ms_per_step", 0.0),
        mean_blocked_ms_per_step=stats_after.get("mean_blocked_ms_per_step", 0.0),
        device_idle_fraction=stats_after.get("device_idle_fraction", 0.0),
    )

    steps = timed.steps
    decode = [s for s in steps if s.kind == "decode"]
    decode_time = sum(s.end - s.start for s in decode)
    w_bytes = metrics.weight_bytes(model_cfg, itemsize)
    kv_bytes = model_cfg.kv_bytes_per_token(itemsize) * sum(s.kv_tokens for s in decode)
    decode_bytes = len(decode) * w_bytes + kv_bytes
    bandwidth = decode_bytes / decode_time if decode_time > 0 else 0.0
    fig.update(
        num_steps=len(steps), prefill_steps=sum(s.kind == "prefill" for s in steps),
        decode_steps=len(decode), mixed_steps=sum(s.kind == "mixed" for s in steps),
        prefill_time_s=sum(s.end - s.start for s in steps if s.kind in ("prefill", "mixed")),
        decode_time_s=decode_time,
        mean_decode_step_ms=1e3 * decode_time / len(decode) if decode else 0.0,
        mean_decode_batch=sum(s.num_seqs for s in decode) / len(decode) if decode else 0.0,
        weight_bytes=w_bytes, decode_bytes_read=decode_bytes,
        decode_bandwidth_bytes_per_s=bandwidth, peak_copy_bytes_per_s=peak_bw,
        decode_bandwidth_utilisation=bandwidth / peak_bw if peak_bw else 0.0,
        host_time_outside_steps_s=max(0.0, timed.duration - sum(s.end - s.start for s in steps)),
    )
    if details:
        fig["details"] = {
            "input_lens": in_lens, "output_lens": out_lens,
            "sent_s": [s - timed.start for _, s in done],
            "ttft_s": [o.first_token_time - s if o.first_token_time is not None else None
                       for o, s in done],
            "e2e_s": [o.finish_time - s if o.finish_time is not None else None for o, s in done],
            "itl_s": [np.diff(o.token_times).tolist() for o in outs],
            "errors": timed.errors,
        }
    return fig


def _trace(timed: TimedRun) -> dict[str, Any]:
    """What the plot needs of a run: token times, TTFTs and E2E latencies, in seconds."""
    done = timed.finished()
    return {
        "token_times": np.array([t - timed.start for o, _ in done for t in o.token_times]),
        "ttft": [o.first_token_time - s for o, s in done if o.first_token_time is not None],
        "e2e": [o.finish_time - s for o, s in done if o.finish_time is not None],
        "duration": timed.duration,
    }
