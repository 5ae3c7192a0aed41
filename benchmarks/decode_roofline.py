"""Where a decode step's time goes: the roofline of the recorded H200 run's decode steps of one
sequence bucket (their real, ragged contexts), against their measured device time and the
calibrated cost model's parts (benchmarks/RESULTS.md, "Where a decode step's time goes").

    python benchmarks/decode_roofline.py            # llama-3-8b, the 256-sequence bucket
    python benchmarks/decode_roofline.py --seqs 64

Bytes and FLOPs of the step at the median KV length of the bucket's steps: the weights (every
layer's matrices, the LM head; bfloat16), the K and V of every key and new token of every layer,
the float32 logits written by the model and read by the sampler (argmax); FLOPs of the matrices
over the padded tokens, of the LM head over the padded rows and of attention over the real
(query, key) pairs. Roofline times against the profile's ceilings (the measured square matmul
and copy) and against the H200's datasheet (989 TFLOP/s dense bf16, 4.8 TB/s).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

DATA = REPO / "benchmarks" / "data" / "h200_peer_llama.jsonl.gz"
DATASHEET_FLOPS, DATASHEET_BW = 989e12, 4.8e12


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqs", type=int, default=256, help="the decode steps' sequence bucket")
    args = ap.parse_args()

    from minijax_serve.models.config import load_model_config
    from minijax_serve.models.registry import resolve_model
    from minijax_serve.simulate.calibration import step_group
    from minijax_serve.simulate.cost_model import CostModel
    from minijax_serve.simulate.profiles import H200
    from minijax_serve.simulate.recorded_run import read_recorded_run, timed_steps

    run = read_recorded_run(DATA)
    cfg = load_model_config(resolve_model(run.model).path)
    steps = timed_steps(run)
    group = step_group("decode", args.seqs, args.seqs)
    mine = [i for i, g in enumerate(steps.groups) if g == group]
    if not mine:
        raise SystemExit(f"no {group} steps in {DATA.name}")
    keys = np.array([steps.loads[i].keys for i in mine])
    load = steps.loads[mine[int(np.argsort(keys)[len(keys) // 2])]]  # the median KV length
    measured = steps.measured_s[mine]
    start = run.steps["start_s"]
    ticks = np.array([start[i + 1] - start[i] for i in mine if i + 1 < len(start)])

    b, L, h, v = 2, cfg.num_layers, cfg.hidden_size, cfg.vocab_size
    cost = CostModel(H200, cfg, "bfloat16")
    layer_params, kv_per_token = cost.layer_params, cost.kv_bytes_per_token
    parts = {  # name: (bytes, FLOPs)
        "weights (layers)": (L * layer_params * b, 2.0 * load.num_tokens * layer_params * L),
        "LM head": (h * v * b, 2.0 * load.logit_rows * h * v),
        "K and V": (L * (load.keys + load.new_tokens) * kv_per_token,
                    L * cost.attn_flops_per_key * load.pairs),
        "logits and sampler": (2 * 4.0 * load.logit_rows * v, 0.0),
    }
    print(f"{run.model}, {group}: {len(mine)} steps, median KV {load.keys:,} tokens over "
          f"{load.seqs} sequences (mean context {load.keys / load.seqs:.0f})")
    print(f"\n  {'part':<20}{'GB':>8}{'TFLOP':>8}{'ms at ceilings':>16}{'ms at datasheet':>17}")
    total = np.zeros(4)
    for name, (nbytes, flops) in parts.items():
        row = np.array([nbytes / 1e9, flops / 1e12,
                        1e3 * max(nbytes / H200.memory_bw, flops / H200.matmul_flops),
                        1e3 * max(nbytes / DATASHEET_BW, flops / DATASHEET_FLOPS)])
        total += row
        print(f"  {name:<20}{row[0]:>8.2f}{row[1]:>8.2f}{row[2]:>16.2f}{row[3]:>17.2f}")
    print(f"  {'sum (each its max)':<20}{total[0]:>8.2f}{total[1]:>8.2f}{total[2]:>16.2f}"
          f"{total[3]:>17.2f}")
    c = cost.cost(load, greedy=True)
    print(f"\n  the calibrated cost model (simulated): {1e3 * c.total_s:.2f} ms = matmuls "
          f"{1e3 * c.matmul_s:.2f} + attention {1e3 * c.attention_s:.2f} (of it "
          f"{1e3 * L * load.seqs * H200.attention_seq_s:.2f} per sequence) + LM head, logits "
          f"and sampler {1e3 * c.head_s:.2f} + fixed {1e3 * c.launch_s:.2f}")
    read = measured[np.isfinite(measured)]
    print(f"  measured device time (trace, {len(read)} steps read): median "
          f"{1e3 * np.median(read):.2f} ms, p10 {1e3 * np.percentile(read, 10):.2f}, p90 "
          f"{1e3 * np.percentile(read, 90):.2f}; the ticks that dispatched them: median "
          f"{1e3 * np.median(ticks):.2f} ms (each waits for the step before: a prefill after "
          "a prefill, often)")


if __name__ == "__main__":
    main()
