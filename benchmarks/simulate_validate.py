"""The simulated accelerator against what was measured, its calibration, and its own speed.

    python benchmarks/simulate_validate.py --calibrate-h200  # the H200 dispatch cost's arithmetic
    python benchmarks/simulate_validate.py --calibrate       # fit this device's profile (min)
    python benchmarks/simulate_validate.py --h200            # simulated vs the H200 runs (s)
    python benchmarks/simulate_validate.py --cpu             # simulated vs real, this CPU (min)
    python benchmarks/simulate_validate.py --speed           # 10,000 ShareGPT, llama-3-8b, H200

* ``--calibrate-h200`` prints the arithmetic of the H200 profile's dispatch cost: the host time
  per tick of the device_idle run (RESULTS.md, "Overlap scheduling on a GPU") less the simulated
  scheduler's own on the same workload here (the rest of the H200 profile is fitted to a real
  run's trace: ``benchmarks/simulate_trace.py``).
* ``--calibrate`` runs real steps of ``--model`` (SmolLM2's shape by default; gpu_check.sh passes
  ``qwen3-0.6b``; dummy weights: a step's time does not depend on them) on this device, overlap
  off, on a workload of its own (96 random prompts of 16-512 tokens, 8-160 output tokens, seed
  7), timing each step: on a CPU in the run, from its dispatch to its tokens (host and device
  share the cores: a step alone runs faster than in a run), elsewhere replayed ``--replays``
  times back to back after the run (the device's own time, launches included, as
  benchmarks/device_idle.py does); then fits the profile's efficiencies and launch cost (least
  squares on log time) against the ceilings measured in the same process; the dispatch cost is
  the median host time of a step's dispatch. Prints the fit (for ``simulate/profiles.py``;
  ``gpu_check.sh`` section ``simcal``).
* ``--h200``: ``bench --simulate h200`` on the workloads of the end-to-end H200 runs
  (``gpu_check.sh``: the bench section and the overlap section, run 2 of 2026-11-29), next to
  what those runs measured (copied from RESULTS.md; not used in the calibration).
* ``--cpu``: on this machine, the real engine then the simulated one (``--simulate cpu``), same
  process, on the engine-core bench (the default ``minijax-serve bench`` workload) and the
  ShareGPT bench (32 prompts, context 512): predicted against measured duration, throughput
  and mean decode step.
* ``--speed``: 10,000 ShareGPT requests (SmolLM2's tokenizer) on llama-3-8b's shape, simulated
  H200, offline; the wall time of the run and the host time per tick at the largest batch.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

# RESULTS.md, "GPU: first runs on an H200", run 2 (commit 5c8f7a4): measured, for validation
H200_MEASURED = {
    "bench": dict(output_throughput=11995, total_throughput=23595, median_ttft_ms=184,
                  median_tpot_ms=6.99, mean_decode_step_ms=5.61),
    "overlap on": dict(output_throughput=9462, duration_s=2.63),
    "overlap off": dict(output_throughput=6859, duration_s=3.63),
}
# gpu_check.sh's BENCH_ARGS and OVERLAP_ARGS (qwen3-0.6b, bfloat16)
H200_BENCH = ["--model", "qwen3-0.6b", "--dtype", "bfloat16", "--num-prompts", "128",
              "--random-input-len", "1024", "--random-output-len", "1024",
              "--random-range-ratio", "0.098", "--max-running-requests", "128",
              "--max-total-tokens", "262144", "--max-prefill-tokens", "4096",
              "--min-token-bucket", "1024", "--min-seq-bucket", "64"]
H200_OVERLAP = ["--model", "qwen3-0.6b", "--dtype", "bfloat16", "--num-prompts", "256",
                "--random-input-len", "32", "--random-output-len", "128",
                "--random-range-ratio", "0.5", "--max-running-requests", "64",
                "--max-total-tokens", "65536", "--max-prefill-tokens", "2048",
                "--min-token-bucket", "2048", "--min-seq-bucket", "64",
                "--compare", "enable_overlap=True,False"]
CPU_WORKLOADS = {
    "engine-core bench (64 random prompts)": [],
    "ShareGPT bench (32 prompts, context 512)": ["--dataset", "sharegpt", "--num-prompts", "32",
                                                 "--context-length", "512"],
}
FIGURES = ("duration_s", "output_throughput", "mean_decode_step_ms", "median_ttft_ms",
           "median_tpot_ms")


def bench(argv: list[str]) -> list[dict]:
    """Run ``minijax-serve bench`` in this process; its JSON rows."""
    from minijax_serve.cli import main

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.jsonl"
        if main(["bench", *argv, "--disable-tqdm", "--output-json", str(out)]) != 0:
            raise SystemExit(f"bench failed: {argv}")
        return [json.loads(line) for line in out.read_text().splitlines()]


def compare(title: str, predicted: dict, measured: dict) -> None:
    print(f"\n{title}\n  {'figure':<22}{'predicted':>12}{'measured':>12}{'error':>9}")
    for key, value in measured.items():
        p = predicted[key]
        print(f"  {key:<22}{p:>12.4g}{value:>12.4g}{100 * (p / value - 1):>+8.1f}%")


def calibrate_h200() -> None:
    host = _device_idle_host_ms()
    print(f"device_idle's workload simulated (no dispatch cost): host {host:.2f} ms per tick "
          f"here; measured on the H200's host 1.51 ms; dispatch cost = {1.51 - host:.2f} ms "
          "(the profile's other numbers: benchmarks/simulate_trace.py --fit)")


def _device_idle_host_ms(batch: int = 64, input_len: int = 32, warm: int = 20,
                         steps: int = 200) -> float:
    """benchmarks/device_idle.py's workload and engine settings on a simulated H200 without a
    dispatch cost: the scheduler's own host time per decode tick, overlap on."""
    from minijax_serve import Engine, SamplingParams
    from minijax_serve.simulate import profiles

    max_new = warm + 2 * steps + 16
    context = input_len + max_new
    real = profiles.H200
    profiles.H200 = dataclasses.replace(real, dispatch_s=0.0)
    try:
        engine = Engine("qwen3-0.6b", simulate="h200", skip_tokenizer_init=True,
                        max_running_requests=batch, min_seq_bucket=batch,
                        max_prefill_tokens=batch * input_len, min_token_bucket=batch * input_len,
                        chunked_prefill_size=-1, context_length=context,
                        max_total_tokens=batch * (context + 16))
    finally:
        profiles.H200 = real
    rng = np.random.default_rng(0)
    for _ in range(batch):
        engine.add_request(rng.integers(0, 151936, input_len).tolist(),
                           SamplingParams(max_new_tokens=max_new, ignore_eos=True))
    while engine.stats()["decode_steps"] < warm:
        engine.step()
    before = engine.stats()["host_time_s"]
    for _ in range(steps):
        engine.step()
    return 1e3 * (engine.stats()["host_time_s"] - before) / steps


def calibrate(model: str, dtype: str, replays: int, output_json: str | None) -> None:
    """Fit a profile's efficiencies, launch and dispatch costs to real steps on this device."""
    import jax
    from minijax_serve import Engine, SamplingParams
    from minijax_serve.simulate.calibration import StepSet, TimedSteps, fit_profile, predicted_times
    from minijax_serve.simulate.cost_model import step_load
    from minijax_serve.simulate.profiles import cpu_profile, measured_profile

    from minijax_serve.models.config import load_model_config
    from minijax_serve.models.registry import resolve_model

    context = min(2048, load_model_config(resolve_model(model).path).max_position_embeddings)
    engine = Engine(model, enable_overlap=False, dtype=dtype, load_format="dummy",
                    skip_tokenizer_init=True, max_total_tokens=65536, context_length=context,
                    min_token_bucket=128)
    engine.warmup()
    steps, dispatch, in_run = [], [], []
    run = engine.runner.run

    def recorded(fb, shape, *rest):
        start = time.perf_counter()
        out = run(fb, shape, *rest)
        dispatch.append(time.perf_counter() - start)
        if not replays:
            jax.block_until_ready(out.tokens)
            in_run.append(time.perf_counter() - start)
        steps.append((fb, shape))
        return out

    engine.runner.run = recorded
    rng = np.random.default_rng(7)
    lens = rng.integers(16, min(512, context // 2), 96)  # (a tiny model's context is short)
    outs = rng.integers(8, min(160, context // 4), 96)
    vocab = engine.model_config.vocab_size
    engine.generate([rng.integers(0, vocab, n).tolist() for n in lens],
                    [SamplingParams(max_new_tokens=int(m), ignore_eos=True) for m in outs])
    device = in_run  # replayed back to back: the device's own time, launches included
    for fb, shape in steps if replays else ():  # (they rewrite KV: the engine is done)
        jax.block_until_ready(run(fb, shape).tokens)
        start = time.perf_counter()
        for _ in range(replays):
            out = run(fb, shape)
        jax.block_until_ready(out.tokens)
        device.append((time.perf_counter() - start) / replays)
    base = cpu_profile() if jax.default_backend() == "cpu" else measured_profile(engine.dtype)
    names = ("matmul_eff", "memory_eff", "attention_flops_eff", "attention_bw_eff", "launch_s")
    start = dataclasses.replace(base, **dict(zip(names, (1.0, 1.0, 0.1, 0.1, 1e-3))))
    loads = [step_load(shape.num_tokens, np.diff(fb.cu_q_lens), fb.kv_lens, shape.num_seqs)
             for fb, shape in steps]
    measured = np.array(device)
    timed = TimedSteps(loads, measured, [str(i) for i in range(len(loads))])  # each its own
    fitted = fit_profile(start, [StepSet(engine.model_config, engine.dtype, timed)], names)["run"]
    err = np.abs(predicted_times(fitted, engine.model_config, engine.dtype, loads) / measured - 1)
    result = {"model": model, "dtype": jax.numpy.dtype(engine.dtype).name,
              "device": jax.devices()[0].device_kind, "steps": len(steps), "replays": replays,
              "matmul_flops": base.flops(engine.dtype), "memory_bw": base.memory_bw,
              **{n: getattr(fitted, n) for n in names},
              "dispatch_s": float(f"{np.median(dispatch):.4g}"),
              "median_error": float(np.median(err)), "p90_error": float(np.percentile(err, 90))}
    print(json.dumps(result, indent=1))
    if output_json:
        with open(output_json, "a") as f:
            f.write(json.dumps(result) + "\n")


def h200() -> None:
    bench_run, = bench([*H200_BENCH, "--simulate", "h200"])
    compare("bench section (128 requests, in/out 100-1024), simulated h200 vs run 2",
            bench_run, H200_MEASURED["bench"])
    on, off = bench([*H200_OVERLAP, "--simulate", "h200"])
    compare("overlap section, on", on, H200_MEASURED["overlap on"])
    compare("overlap section, off", off, H200_MEASURED["overlap off"])
    for r in (bench_run, on, off):
        print(f"  host ms per step here: {r['mean_host_ms_per_step']:.2f}")


def cpu() -> None:
    for title, argv in CPU_WORKLOADS.items():
        real, = bench(argv)
        sim, = bench([*argv, "--simulate", "cpu"])
        compare(f"{title}: simulated cpu vs real, this machine", sim,
                {k: real[k] for k in FIGURES})


def speed() -> None:
    from minijax_serve.models.registry import resolve_model
    from minijax_serve.simulate.profiles import H200

    tokenizer = str(resolve_model("smollm2-135m").path)
    argv = ["--model", "llama-3-8b", "--simulate", "h200", "--tokenizer", tokenizer,
            "--dataset", "sharegpt", "--num-prompts", "10000", "--max-running-requests", "256",
            "--record-steps"]
    from minijax_serve.bench import runner

    drawn = {}
    draw = runner._draw_workload

    def timed_draw(*a):
        start = time.perf_counter()
        out = draw(*a)
        drawn["s"] = time.perf_counter() - start
        return out

    runner._draw_workload = timed_draw
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.jsonl"
        start = time.perf_counter()
        r, = bench([*argv, "--trace", str(trace)])
        wall = time.perf_counter() - start
        rows = [json.loads(line) for line in trace.read_text().splitlines()]
    decode = [x for x in rows if x["kind"] == "decode"]
    widest = max(x["decode_reqs"] for x in decode)
    host = [x["host_ms"] for x in decode if x["decode_reqs"] == widest]
    print(f"\n10,000 ShareGPT requests, llama-3-8b on a simulated H200: {wall:.1f} s wall "
          f"({drawn['s']:.1f} s of it drawing and tokenizing the workload), "
          f"{len(rows)} steps, {r['duration_s']:.1f} s simulated, "
          f"{r['output_throughput']:.0f} output tok/s simulated")
    dispatch = 1e3 * H200.dispatch_s
    print(f"host ms per tick at the largest batch ({widest} requests, {len(host)} ticks), the "
          f"scheduler's measured time plus the profile's {dispatch:.2f} ms of dispatch: median "
          f"{np.median(host):.2f}, p90 {np.percentile(host, 90):.2f}; mean over every step "
          f"{r['mean_host_ms_per_step']:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name in ("calibrate-h200", "calibrate", "h200", "cpu", "speed"):
        ap.add_argument(f"--{name}", action="store_true")
    ap.add_argument("--model", default="smollm2-135m", help="--calibrate's model")
    ap.add_argument("--dtype", default="auto", help="--calibrate's dtype")
    ap.add_argument("--replays", type=int, default=None,
                    help="--calibrate: times each step is replayed back to back, 0: each timed "
                         "in the run, dispatch to tokens (default 0 on CPU, 20 else)")
    ap.add_argument("--output-json", metavar="FILE", help="--calibrate: append the fit")
    args = ap.parse_args()
    if args.calibrate:
        import jax

        replays = args.replays
        if replays is None:
            replays = 0 if jax.default_backend() == "cpu" else 20
        calibrate(args.model, args.dtype, replays, args.output_json)
    for name in ("calibrate_h200", "h200", "cpu", "speed"):
        if getattr(args, name):
            globals()[name]()


if __name__ == "__main__":
    main()
