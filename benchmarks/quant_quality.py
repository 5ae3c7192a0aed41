"""What FP8 costs in quality, on the CPU: SmolLM2-135M in float32, each quantized mode against the
same engine unquantized (``minijax_serve.bench.quality``):

* the teacher-forced mean NLL per token of the first replies of ``--num-conversations`` ShareGPT
  conversations (drawn as ``bench --dataset sharegpt`` draws them, seed 0: each user turn in the
  chat template with at most ``--max-prompt`` tokens, its reply cut to ``--max-reply``);
* the greedy agreement of ``--continuation``-token continuations of the same user turns.

Modes: ``kv`` (kv_cache_dtype=fp8_e4m3), ``weights`` (quantization=fp8), ``w8a8``
(quantization=fp8_w8a8), ``both`` (fp8 weights and KV), ``w8a8+kv``. The issue's targets: FP8 KV
alone within +1 % of the reference's NLL, FP8 weights within +2 %.

    python benchmarks/quant_quality.py                     # 64 conversations, every mode
    python benchmarks/quant_quality.py --num-conversations 8 --modes kv
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from minijax_serve import Engine  # noqa: E402
from minijax_serve.bench.quality import (  # noqa: E402
    agreement,
    greedy_tokens,
    mean_nll,
    reply_logprobs,
    sharegpt_conversations,
)

MODES = {"kv": dict(kv_cache_dtype="fp8_e4m3"), "weights": dict(quantization="fp8"),
         "w8a8": dict(quantization="fp8_w8a8"),
         "both": dict(quantization="fp8", kv_cache_dtype="fp8_e4m3"),
         "w8a8+kv": dict(quantization="fp8_w8a8", kv_cache_dtype="fp8_e4m3")}
TARGETS = {"kv": 1.0, "weights": 2.0}  # % NLL


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--num-conversations", type=int, default=64)
    p.add_argument("--max-prompt", type=int, default=256)
    p.add_argument("--max-reply", type=int, default=128)
    p.add_argument("--continuation", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    p.add_argument("--output-json", default=None, help="append one JSON line per mode")
    args = p.parse_args(argv)
    context = 1 << (args.max_prompt + args.max_reply + args.continuation).bit_length()
    engine_args = dict(dtype="float32", page_size=16, context_length=context,
                       max_running_requests=16, max_prefill_tokens=1024, min_token_bucket=256,
                       min_seq_bucket=16, max_total_tokens=16 * context)

    def run(name: str, **fields) -> dict:
        start = time.perf_counter()
        engine = Engine(args.model, **engine_args, **fields)
        nll = mean_nll(reply_logprobs(engine, conversations))
        tokens = greedy_tokens(engine, conversations, args.continuation)
        engine.check_invariants()
        return dict(mode=name, config=fields, nll=nll, tokens=tokens,
                    seconds=time.perf_counter() - start)

    reference = Engine(args.model, **engine_args)  # its tokenizer draws the conversations
    conversations = sharegpt_conversations(reference.tokenizer, args.num_conversations,
                                           args.max_prompt, args.max_reply, args.seed)
    reply_tokens = sum(len(c.reply_ids) for c in conversations)
    print(f"{args.model}: {len(conversations)} ShareGPT conversations, {reply_tokens} reply "
          f"tokens (prompts <= {args.max_prompt}, replies <= {args.max_reply}), float32",
          flush=True)
    del reference
    base = run("float32")
    print(f"{'mode':<10} {'mean NLL':>9} {'vs float32':>10} {'tokens equal':>12} "
          f"{'common prefix':>13}  target", flush=True)
    print(f"{'float32':<10} {base['nll']:9.4f} {'':>10} {'':>12} {'':>13}", flush=True)
    for name in args.modes:
        r = run(name, **MODES[name])
        agree = agreement(r["tokens"], base["tokens"])
        change = 100 * (r["nll"] / base["nll"] - 1)
        target = TARGETS.get(name)
        verdict = "" if target is None else f"+{target:.0f} % ({'met' if change <= target else 'MISSED'})"
        print(f"{name:<10} {r['nll']:9.4f} {change:+9.2f}% {agree.token_share * 100:11.1f}% "
              f"{agree.mean_prefix:9.1f} / {args.continuation}  {verdict}", flush=True)
        if args.output_json:
            row = dict(mode=name, config=r["config"], nll=r["nll"], reference_nll=base["nll"],
                       nll_change_pct=change, token_share=agree.token_share,
                       mean_common_prefix=agree.mean_prefix, conversations=len(conversations),
                       reply_tokens=reply_tokens, seconds=r["seconds"])
            with open(args.output_json, "a") as f:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
