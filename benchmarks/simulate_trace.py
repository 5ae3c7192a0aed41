"""The simulator against a real run's step trace: keep the run as data, fit the device profile
to it, check the calibration (benchmarks/RESULTS.md, "A simulator calibrated on the H200 trace").

    python benchmarks/simulate_trace.py --validate   # per-group step times and the replayed run
    python benchmarks/simulate_trace.py --fit        # fit the H200 profile (for profiles.py)
    python benchmarks/simulate_trace.py --steps      # held-out check: step_roofline's steps
    python benchmarks/gpu_assets.py && python benchmarks/simulate_trace.py --bench
    python benchmarks/simulate_trace.py --extract GPU_DIR   # make benchmarks/data's file anew

* ``--extract GPU_DIR`` reads a GPU session's ``peer_llama_trace.jsonl.gz`` and
  ``peer_llama_trace_run.jsonl`` (the peer_llama workload run with ``--trace``), draws the same
  workload here (``gpu_assets/``, as the GPU machine had it), runs it on the simulated H200
  (identical steps: every scheduling field of every step is checked against the trace) to learn
  each step's sequences (which the trace does not record), and writes
  ``benchmarks/data/h200_peer_llama.jsonl.gz`` (``simulate/recorded_run.py``'s format).
* ``--fit``: fits the profile's matmul and weight-streaming efficiencies, attention cost per
  sequence and fixed cost per layer to the steps whose device time the trace gives
  (``calibration.overlapped_step_times``) and to ``step_roofline.py``'s steps of the same session
  (both models, each step replayed back to back), the weight-streaming efficiency apart for the
  two (a step in a run streams its weights slower than the same step replayed: only the run's
  goes into the profile). Not fitted: the attention kernels' FLOP efficiency and KV bandwidth,
  measured alone (kernels.json, steps.log; the trace's prefill steps hold too little attention
  to tell the first), and the per-step launch cost, 0 (on one model it cannot be told from the
  per-layer cost).
* ``--validate``: the H200 profile's step times per group against the trace's, then the recorded
  workload replayed on the simulated H200: duration and total tok/s against the real run's.
* ``--steps``: ``step_roofline.py``'s steps (qwen3-0.6b and llama-3-8b, every sequence at
  context 2048, replayed back to back) against the profile, and against its replay regime.
* ``--bench``: the peer_llama command of the GPU README with ``--simulate h200`` (needs
  ``gpu_assets/``): the simulated run as a user would run it, against the real one.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

DATA = REPO / "benchmarks" / "data" / "h200_peer_llama.jsonl.gz"
STEPS = REPO / "benchmarks" / "data" / "h200_steps.jsonl"  # step_roofline.py, same session
# the peer_llama run's flags (the GPU README's trace command), and what its engine (commit
# fb80bae) resolved where they left a limit open: the engine that ran the trace
PEER_LLAMA = ["--model", "llama-3-8b", "--num-prompts", "2000", "--context-length", "2048",
              "--sharegpt-max-prompt-len", "1024", "--max-running-requests", "256",
              "--min-token-bucket", "2048", "--min-seq-bucket", "64", "--dtype", "bfloat16",
              "--dataset", "sharegpt", "--dataset-path", "gpu_assets/sharegpt.json",
              "--tokenizer", "gpu_assets/smollm2", "--max-total-tokens", "524288",
              "--chunked-prefill-size", "8192", "--max-prefill-tokens", "4096",
              "--no-enable-mixed-chunk"]
# the run's flags and what its engine resolved where they left a limit open (the pool, the
# chunk, the prefill budget, the steps' composition: their defaults changed since the run)
ENGINE_FLAGS = ("context_length", "max_running_requests", "min_token_bucket", "min_seq_bucket",
                "dtype", "max_total_tokens", "chunked_prefill_size", "max_prefill_tokens",
                "enable_mixed_chunk")
FIGURES = ("duration_s", "total_throughput", "output_throughput", "request_throughput",
           "total_input_tokens", "total_output_tokens", "device", "jax_version", "timestamp")
FITTED = ("matmul_eff", "memory_eff", "attention_seq_s", "layer_s")
PER_REGIME = ("memory_eff",)


def extract(gpu_dir: Path) -> None:
    from minijax_serve import Engine
    from minijax_serve.bench import runner
    from minijax_serve.cli import build_parser
    from minijax_serve.config.flags import engine_config_from_args
    from minijax_serve.simulate.cost_model import step_load
    from minijax_serve.simulate.recorded_run import SCHEDULE, write_recorded_run

    with gzip.open(gpu_dir / "peer_llama_trace.jsonl.gz", "rt") as f:
        records = [json.loads(line) for line in f]
    real = json.loads((gpu_dir / "peer_llama_trace_run.jsonl").read_text().splitlines()[0])
    args = build_parser().parse_args(["bench", *PEER_LLAMA, "--simulate", "h200"])
    requests, config, _ = runner._draw_workload(args, engine_config_from_args(args))
    flags = {k: real.get("resolved_engine_config", real["engine_config"])[k] for k in ENGINE_FLAGS}
    engine = Engine(args.model, simulate="h200", skip_tokenizer_init=True, record_steps=True,
                    **flags)
    loads, cost_step = [], engine.runner.cost.step

    def recorded(num_tokens, q_lens, kv_lens, rows, *rest):
        loads.append(step_load(num_tokens, q_lens, kv_lens, rows))
        return cost_step(num_tokens, q_lens, kv_lens, rows, *rest)

    engine.runner.cost.step = recorded
    from minijax_serve import SamplingParams

    engine.generate([r.prompt_ids for r in requests],
                    [SamplingParams(max_new_tokens=r.output_len, ignore_eos=True)
                     for r in requests])
    mine = [r._asdict() for r in engine.step_records()]
    bad = [i for i, (a, b) in enumerate(zip(records, mine)) if any(a[c] != b[c] for c in SCHEDULE)]
    if len(mine) != len(records) or bad:
        raise SystemExit(f"the simulated steps differ from the trace's ({len(mine)} vs "
                         f"{len(records)} steps; first differing: {bad[:3]})")
    DATA.parent.mkdir(exist_ok=True)
    write_recorded_run(DATA, args.model, flags, {k: real[k] for k in FIGURES},
                       [r.prompt_ids for r in requests], [r.output_len for r in requests],
                       records, loads)
    print(f"{DATA}: {len(records)} steps, {len(requests)} requests, "
          f"{DATA.stat().st_size / 1e3:.0f} kB")


def _print_groups(title: str, profile, cfg, steps) -> None:
    from minijax_serve.simulate.calibration import group_errors

    print(f"\n{title}\n  {'group':<22}{'steps':>6}{'measured ms':>13}{'simulated ms':>14}"
          f"{'error':>8}")
    for g in group_errors(profile, cfg, "bfloat16", steps):
        print(f"  {g.group:<22}{g.steps:>6}{1e3 * g.measured_s:>13.2f}"
              f"{1e3 * g.predicted_s:>14.2f}{100 * g.error:>+7.1f}%")


def _run():
    from minijax_serve.models.config import load_model_config
    from minijax_serve.models.registry import resolve_model
    from minijax_serve.simulate.recorded_run import read_recorded_run, timed_steps

    run = read_recorded_run(DATA)
    return run, load_model_config(resolve_model(run.model).path), timed_steps(run)


def replay_sets() -> list:
    """step_roofline.py's steps, one StepSet per model (regime ``"replay"``), each step its own
    group."""
    from minijax_serve.models.config import load_model_config
    from minijax_serve.models.registry import resolve_model
    from minijax_serve.simulate.calibration import StepSet, TimedSteps
    from minijax_serve.simulate.cost_model import step_load

    by_model: dict[str, list] = {}
    for row in map(json.loads, STEPS.read_text().splitlines()):
        n, new = row["num_seqs"], row["new_tokens"]
        q = np.full(n, new // n)
        kv = q if row["mode"] == "prefill" else np.full(n, row["kv_tokens"] // n)
        group = f"{row['model']} {row['mode']} {n} x {new // n} new / {row['kv_tokens'] // n} KV"
        by_model.setdefault(row["model"], []).append((step_load(new, q, kv, n), row["step_s"],
                                                      group, row["dtype"]))
    return [StepSet(load_model_config(resolve_model(model).path), rows[0][3],
                    TimedSteps([r[0] for r in rows], np.array([r[1] for r in rows]),
                               [r[2] for r in rows]), "replay")
            for model, rows in by_model.items()]


def fit() -> dict:
    from minijax_serve.simulate.calibration import StepSet, fit_profile
    from minijax_serve.simulate.profiles import H200

    run, cfg, steps = _run()
    _print_groups("the H200 profile now", H200, cfg, steps)
    fitted = fit_profile(H200, [StepSet(cfg, "bfloat16", steps), *replay_sets()], FITTED,
                         PER_REGIME)
    print("\nfitted: " + ", ".join(f"{n}={getattr(fitted['run'], n):.4g}" for n in FITTED)
          + "; replayed steps: " + ", ".join(f"{n}={getattr(fitted['replay'], n):.4g}"
                                            for n in PER_REGIME))
    _print_groups("the fitted profile", fitted["run"], cfg, steps)
    step_checks(fitted)
    return fitted


def validate() -> None:
    from minijax_serve.simulate.profiles import H200
    from minijax_serve.bench.replay import replay
    from minijax_serve.simulate.recorded_run import SCHEDULE

    run, cfg, steps = _run()
    _print_groups("step device time by group: the trace against the H200 profile", H200, cfg,
                  steps)
    r = replay(run)
    same = all(np.array_equal(r.steps[c], run.steps[c]) for c in SCHEDULE)
    print(f"\nthe recorded workload replayed on the simulated H200 ({len(r.steps['kind'])} steps, "
          f"{'the same' if same else 'NOT the same'} schedule as the real run; "
          f"{r.wall_s:.1f} s on this machine)")
    for name, sim in (("duration_s", r.duration_s), ("total_throughput", r.total_throughput)):
        real = run.figures[name]
        print(f"  {name:<18}simulated {sim:>10.2f}  real {real:>10.2f}  "
              f"{100 * (sim / real - 1):+.1f}%")


def step_checks(profiles: dict | None = None) -> None:
    """step_roofline.py's steps against the H200 profile (or ``profiles``' run regime) and its
    replay regime."""
    import dataclasses

    from minijax_serve.simulate.calibration import predicted_times
    from minijax_serve.simulate.profiles import H200, H200_REPLAYED_MEMORY_EFF

    run_profile = H200 if profiles is None else profiles["run"]
    replay_profile = (dataclasses.replace(H200, memory_eff=H200_REPLAYED_MEMORY_EFF)
                      if profiles is None else profiles["replay"])
    print(f"\n{'step (replayed back to back)':<42}{'measured ms':>12}"
          f"{'profile':>9}{'error':>8}{'replay regime':>15}{'error':>8}")
    for s in replay_sets():
        for load, measured, group in zip(*s.steps):
            sim, = predicted_times(run_profile, s.cfg, s.dtype, [load])
            rep, = predicted_times(replay_profile, s.cfg, s.dtype, [load])
            print(f"{group:<42}"
                  f"{1e3 * measured:>12.2f}{1e3 * sim:>9.2f}{100 * (sim / measured - 1):>+7.1f}%"
                  f"{1e3 * rep:>15.2f}{100 * (rep / measured - 1):>+7.1f}%")


def bench() -> None:
    from minijax_serve.cli import main
    from minijax_serve.simulate.recorded_run import read_recorded_run

    real = read_recorded_run(DATA).figures
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.jsonl"
        if main(["bench", *PEER_LLAMA, "--simulate", "h200", "--disable-tqdm",
                 "--output-json", str(out)]) != 0:
            raise SystemExit("bench failed")
        sim = json.loads(out.read_text().splitlines()[0])
    for name in ("duration_s", "total_throughput", "output_throughput"):
        print(f"  {name:<18}simulated {sim[name]:>10.2f}  real {real[name]:>10.2f}  "
              f"{100 * (sim[name] / real[name] - 1):+.1f}%")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--extract", metavar="GPU_DIR", type=Path)
    for name in ("fit", "validate", "steps", "bench"):
        ap.add_argument(f"--{name}", action="store_true")
    args = ap.parse_args()
    if args.extract:
        extract(args.extract)
    for name, run in (("fit", fit), ("validate", validate), ("steps", step_checks),
                      ("bench", bench)):
        if getattr(args, name):
            run()


if __name__ == "__main__":
    main()
