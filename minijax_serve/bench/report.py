"""What the bench writes: SGLang-style aligned ``name: value`` reports, the JSON lines of
``--output-json`` and the progress bar."""

from __future__ import annotations

import json
import math
import sys
from typing import Any

import numpy as np

from minijax_serve.bench import metrics

WIDTH = 60
LATENCIES = (("Time to First Token", "ttft"), ("Time per Output Token (excl. 1st token)", "tpot"),
             ("Inter-Token Latency", "itl"), ("End-to-End Latency", "e2e"))


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


def _gb(value: float) -> str:
    return f"{value / 1e9:.4g}"


def run_label(r: dict[str, Any]) -> str:
    """A run's name in the reports: its --compare value, else its backend."""
    c = r["compare"]
    if c is not None:
        return f"{c['field']}={c['value']}"
    return "openai" if r.get("backend") == "openai" else "minijax"


def format_report(r: dict[str, Any]) -> str:
    """SGLang-style report: aligned ``name: value`` lines between ``=`` rules. A server's run
    (``--backend openai``) has the client-side figures only."""
    offline = r["mode"] == "offline"
    server = r["backend"] == "openai"
    rows = [
        ("Backend", f"openai ({r['base_url']}, {r['endpoint']})" if server
         else f"minijax (simulated {r['simulate']} x {r['num_devices']}; virtual time)"
         if r.get("simulate") else f"minijax ({r['backend']})"),
        *([("Served model", r["served_model_name"])] if server else []),
        ("Client host CPU" if server else "Host CPU", r["host_cpu"]),
        ("Traffic request rate", "inf" if math.isinf(r["request_rate"]) else r["request_rate"]),
        ("Max request concurrency", r["max_concurrency"] or "not set"),
    ]
    defaults = {"logprobs": None, "repetition_penalty": 1.0, "frequency_penalty": 0.0,
                "presence_penalty": 0.0}
    features = [f"{k}={v}" for k, v in r.get("request_fields", {}).items() if v != defaults.get(k)]
    rows += [("Request features", ", ".join(features) or "none"),
             ("Successful requests", r["completed"])]
    if r["failed"]:
        rows += [("Failed requests", r["failed"]), ("First error", r["first_error"])]
    rows += [
        ("Benchmark duration (s)", r["duration_s"]),
        ("Total input tokens", r["total_input_tokens"]),
        ("Total generated tokens", r["total_output_tokens"]),
        ("Request throughput (req/s)", r["request_throughput"]),
        ("Input token throughput (tok/s)", r["input_throughput"]),
        ("Output token throughput (tok/s)", r["output_throughput"]),
        ("Total token throughput (tok/s)", r["total_throughput"]),
        ("Concurrency", r["concurrency"]),
    ]
    if "request_goodput" in r:
        slos = ", ".join(f"{k} <= {v:g} ms" for k, v in r["slos_ms"].items())
        rows.append((f"Request goodput (req/s; {slos})", r["request_goodput"]))
    percentiles = r.get("workload", {}).get("metric_percentiles", (99,))
    for title, key in LATENCIES:
        rows.append((title, None))
        rows += [(f"{s.capitalize()} {key.upper()} (ms)", r[f"{s}_{key}_ms"])
                 for s in ("mean", "median", *map(metrics.percentile_name, percentiles))]
    if not server:
        rows += _engine_rows(r)
    title = "Offline Throughput Benchmark Result" if offline else "Serving Benchmark Result"
    return _render(title, rows)


def _engine_rows(r: dict[str, Any]) -> list[tuple[str, Any]]:
    """The in-process engine's own figures: cache, KV pool, steps, compilation, MFU,
    bandwidth."""
    pool = r["kv_pool_tokens"]
    sim = r.get("simulate")  # the ceilings are then the profile's, not measured
    matmul = f"{sim} profile" if sim else f"{r['peak_matmul_size']}² matmul"
    copy = f"{sim} profile" if sim else f"{r['peak_copy_mib']} MiB copy"
    return [
        ("Engine", None),
        ("Prompt tokens", r["prompt_tokens"]),
        ("Prefill tokens computed", r["prefill_tokens_computed"]),
        ("  over the ideal (trie nodes + 1 per prompt)", f"{r['prefill_over_ideal']:.3f}"),
        ("Cached prompt tokens", r["cached_tokens"]),
        ("Prefill saved by the cache (%)", f"{100 * r['prefill_saved_fraction']:.1f}"),
        ("Peak KV tokens used / pool", f"{r['peak_kv_tokens_used']} / {pool}"),
        ("Peak KV pool usage (%)", f"{100 * r['peak_kv_usage']:.1f}"),
        ("Mean KV pool usage over steps (%)", f"{100 * r['mean_token_usage']:.1f}"),
        ("  over steps with requests waiting (%)", f"{100 * r['mean_token_usage_queued']:.1f}"),
        ("Evicted cached tokens", r["evicted_tokens"]),
        ("Retracted requests", r["num_retracted"]),
        ("Steps: prefill / decode / mixed",
         f"{r['prefill_steps']} / {r['decode_steps']} / {r['mixed_steps']}"),
        ("Steps carrying a prompt chunk", r["chunked_steps"]),
        ("Padding (% of the tokens computed)", f"{100 * r.get('padding_fraction', 0.0):.1f}"),
        *_speculative_rows(r),
        ("Host time per step (ms)", r["mean_host_ms_per_step"]),
        ("Host blocked on the device per step (ms)", r["mean_blocked_ms_per_step"]),
        ("Device idle, upper bound (%)", f"{100 * r['device_idle_fraction']:.1f}"),
        *([("Simulated device busy (s)", r["simulated_device_busy_s"])]
          if r.get("simulate") else []),
        ("Compilation", None), ("Compiled step shapes", r["num_compiled_shapes"]),
        ("Compile time (s)", r["compile_time_s"]),
        ("Compiled during timed run", r["num_compilations_after"] - r["num_compilations_before"]),
        ("Model FLOP utilisation", None),
        ("Model FLOPs (TFLOP)", f"{r['model_flops'] / 1e12:.4g}"),
        ("Achieved (TFLOP/s)", f"{r['achieved_flops_per_s'] / 1e12:.4g}"),
        (f"Peak, {matmul} (TFLOP/s)", f"{r['peak_flops_per_s'] / 1e12:.4g}"),
        ("MFU (%)", f"{100 * r['mfu']:.3g}"),
        ("Decode memory bandwidth", None),
        ("Mean decode step (ms)", r["mean_decode_step_ms"]),
        ("Mean decode batch (requests)", r["mean_decode_batch"]),
        ("Weights read per step (GB)", _gb(r["weight_bytes"])),
        ("Achieved, weights + KV (GB/s)", _gb(r["decode_bandwidth_bytes_per_s"])),
        (f"Peak, {copy} (GB/s)", _gb(r["peak_copy_bytes_per_s"])),
        ("Bandwidth utilisation (%)", f"{100 * r['decode_bandwidth_utilisation']:.3g}"),
    ]


def _speculative_rows(r: dict[str, Any]) -> list[tuple[str, Any]]:
    """Speculative decoding's figures, for an engine that speculates."""
    config = r.get("engine_config") or {}
    method = config.get("speculative_method")
    if method is None:
        return [("Output tokens per decode step", f"{r.get('tokens_per_step', 0.0):.3f}")]
    return [
        ("Speculative decoding", f"{method}, {config['num_speculative_tokens']} tokens"),
        ("  drafts proposed / accepted",
         f"{r['spec_proposed_tokens']} / {r['spec_accepted_tokens']}"),
        ("  acceptance rate (%)", f"{100 * r['spec_acceptance_rate']:.1f}"),
        ("  mean accepted length (tokens per verify)", f"{r['spec_accept_length']:.3f}"),
        ("Output tokens per decode step", f"{r['tokens_per_step']:.3f}"),
    ]


def format_baseline(b: dict[str, Any], versus: str = "Engine") -> str:
    """The baseline's section: its figures, then the engine's (or ``versus``'s) / baseline
    throughput ratios."""
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
        (f"{versus} / baseline", None),
        ("Output token throughput ratio", f"{b['output_throughput_ratio']:.2f}x"),
        ("Total token throughput ratio", f"{b['total_throughput_ratio']:.2f}x"),
    ]
    return _render("HF transformers Baseline (same requests)", rows)


def format_repeats(results: list[dict[str, Any]]) -> str:
    """Each configuration's output throughput in every repeat (and the baseline's, and the
    ratio within each repeat), then the median: ``a, b, c -> median``."""
    labels: dict[str, list[dict[str, Any]]] = {}
    for r in results:
        labels.setdefault(run_label(r), []).append(r)

    def line(name: str, values: list[float], fmt: str) -> str:
        cells = ", ".join(format(v, fmt) for v in values)
        return f"{name}: {cells} -> median {format(float(np.median(values)), fmt)}"

    lines = [f" Repeats ({results[0]['repeats']}): output tok/s ".center(WIDTH, "=")]
    for label, runs in labels.items():
        lines.append(line(label, [r["output_throughput"] for r in runs], ".2f"))
    first = next(iter(labels.values()))  # one run per repeat, each with that repeat's baseline
    if first[0]["baseline"] is not None:
        lines.append(line("hf transformers", [r["baseline"]["output_throughput"] for r in first],
                          ".2f"))
        for label, runs in labels.items():
            lines.append(line(f"{label} / hf", [r["baseline"]["output_throughput_ratio"]
                                                 for r in runs], ".3f"))
    lines.append("=" * WIDTH)
    return "\n".join(lines)


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


def progress(total: int, label: str, disabled: bool):
    """A tqdm bar on completed requests (None when disabled, stdout is no terminal, or no tqdm)."""
    if disabled or not sys.stdout.isatty():
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=label, unit="req", dynamic_ncols=True)
