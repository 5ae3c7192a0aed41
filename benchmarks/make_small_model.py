"""Write a model directory with SmolLM2's tokenizer and a tiny shape, for dummy-weight runs.

Scheduler benchmarks (admission, KV usage, retracts) need real prompts — ShareGPT, tokenized —
and thousands of decode steps, which the real 135M model makes slow on a CPU. The directory holds
SmolLM2's tokenizer files and a ``config.json`` of the same vocabulary and context but 2 layers
of width 64; run it with ``--load-format dummy`` (random weights: the text is noise, the token
counts and the scheduling are real, since the bench ignores EOS).

    python benchmarks/make_small_model.py /tmp/smol-tiny
    minijax-serve bench --model /tmp/smol-tiny --load-format dummy --dataset sharegpt ...
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from minijax_serve.models.registry import resolve_model

SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    out = parser.parse_args().out
    source = resolve_model("smollm2-135m").path
    out.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(source / name, out / name)
    config = json.loads((source / "config.json").read_text()) | SHAPE
    (out / "config.json").write_text(json.dumps(config, indent=1))
    print(f"wrote {out} ({', '.join(f'{k}={v}' for k, v in SHAPE.items())})")


if __name__ == "__main__":
    main()
