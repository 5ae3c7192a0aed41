"""Where the engine-core workload's time goes: every step synchronised and timed, by step shape.

The workload of ``minijax-serve bench`` (64 random prompts, input 32–256, output 16–128, seed 0,
context 512) on SmolLM2-135M, overlap off, after ``warmup()``. Prints the total, then per step
shape the number of steps, their time and the time per step.

    python benchmarks/step_trace.py
"""

from __future__ import annotations

import argparse
import collections
import time

import jax
import numpy as np

from minijax_serve import Engine, SamplingParams
from minijax_serve.bench.datasets import DatasetContext, sample_random
from minijax_serve.executor.model_runner import ModelRunner


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--context-length", type=int, default=512)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--max-running-requests", type=int, default=64)
    parser.add_argument("--chunked-prefill-size", type=int, default=None,
                        help="tokens per prefill step (default: the engine's)")
    args = parser.parse_args(argv)
    engine = Engine(args.model, context_length=args.context_length, enable_overlap=False,
                    skip_tokenizer_init=True, max_running_requests=args.max_running_requests,
                    chunked_prefill_size=args.chunked_prefill_size)
    engine.warmup()
    workload = argparse.Namespace(num_prompts=args.num_prompts, random_input_len=args.input_len,
                                  random_output_len=args.output_len, random_range_ratio=0.125)
    ctx = DatasetContext(engine.model_config.vocab_size, None, args.context_length,
                         np.random.default_rng(0))
    requests = sample_random(workload, ctx)

    steps: list[tuple[tuple, float]] = []
    launch = ModelRunner.run

    def timed_run(runner, fb, shape, *rest):
        start = time.perf_counter()
        out = launch(runner, fb, shape, *rest)
        jax.block_until_ready(out)
        steps.append((shape, time.perf_counter() - start))
        return out

    ModelRunner.run = timed_run
    try:
        start = time.perf_counter()
        engine.generate([r.prompt_ids for r in requests],
                        [SamplingParams(max_new_tokens=r.output_len, ignore_eos=True)
                         for r in requests])
        total = time.perf_counter() - start
    finally:
        ModelRunner.run = launch
    by_shape = collections.defaultdict(list)
    for shape, seconds in steps:
        by_shape[shape].append(seconds)
    print(f"total {total:.1f} s, in steps {sum(s for _, s in steps):.1f} s, {len(steps)} steps")
    for shape, times in sorted(by_shape.items()):
        print(f"tokens {shape.num_tokens:4d} seqs {shape.num_seqs:3d} pages {shape.num_pages:3d}: "
              f"{len(times):4d} steps, {sum(times):6.2f} s, {np.mean(times) * 1e3:6.0f} ms/step")


if __name__ == "__main__":
    main()
