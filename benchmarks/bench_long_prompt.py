"""A long prompt arriving while requests decode: what chunked prefill and mixed batches do to the
decoders' inter-token latency.

``--decoders`` requests (random token prompts of ``--decoder-prompt-len``, ``--decoder-output-len``
tokens each, EOS ignored) start together; once every one of them is decoding and
``--steps-before`` decode steps have run, one random prompt of ``--long-prompt-len`` tokens
arrives. Each configuration (a fresh engine, warmed up first) runs the same workload:

* ``off``: ``chunked_prefill_size=-1`` — the long prompt runs in one step;
* ``chunked``: chunks of ``--chunk`` tokens, prefill first (the decoders wait for every chunk);
* ``chunked+mixed``: chunks of ``--chunk`` tokens, each step also decoding every running request.

Reported per configuration: the decoders' inter-token latency (median, p99, max, over every gap
between two tokens of a decoder), the long prompt's time to first token, the wall time from its
arrival until every request finished, and the step counts.

    python benchmarks/bench_long_prompt.py                       # SmolLM2-135M, 4000 + 32 x 64
    python benchmarks/bench_long_prompt.py --model /tmp/tiny --decoders 4 --long-prompt-len 100 \\
        --chunk 32 --decoder-output-len 16 --context-length 128   # seconds, for a check
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run from anywhere: the package of this working tree
    sys.path.insert(0, str(REPO))

from minijax_serve import Engine, SamplingParams  # noqa: E402
from minijax_serve.models.config import load_model_config  # noqa: E402
from minijax_serve.models.registry import resolve_model  # noqa: E402

CONFIGS = {  # name -> EngineConfig overrides (the chunk size is filled in from --chunk)
    "off": dict(chunked_prefill_size=-1, enable_mixed_chunk=False),
    "chunked": dict(enable_mixed_chunk=False),
    "chunked+mixed": dict(enable_mixed_chunk=True),
}


def gaps_ms(token_times: list[float], after: float = -np.inf) -> np.ndarray:
    """Milliseconds between consecutive tokens, for the tokens that came after ``after``."""
    t = np.asarray(token_times)
    return np.diff(t)[t[1:] > after] * 1e3


def run_one(args: argparse.Namespace, overrides: dict, decoder_prompts: list[list[int]],
            long_prompt: list[int]) -> dict:
    engine = Engine(args.model, max_total_tokens=args.max_total_tokens,
                    max_running_requests=args.decoders + 1, context_length=args.context_length,
                    max_prefill_tokens=args.long_prompt_len, skip_tokenizer_init=True,
                    load_format=args.load_format, **overrides)
    engine.warmup()
    num_shapes = len(engine.buckets.all_shapes())
    decode = SamplingParams(max_new_tokens=args.decoder_output_len, ignore_eos=True)
    ids = [engine.add_request(p, decode) for p in decoder_prompts]
    outputs: dict[str, object] = {}
    steps_before = engine.stats()
    while engine.stats()["decode_steps"] - steps_before["decode_steps"] < args.steps_before:
        outputs.update((o.request_id, o) for o in engine.step())
    arrival = time.perf_counter()
    long_id = engine.add_request(long_prompt, SamplingParams(max_new_tokens=args.long_output_len,
                                                             ignore_eos=True))
    while engine.has_unfinished():
        outputs.update((o.request_id, o) for o in engine.step())
    done = time.perf_counter()
    engine.check_invariants()
    gaps = np.concatenate([gaps_ms(outputs[i].token_times) for i in ids])
    after_arrival = np.concatenate([gaps_ms(outputs[i].token_times, arrival) for i in ids])
    stats = engine.stats()
    return {
        "chunked_prefill_size": engine.chunked_prefill_size,
        "enable_mixed_chunk": engine.config.enable_mixed_chunk,
        "itl_median_ms": float(np.median(gaps)), "itl_p99_ms": float(np.percentile(gaps, 99)),
        "itl_max_ms": float(gaps.max()),
        "itl_p99_after_arrival_ms": float(np.percentile(after_arrival, 99)),
        "long_ttft_s": outputs[long_id].first_token_time - arrival,
        "wall_after_arrival_s": done - arrival,
        "prefill_steps": stats["prefill_steps"], "decode_steps": stats["decode_steps"],
        "mixed_steps": stats["mixed_steps"], "chunked_steps": stats["chunked_steps"],
        "num_compiled_shapes": num_shapes,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--load-format", default="auto", help="EngineConfig.load_format")
    parser.add_argument("--decoders", type=int, default=32)
    parser.add_argument("--decoder-prompt-len", type=int, default=64)
    parser.add_argument("--decoder-output-len", type=int, default=64)
    parser.add_argument("--long-prompt-len", type=int, default=4000)
    parser.add_argument("--long-output-len", type=int, default=4)
    parser.add_argument("--steps-before", type=int, default=8)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--context-length", type=int, default=4096)
    parser.add_argument("--max-total-tokens", type=int, default=16384)
    parser.add_argument("--configs", default=",".join(CONFIGS), help="which of: " + ", ".join(CONFIGS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args(argv)
    rng = np.random.default_rng(args.seed)
    vocab = load_model_config(resolve_model(args.model).path).vocab_size
    decoder_prompts = [rng.integers(0, vocab, args.decoder_prompt_len).tolist()
                       for _ in range(args.decoders)]
    long_prompt = rng.integers(0, vocab, args.long_prompt_len).tolist()
    rows = []
    for name in args.configs.split(","):
        overrides = dict(CONFIGS[name])
        overrides.setdefault("chunked_prefill_size", args.chunk)
        row = {"config": name, **run_one(args, overrides, decoder_prompts, long_prompt)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(f"\n{args.decoders} decoders ({args.decoder_prompt_len} + {args.decoder_output_len} "
          f"tokens), one {args.long_prompt_len}-token prompt arriving after {args.steps_before} "
          f"decode steps")
    print("| config | decoder ITL median (ms) | p99 (ms) | p99 after arrival (ms) | max (ms) "
          "| long prompt TTFT (s) | wall after arrival (s) | steps prefill/decode/mixed |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for r in rows:
        print(f"| {r['config']} | {r['itl_median_ms']:.0f} | {r['itl_p99_ms']:.0f} | "
              f"{r['itl_p99_after_arrival_ms']:.0f} | {r['itl_max_ms']:.0f} | "
              f"{r['long_ttft_s']:.2f} | {r['wall_after_arrival_s']:.2f} | "
              f"{r['prefill_steps']}/{r['decode_steps']}/{r['mixed_steps']} |")
    if args.output_json:
        Path(args.output_json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
