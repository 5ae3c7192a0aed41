"""The figures of one timed run: the client-side serving figures every backend has (throughput,
TTFT / TPOT / ITL / E2E latencies, completed and failed requests), and for the in-process engine
its own (prefill and cache, KV pool, steps, speculative decoding, model FLOPs and MFU, decode
bandwidth).

A run is a :class:`~minijax_serve.bench.driver.TimedRun` (the engine) or a
:class:`~minijax_serve.bench.http_client.HttpRun` (a server over HTTP): both give ``start``,
``duration``, ``errors`` and ``finished()`` = (output, time sent) pairs whose outputs have
``first_token_time``, ``finish_time`` and ``token_times``. An engine output counts its own
tokens; over HTTP the token counts are the server's ``usage``, and ``token_times`` are the times
of the streamed chunks that carried output (one per token on a server that streams every token).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from minijax_serve.bench import metrics
from minijax_serve.bench.driver import TimedRun
from minijax_serve.bench.tree_dataset import ideal_prefill_tokens
from minijax_serve.engine.trace import StepRecord, to_columns


def _serving(run: Any, in_lens: Sequence[int], out_lens: Sequence[int], details: bool,
             percentiles: Sequence[float], slos: dict[str, float] | None) -> dict[str, Any]:
    """Throughput and latency figures of ``run`` whose finished requests had ``in_lens`` prompt
    and ``out_lens`` output tokens: each latency's mean, median, std and ``percentiles``, and
    with ``slos`` (:func:`~minijax_serve.bench.metrics.meets_slos`) the request goodput."""
    done = run.finished()
    outs = [o for o, _ in done]
    n_in, n_out = sum(in_lens), sum(out_lens)
    duration = max(run.duration, 1e-9)
    lat = metrics.request_latencies(outs, [s for _, s in done], out_lens)
    fig: dict[str, Any] = {
        "completed": len(done), "failed": len(run.errors) - len(done),
        "num_requests": len(run.errors), "duration_s": run.duration,
        "total_input_tokens": n_in, "total_output_tokens": n_out,
        "request_throughput": len(done) / duration, "input_throughput": n_in / duration,
        "output_throughput": n_out / duration, "total_throughput": (n_in + n_out) / duration,
        "concurrency": sum(lat["e2e"]) / duration,
    }
    errors = [e for e in run.errors if e]
    fig["first_error"] = errors[0] if errors else None
    for name, values in lat.items():
        for stat, value in metrics.summarize(values, 1e3, percentiles).items():
            fig[f"{stat}_{name}_ms"] = value
    if slos:
        met = metrics.meets_slos(outs, [s for _, s in done], out_lens, slos)
        fig.update(request_goodput=met / duration, slos_ms=dict(slos))
    fig["max_itl_ms"] = 1e3 * max(lat["itl"], default=0.0)
    if details:
        fig["details"] = {
            "input_lens": list(in_lens), "output_lens": list(out_lens),
            "sent_s": [s - run.start for _, s in done],
            "ttft_s": [o.first_token_time - s if o.first_token_time is not None else None
                       for o, s in done],
            "e2e_s": [o.finish_time - s if o.finish_time is not None else None for o, s in done],
            "itl_s": [np.diff(o.token_times).tolist() for o in outs],
            "errors": list(run.errors),
        }
    return fig


def http_figures(run: Any, details: bool = False, percentiles: Sequence[float] = (99.0,),
                 slos: dict[str, float] | None = None) -> dict[str, Any]:
    """Throughput and latency figures of an :class:`~minijax_serve.bench.http_client.HttpRun`,
    token counts from each request's ``usage``."""
    outs = [o for o, _ in run.finished()]
    return _serving(run, [o.prompt_tokens for o in outs], [o.output_tokens for o in outs],
                    details, percentiles, slos)


def figures(model_cfg: Any, itemsize: int, timed: TimedRun, stats_before: dict[str, Any],
            stats_after: dict[str, Any], peak_flops: float, peak_bw: float,
            details: bool = False, percentiles: Sequence[float] = (99.0,),
            slos: dict[str, float] | None = None, quantized: bool = False,
            kv_itemsize: int | None = None) -> dict[str, Any]:
    """Throughput, latency, engine, FLOP and bandwidth figures of one timed engine run
    (``quantized``: FP8 weights; ``kv_itemsize``: the KV cache's bytes an element, default
    ``itemsize``)."""
    outs = [o for o, _ in timed.finished()]
    in_lens = [len(o.prompt_token_ids) for o in outs]
    out_lens = [len(o.token_ids) for o in outs]
    fig = _serving(timed, in_lens, out_lens, details, percentiles, slos)
    duration = max(timed.duration, 1e-9)
    flops = metrics.model_flops(model_cfg, in_lens, out_lens, [o.cached_tokens for o in outs])
    fig.update(model_flops=flops, achieved_flops_per_s=flops / duration,
               peak_flops_per_s=peak_flops, mfu=flops / duration / peak_flops)

    def delta(key: str) -> int:
        return stats_after.get(key, 0) - stats_before.get(key, 0)

    prompt = delta("prompt_tokens")
    computed, cached = delta("prefill_tokens_computed"), delta("cached_tokens")
    ideal = ideal_prefill_tokens([o.prompt_token_ids for o in outs])
    pool = stats_after.get("kv_pool_tokens", 0)
    peak_used = stats_after.get("peak_kv_tokens_used", 0)
    fig.update(
        prompt_tokens=prompt, prefill_tokens_computed=computed,
        ideal_prefill_tokens=ideal, prefill_over_ideal=computed / ideal if ideal else 0.0,
        cached_tokens=cached,
        cache_hit_rate=cached / (cached + computed) if cached + computed else 0.0,  # as stats()
        prefill_saved_fraction=1.0 - computed / prompt if prompt else 0.0,
        peak_kv_tokens_used=peak_used, kv_pool_tokens=pool,
        peak_kv_usage=peak_used / pool if pool else 0.0, num_retracted=delta("num_retracted"),
        evicted_tokens=delta("evicted_tokens"), chunked_steps=delta("chunked_steps"),
        padding_fraction=(1 - delta("step_tokens") / delta("padded_step_tokens")
                          if delta("padded_step_tokens") else 0.0),
        # the engine is fresh for each run: these means are over this run's steps
        mean_token_usage=stats_after.get("mean_token_usage", 0.0),
        mean_token_usage_queued=stats_after.get("mean_token_usage_queued", 0.0),
        mean_host_ms_per_step=stats_after.get("mean_host_ms_per_step", 0.0),
        mean_blocked_ms_per_step=stats_after.get("mean_blocked_ms_per_step", 0.0),
        device_idle_fraction=stats_after.get("device_idle_fraction", 0.0),
    )
    proposed, accepted = delta("spec_proposed_tokens"), delta("spec_accepted_tokens")
    verified, decoded = delta("spec_verified_seqs"), delta("decode_seq_steps")
    fig.update(  # speculative decoding (engine.stats()'s definitions, over this run)
        spec_proposed_tokens=proposed, spec_accepted_tokens=accepted,
        spec_acceptance_rate=accepted / proposed if proposed else 0.0,
        spec_accept_length=(accepted + verified) / verified if verified else 0.0,
        tokens_per_step=delta("decode_output_tokens") / decoded if decoded else 0.0)

    steps = timed.steps
    decode = [s for s in steps if s.kind == "decode"]
    decode_time = sum(s.end - s.start for s in decode)
    w_bytes = metrics.weight_bytes(model_cfg, itemsize, quantized)
    kv_bytes = model_cfg.kv_bytes_per_token(kv_itemsize or itemsize) * sum(s.kv_tokens
                                                                          for s in decode)
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
    return fig


def trace(run: Any, steps: Sequence[StepRecord] = ()) -> dict[str, Any]:
    """What the plot needs of a run: token (or chunk) times, TTFTs and E2E latencies, in
    seconds, and with ``steps`` (the engine's step trace) their columns under ``"steps"``,
    ``start_s`` in seconds since the run's start."""
    done = run.finished()
    out = {
        "token_times": np.array([t - run.start for o, _ in done for t in o.token_times]),
        "ttft": [o.first_token_time - s for o, s in done if o.first_token_time is not None],
        "e2e": [o.finish_time - s for o, s in done if o.finish_time is not None],
        "duration": run.duration,
    }
    if steps:
        out["steps"] = to_columns(steps)
        out["steps"]["start_s"] = out["steps"]["start_s"] - run.start
    return out
