"""KV usage, new-token ratio and queue over a ShareGPT run, step by step, in phases.

Runs the offline ShareGPT workload (every request queued at t0, EOS ignored, output lengths from
the dataset) through ``Engine.step`` and prints, for each twelfth of the run's steps, the mean
token usage, the mean new-token ratio, the mean waiting and running counts and the retracts so
far: where adaptive admission leaves the pool partly empty, and why. The requests ignore EOS,
so ``--no-exact-ignore-eos-admission`` is what makes the ratio rule admit them.

    python benchmarks/make_small_model.py /tmp/smol-tiny
    python benchmarks/usage_trace.py --model /tmp/smol-tiny --load-format dummy \\
        --num-prompts 256 --context-length 2048 --max-total-tokens 28672 --max-running-requests 256 \\
        --no-exact-ignore-eos-admission
"""

from __future__ import annotations

import argparse

import numpy as np

from minijax_serve import Engine, SamplingParams
from minijax_serve.bench.datasets import DatasetContext, sample_sharegpt
from minijax_serve.config.flags import add_engine_args, engine_config_from_args


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--phases", type=int, default=12)
    add_engine_args(parser, exclude=("seed",))
    args = parser.parse_args()
    engine = Engine(args.model, config=engine_config_from_args(args))
    sample_args = argparse.Namespace(num_prompts=args.num_prompts, dataset_path=None,
                                     sharegpt_output_len=None, seed=args.seed)
    ctx = DatasetContext(engine.model_config.vocab_size, engine.tokenizer, engine.context_length,
                         np.random.default_rng(args.seed))
    for req in sample_sharegpt(sample_args, ctx):
        engine.add_request(req.prompt_ids, SamplingParams(max_new_tokens=req.output_len,
                                                          ignore_eos=True))
    rows = []
    while engine.has_unfinished():
        engine.step()
        stats = engine.stats()
        rows.append((stats["token_usage"], stats["new_token_ratio"], len(engine.scheduler.waiting),
                     len(engine.scheduler.running), stats["num_retracted"]))
    trace = np.array(rows)
    queued = trace[:, 2] > 0
    print(f"{len(trace)} steps, {queued.sum()} with requests waiting; mean usage "
          f"{trace[:, 0].mean():.3f} (all), {trace[queued, 0].mean():.3f} (waiting); "
          f"{trace[-1, 4]:.0f} retracts")
    print(f"{'steps':>11} {'usage':>6} {'ratio':>6} {'waiting':>8} {'running':>8} {'retracts':>9}")
    size = -(-len(trace) // args.phases)
    for lo in range(0, len(trace), size):
        seg = trace[lo:lo + size]
        print(f"{lo:>5}-{lo + len(seg) - 1:<5} {seg[:, 0].mean():6.3f} {seg[:, 1].mean():6.3f} "
              f"{seg[:, 2].mean():8.1f} {seg[:, 3].mean():8.1f} {seg[-1, 4]:9.0f}")
    engine.check_invariants()


if __name__ == "__main__":
    main()
