"""FP8 on the simulated H200 (every figure simulated): the calibrated cost model's decode step
time at batch 64 and 256, every sequence at ``--context`` keys, on the qwen3-0.6b and
llama-3-8b shapes, in bfloat16, with FP8 weights, with an FP8 KV cache, and with both; and the
KV pool the engine sizes from the H200's memory in each case (context 2048, 4,096 slots).

    python benchmarks/simulate_fp8.py                  # contexts 2048 and 379 (peer_llama's mean)
    python benchmarks/simulate_fp8.py --context 1024
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from minijax_serve.config import EngineConfig  # noqa: E402
from minijax_serve.engine.simulated import simulated_limits  # noqa: E402
from minijax_serve.models.config import load_model_config  # noqa: E402
from minijax_serve.models.registry import resolve_model  # noqa: E402
from minijax_serve.simulate.cost_model import CostModel  # noqa: E402
from minijax_serve.simulate.profiles import device_profile  # noqa: E402

VARIANTS = {"bf16": (None, "auto"), "fp8 weights": ("fp8", "auto"),
            "fp8 KV": (None, "fp8_e4m3"), "fp8 both": ("fp8", "fp8_e4m3")}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["qwen3-0.6b", "llama-3-8b"])
    p.add_argument("--batches", type=int, nargs="+", default=[64, 256])
    p.add_argument("--context", type=int, nargs="+", default=[2048, 379])
    p.add_argument("--device", default="h200")
    args = p.parse_args(argv)
    profile = device_profile(args.device)
    print(f"simulated {profile.name} ({profile.source})")
    for model in args.models:
        cfg = load_model_config(resolve_model(model).path)
        for context in args.context:
            print(f"\n{model}, decode steps, every sequence at {context} keys (simulated ms; "
                  f"speed-up over bf16)")
            print(f"{'batch':>6} " + " ".join(f"{v:>20}" for v in VARIANTS))
            for batch in args.batches:
                cells, base = [], None
                for quantization, kv in VARIANTS.values():
                    cost = CostModel(profile, cfg, jnp.bfloat16, 1, 1, quantization,
                                     jnp.float8_e4m3fn if kv != "auto" else None)
                    ms = 1e3 * cost.step(batch, np.ones(batch), np.full(batch, context),
                                         batch, greedy=True).total_s
                    base = base or ms
                    cells.append(f"{ms:8.2f} ({base / ms:4.2f}x)")
                print(f"{batch:>6} " + " ".join(f"{c:>20}" for c in cells))
        pools = []
        for name, (quantization, kv) in VARIANTS.items():
            config = EngineConfig(simulate=args.device, quantization=quantization,
                                  kv_cache_dtype=kv, max_running_requests=4096)
            limits = simulated_limits(config, cfg, profile, jnp.bfloat16, 2048, 1, 1)
            pools.append(f"{name} {limits.pool_tokens:,}")
        print(f"{model}: KV pool tokens (simulated sizing): " + "; ".join(pools))


if __name__ == "__main__":
    main()
