"""Offline throughput benchmark: every request submitted at once to ``Engine.generate``.

Order of a run: build the engine, compile every step shape (``Engine.warmup``), measure the matmul
peak, draw the dataset, then time ``generate`` over all prompts. Compilations must not grow during
the timed run; if they do, a warning is printed and ``recompiled_during_run`` is set.

With ``--baseline hf`` the exact same requests then run through HuggingFace transformers
(:mod:`minijax_serve.bench.hf_baseline`); its figures are printed in a second section, with the
engine/HF ratios of output and total token throughput, and stored under the JSON's ``baseline``.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import time
from typing import Any

import jax
import numpy as np

from minijax_serve.bench import metrics
from minijax_serve.bench.datasets import DATASETS, DatasetContext
from minijax_serve.config import EngineConfig

WIDTH = 60


def add_args(parser: argparse.ArgumentParser) -> None:
    """The benchmark's own flags and every registered dataset's flags."""
    parser.add_argument("--dataset", "--dataset-name", dest="dataset_name",
                        choices=sorted(DATASETS), default="random",
                        help="where the prompts and output lengths come from (default: random)")
    parser.add_argument("--num-prompts", type=int, default=64,
                        help="requests in the run (default: 64)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the dataset draw (also EngineConfig.seed; default: 0)")
    parser.add_argument("--output-json", metavar="FILE",
                        help="append the run's figures as one JSON object per line")
    parser.add_argument("--peak-matmul-size", type=int, default=None,
                        help="side of the square matmul timed as the FLOP/s peak "
                             "(default: 2048 on CPU, 8192 on accelerators)")
    parser.add_argument("--baseline", choices=("none", "hf"), default="none",
                        help="also run the same requests through a baseline: hf = HuggingFace "
                             "transformers generate, static left-padded batches (default: none)")
    parser.add_argument("--baseline-batch-size", type=int, default=16,
                        help="requests per static batch of the hf baseline (default: 16)")
    for dataset in DATASETS.values():
        dataset.add_args(parser)


def _workload(args: argparse.Namespace) -> dict[str, Any]:
    """The command-line arguments that are not EngineConfig fields."""
    engine_fields = {f.name for f in dataclasses.fields(EngineConfig)} - {"seed"}
    skip = engine_fields | {"func", "command", "output_json"}
    return {k: v for k, v in vars(args).items() if k not in skip}


def run(args: argparse.Namespace, config: EngineConfig) -> dict[str, Any]:
    """Run the benchmark, print its report, append it to ``--output-json``; returns the figures."""
    from minijax_serve import Engine, SamplingParams

    if args.num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {args.num_prompts}")
    baseline = getattr(args, "baseline", "none")
    if baseline == "hf" and args.baseline_batch_size < 1:
        raise ValueError(f"--baseline-batch-size must be >= 1, got {args.baseline_batch_size}")
    config.validate()
    requests, config = _draw_workload(args, config)
    engine = Engine(args.model, config)
    num_shapes = engine.warmup()
    compile_time = engine.stats()["compile_time_s"]
    print(f"Warm-up: compiled {num_shapes} step shapes in {compile_time:.2f} s "
          f"(context length {engine.context_length})")
    peak_n = args.peak_matmul_size or metrics.default_matmul_size()
    peak = metrics.matmul_peak_flops(engine.dtype, peak_n)

    prompts = [r.prompt_ids for r in requests]
    params = [SamplingParams(max_new_tokens=r.output_len, ignore_eos=True, temperature=0.0)
              for r in requests]

    compiles_before = engine.stats()["num_compilations"]
    start = time.perf_counter()
    outputs = engine.generate(prompts, params)
    duration = time.perf_counter() - start
    compiles_after = engine.stats()["num_compilations"]
    engine.check_invariants()  # every page and slot back in its pool after the workload

    result = _figures(engine, outputs, duration, peak)
    result.update(
        num_compiled_shapes=num_shapes, compile_time_s=compile_time,
        num_compilations_before=compiles_before, num_compilations_after=compiles_after,
        recompiled_during_run=compiles_after > compiles_before, peak_matmul_size=peak_n,
        load_time_s=engine.load_time_s, kv_pool_tokens=engine.kv_pool_tokens,
        engine_stats=engine.stats(), model=str(args.model), backend=jax.default_backend(),
        device=jax.devices()[0].device_kind, timestamp=time.time(),
        engine_config=dataclasses.asdict(config), workload=_workload(args),
    )
    if result["recompiled_during_run"]:
        print("!" * WIDTH)
        print(f"WARNING: {compiles_after - compiles_before} step shape(s) compiled DURING the "
              "timed run; its figures include compile time")
        print("!" * WIDTH)
    print(format_report(result))
    result["baseline"] = None
    if baseline == "hf":
        from minijax_serve.bench import hf_baseline

        dtype = jax.numpy.dtype(engine.dtype).name
        del engine, outputs  # free the engine's KV pool before HF loads its own copy
        gc.collect()
        base = hf_baseline.run_hf_baseline(args.model, [(list(r.prompt_ids), r.output_len)
                                                         for r in requests],
                                           args.baseline_batch_size, dtype)
        base["output_throughput_ratio"] = result["output_throughput"] / base["output_throughput"]
        base["total_throughput_ratio"] = result["total_throughput"] / base["total_throughput"]
        result["baseline"] = base
        print(format_baseline(base))
    if args.output_json:
        with open(args.output_json, "a") as f:
            f.write(json.dumps(result) + "\n")
    return result


def _draw_workload(args: argparse.Namespace, config: EngineConfig):
    """Draw the requests from the model's config and tokenizer, before the engine exists.

    Without ``--context-length``, the engine's context is sized to the workload (the next power
    of two above its longest request, capped by the model's): the step shapes ``warmup`` compiles
    then cover what the run can produce, not the model's whole context.
    """
    from minijax_serve.engine import load_tokenizer
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


def _figures(engine: Any, outputs: list, duration: float, peak: float) -> dict[str, Any]:
    """Throughput, latency and FLOP figures of the timed run."""
    done = [o for o in outputs if o.finished]
    in_lens = [len(o.prompt_token_ids) for o in done]
    out_lens = [len(o.token_ids) for o in done]
    n_in, n_out = sum(in_lens), sum(out_lens)
    flops = metrics.model_flops(engine.model_config, in_lens, out_lens)
    fig: dict[str, Any] = {
        "completed": len(done), "num_requests": len(outputs), "duration_s": duration,
        "total_input_tokens": n_in, "total_output_tokens": n_out,
        "request_throughput": len(done) / duration, "input_throughput": n_in / duration,
        "output_throughput": n_out / duration, "total_throughput": (n_in + n_out) / duration,
        "model_flops": flops, "achieved_flops_per_s": flops / duration,
        "peak_flops_per_s": peak, "mfu": flops / duration / peak,
    }
    for name, values in metrics.request_latencies(done).items():
        for stat, value in metrics.summarize(values, scale=1e3).items():
            fig[f"{stat}_{name}_ms"] = value
    return fig


def _line(name: str, value: Any) -> str:
    text = f"{value:.2f}" if isinstance(value, float) else str(value)
    return f"{name + ':':<{WIDTH - 16}}{text:>16}"


def _render(title: str, rows: list[tuple[str, Any]]) -> str:
    """A titled section: ``name: value`` lines; a row whose value is None is a sub-heading."""
    lines = [f" {title} ".center(WIDTH, "=")]
    for name, value in rows:
        lines.append(f" {name} ".center(WIDTH, "-") if value is None else _line(name, value))
    lines.append("=" * WIDTH)
    return "\n".join(lines)


def format_report(r: dict[str, Any]) -> str:
    """SGLang-style report: aligned ``name: value`` lines between ``=`` rules."""
    rows = [
        ("Backend", f"minijax ({r['backend']})"), ("Successful requests", r["completed"]),
        ("Benchmark duration (s)", r["duration_s"]),
        ("Total input tokens", r["total_input_tokens"]),
        ("Total generated tokens", r["total_output_tokens"]),
        ("Request throughput (req/s)", r["request_throughput"]),
        ("Input token throughput (tok/s)", r["input_throughput"]),
        ("Output token throughput (tok/s)", r["output_throughput"]),
        ("Total token throughput (tok/s)", r["total_throughput"]),
    ]
    for title, key in (("Time to First Token", "ttft"), ("End-to-End Latency", "e2e"),
                       ("Time per Output Token (excl. 1st token)", "tpot")):
        rows.append((title, None))
        rows += [(f"{s.capitalize()} {key.upper()} (ms)", r[f"{s}_{key}_ms"])
                 for s in ("mean", "median", "p99")]
    rows += [
        ("Compilation", None), ("Compiled step shapes", r["num_compiled_shapes"]),
        ("Compile time (s)", r["compile_time_s"]),
        ("Compiled during timed run", r["num_compilations_after"] - r["num_compilations_before"]),
        ("Model FLOP utilisation", None),
        ("Model FLOPs (TFLOP)", f"{r['model_flops'] / 1e12:.4g}"),
        ("Achieved (TFLOP/s)", f"{r['achieved_flops_per_s'] / 1e12:.4g}"),
        (f"Peak, {r['peak_matmul_size']}² matmul (TFLOP/s)", f"{r['peak_flops_per_s'] / 1e12:.4g}"),
        ("MFU (%)", f"{100 * r['mfu']:.3g}"),
    ]
    return _render("Offline Throughput Benchmark Result", rows)


def format_baseline(b: dict[str, Any]) -> str:
    """The baseline's section: its figures, then the engine/baseline throughput ratios."""
    rows = [
        ("Backend", f"hf transformers ({b['device']})"), ("Successful requests", b["completed"]),
        ("Static batch size", b["batch_size"]), ("Batches", b["num_batches"]),
        ("Benchmark duration (s)", b["duration_s"]),
        ("Total input tokens", b["total_input_tokens"]),
        ("Total generated tokens", b["total_output_tokens"]),
        ("Generated incl. batch padding", b["generated_tokens_incl_padding"]),
        ("Request throughput (req/s)", b["request_throughput"]),
        ("Input token throughput (tok/s)", b["input_throughput"]),
        ("Output token throughput (tok/s)", b["output_throughput"]),
        ("Total token throughput (tok/s)", b["total_throughput"]),
        ("Engine / baseline", None),
        ("Output token throughput ratio", f"{b['output_throughput_ratio']:.2f}x"),
        ("Total token throughput ratio", f"{b['total_throughput_ratio']:.2f}x"),
    ]
    return _render("HF transformers Baseline (same requests)", rows)
