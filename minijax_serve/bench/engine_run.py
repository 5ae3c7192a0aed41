"""One timed run of an in-process engine: build it, compile every step shape, measure the
hardware ceilings, drive the workload through it and gather its figures.

A simulated engine (``--simulate PROFILE``) compiles and measures nothing: its ceilings are the
profile's, and the driver runs on the engine's virtual clock, so every time in its figures is
simulated device time plus the real host time of the scheduler.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import math
import time
from typing import Any, Sequence

import jax
import numpy as np

from minijax_serve.attention.kv_cache import kv_dtype
from minijax_serve.bench import metrics
from minijax_serve.bench.args import workload
from minijax_serve.bench.datasets import BenchRequest
from minijax_serve.bench.driver import drive
from minijax_serve.bench.figures import figures, trace
from minijax_serve.bench.report import progress
from minijax_serve.config import EngineConfig
from minijax_serve.core.sampling_params import SamplingParams
from minijax_serve.engine import trace as trace_file
from minijax_serve.executor import ceilings


def fp8_weights(engine: Any, config: EngineConfig) -> bool:
    """Whether the layers' weights are served in FP8 (a byte each, for the decode bandwidth):
    quantized at load (``quantization``) or read so from an FP8 checkpoint, which an engine
    serves with ``quantization=None``. A simulated engine holds no weights: its config says."""
    params = getattr(engine.runner, "params", None)
    if not params:
        return config.quantization is not None
    return any(p.dtype.itemsize == 1 for p in params)


def check_fits(engine: Any, requests: Sequence[BenchRequest]) -> None:
    """Fail before timing if a request cannot run on this engine at all."""
    for i, r in enumerate(requests):
        total = len(r.prompt_ids) + r.output_len
        for limit, name, hint in ((engine.context_length, "context length", "--context-length"),
                                  (engine.kv_pool_tokens, "KV pool", "--max-total-tokens")):
            if total > limit:
                raise ValueError(f"request {i}: prompt ({len(r.prompt_ids)}) + output "
                                 f"({r.output_len}) = {total} tokens exceed the {name} ({limit} "
                                 f"tokens); raise {hint} or shorten the workload")


def _ceilings(args: argparse.Namespace, engine: Any,
              peaks: dict[str, tuple[float, float]]) -> tuple[float, float, dict[str, Any]]:
    """(matmul FLOP/s, copy bytes/s, their labels for the figures): measured once per dtype, or
    a simulated device's profile."""
    profile = engine.profile
    if profile is not None:
        return (profile.flops(engine.dtype), profile.memory_bw,
                dict(peak_matmul_size=None, peak_copy_mib=None))
    dtype = jax.numpy.dtype(engine.dtype).name
    matmul_n = args.peak_matmul_size or ceilings.default_matmul_size()
    copy_mib = args.peak_copy_mib or ceilings.default_copy_mib()
    if dtype not in peaks:
        peaks[dtype] = (ceilings.matmul_peak_flops(engine.dtype, matmul_n),
                        ceilings.copy_bandwidth(copy_mib))
    return (*peaks[dtype], dict(peak_matmul_size=matmul_n, peak_copy_mib=copy_mib))


def run_engine(args: argparse.Namespace, config: EngineConfig, request: dict[str, Any],
               requests: list[BenchRequest], offsets: np.ndarray,
               peaks: dict[str, tuple[float, float]], label: str,
               tokenizer: Any = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """Build, warm up and time one engine on the workload, every request with the ``request``
    fields (logprobs, penalties); ``tokenizer`` replaces the model's own (``--tokenizer``).
    Returns (figures, plot trace)."""
    from minijax_serve.engine import Engine

    record = config.record_steps or bool(args.trace or args.plot)
    engine = Engine(args.model, dataclasses.replace(config, record_steps=record),
                    tokenizer=tokenizer)
    features = SamplingParams(**request)
    num_programs = engine.warmup(grammars=features.grammar is not None)
    engine.check_grammar(features)  # if any: llguidance's tokenizer and the grammar, not timed
    num_shapes = len(engine.buckets.all_shapes())
    compile_time = engine.stats()["compile_time_s"]
    if engine.profile is None:
        print(f"Warm-up: compiled {num_shapes} step shapes ({num_programs} programs with their "
              f"samplers) in {compile_time:.2f} s (context length {engine.context_length})")
    else:
        print(f"Simulated {engine.profile.name} x {config.tensor_parallel_size}: no model, "
              f"KV pool of {engine.kv_pool_tokens} tokens (context length "
              f"{engine.context_length}); times below are virtual")
    check_fits(engine, requests)
    peak_flops, peak_bw, ceiling_labels = _ceilings(args, engine, peaks)

    params = [SamplingParams(max_new_tokens=r.output_len, ignore_eos=args.ignore_eos,
                             temperature=0.0, **request) for r in requests]
    stats_before = engine.stats()
    bar = progress(len(requests), label, args.disable_tqdm)
    try:
        timed = drive(engine, [r.prompt_ids for r in requests], params, offsets,
                      args.max_concurrency, bar.update if bar is not None else None,
                      clock=engine.clock.now, sleep=engine.clock.sleep)
    finally:
        if bar is not None:
            bar.close()
    stats_after = engine.stats()
    engine.check_invariants()  # every page and slot back in its pool after the workload
    if args.trace:
        trace_file.append_jsonl(args.trace, engine.step_records(), run=label)

    result = figures(engine.model_config, jax.numpy.dtype(engine.dtype).itemsize, timed,
                     stats_before, stats_after, peak_flops, peak_bw,
                     args.output_details, args.metric_percentiles, dict(args.goodput or {}),
                     fp8_weights(engine, config),
                     kv_dtype(config.kv_cache_dtype, engine.dtype).itemsize)
    profile = engine.profile
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
        **ceiling_labels, dtype=jax.numpy.dtype(engine.dtype).name,
        load_time_s=engine.load_time_s, engine_stats=stats_after, model=str(args.model),
        backend=jax.default_backend(),
        device=jax.devices()[0].device_kind if profile is None else f"simulated {profile.name}",
        num_devices=jax.device_count() if profile is None else engine.num_devices,
        simulate=None if profile is None else profile.name,
        simulated_device_busy_s=None if profile is None else engine.runner.device_time_s,
        host_cpu=metrics.host_cpu(), jax_version=jax.__version__, timestamp=time.time(),
        engine_config=dataclasses.asdict(config), request_fields=request, workload=workload(args),
        resolved_engine_config=dataclasses.asdict(engine.config),  # the limits it sized
    )
    run_trace = trace(timed, engine.step_records())
    del engine  # free the KV pool before the next engine or the baseline
    gc.collect()
    return result, run_trace
